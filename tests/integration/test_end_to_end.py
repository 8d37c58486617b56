"""The walking skeleton, hop by hop, on real servers and real processes:
apply_async(countdown) -> Redis ZSET -> poller (etcd leader) -> Kafka topic -> stock worker -> result."""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import redis
from confluent_kafka import Consumer

from celery_delayed import store_of
from celery_delayed.envelope import Envelope
from celery_delayed.store.layout import BUCKET_SECONDS, member_of
from tasks import create_app

from .support import wait_for


def read_topic(settings, topic: str, want_key: str, timeout: float = 60.0):
    """Read ``topic`` from the start with a private group until a record keyed ``want_key`` shows up."""
    consumer = Consumer(settings.kafka(**{"group.id": f"probe-{os.getpid()}-{want_key}",
                                          "auto.offset.reset": "earliest", "enable.auto.commit": False}))
    consumer.subscribe([topic])
    try:
        def found():
            for record in consumer.consume(num_messages=100, timeout=0.5):
                if not record.error() and record.key() == want_key.encode():
                    return record
        return wait_for(found, timeout, f"a record keyed {want_key} on {topic}", interval=0)
    finally:
        consumer.close()


def test_countdown_task_goes_store_then_kafka_then_worker(overrides, processes):
    app = create_app(**overrides)
    settings = app.amqp.delayed_settings
    store = store_of(app)
    broker = redis.Redis.from_url(app.conf.broker_url)
    queue = overrides["task_default_queue"]

    result = app.tasks["tasks.demo.add"].apply_async((2, 2), countdown=3)

    # Hop 1: in the delayed store's sorted set, not on the broker.
    entry = store.get(result.id)
    assert entry["state"] == "scheduled" and entry["task"] == "tasks.demo.add" and entry["queue"] == queue
    bucket = entry["due_ms"] // 1000 // BUCKET_SECONDS * BUCKET_SECONDS
    assert store.redis.zscore(store.keys.bucket(entry["partition"], bucket, queue), member_of(result.id)) == entry["due_ms"]
    assert broker.llen(queue) == 0

    processes.poller()
    worker = processes.worker()

    # Hop 2: the poller published it, keyed by task id, on the queue's topic.
    record = read_topic(settings, settings.topic(queue), result.id)
    assert Envelope.decode(record.value()).task_name == "tasks.demo.add"
    # not before it was due, less the dispatch lead (the worker holds it for that; 5 ms for rounding)
    assert record.timestamp()[1] >= entry["due_ms"] - settings.dispatch_lead * 1000 - 5

    # Hop 3: a worker process ran it.
    assert result.get(timeout=60) == 4
    meta = app.backend.get_task_meta(result.id)
    assert meta["worker"].startswith("w1@")
    assert worker.poll() is None
    wait_for(lambda: store.get(result.id) is None, 10, "the store to forget the delivered task")


def test_task_without_eta_keeps_the_normal_broker(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    processes.worker()
    result = app.tasks["tasks.demo.add"].delay(1, 1)
    assert result.get(timeout=60) == 2
    assert store.get(result.id) is None
    assert sum(row["scheduled"] + row["inflight"] for row in store.counts()) == 0


def test_short_countdown_takes_the_normal_path(overrides, processes):
    app = create_app(**overrides, delayed_min_delay=5)
    store = store_of(app)
    processes.worker()
    result = app.tasks["tasks.demo.add"].apply_async((3, 4), countdown=1)
    assert store.get(result.id) is None
    assert result.get(timeout=60) == 7


def test_a_task_run_from_kafka_sees_the_eta_it_was_scheduled_with(overrides, processes):
    """``self.request.eta`` inside the task is its scheduled ETA (task code reads it for lateness
    and deadlines), though Celery's own ETA timer never held it on the worker."""
    app = create_app(**overrides)
    eta = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=2)
    result = app.tasks["tasks.demo.eta_seen"].apply_async(eta=eta)
    processes.poller()
    processes.worker("w1")
    assert datetime.fromisoformat(result.get(timeout=60)) == eta
