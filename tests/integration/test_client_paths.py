"""Every way a Celery user gives a task an ETA lands in the store, then runs once in a real worker;
expiry, durable revoke and bad input, as a Celery user meets them."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery, chain, chord, group, states
from celery.exceptions import TaskRevokedError
from celery.signals import after_task_publish
from kombu.exceptions import EncodeError

import celery_delayed
from celery_delayed import DelayedPublishError, StoreUnavailable, store_of
from celery_delayed.envelope import Envelope, decode_meta
from celery_delayed.kafka import CLAIMED_HEADER, DUE_HEADER, ensure_topics, make_producer
from tasks import create_app

from .support import held_by_workers, wait_for

pytestmark = pytest.mark.cluster_too
from .test_flower_and_retries import http_json


def runs(app: Celery, run: str) -> dict[str, int]:
    """Executions per task id recorded by the demo tasks of run ``run``."""
    counts = store_of(app).redis.hgetall(f"demo:{run}:runs")
    return {k.decode(): int(v) for k, v in counts.items()}


def scheduled(store, task_id: str) -> bool:
    entry = store.get(task_id)
    return entry is not None and entry["state"] == "scheduled"


def date_done(app: Celery, task_id: str) -> datetime:
    return datetime.fromisoformat(app.backend.get_task_meta(task_id)["date_done"])


def test_every_eta_path_lands_in_the_store_and_runs_once(overrides, processes, monkeypatch):
    overrides["accept_content"] = ["json", "pickle", "msgpack"]
    monkeypatch.setenv("C_FORCE_ROOT", "1")  # a root worker accepting pickle needs it (the test machine runs as root)
    app = create_app(**overrides)
    store = store_of(app)
    broker = redis.Redis.from_url(app.conf.broker_url)
    work = app.tasks["tasks.demo.work"]
    client = Celery("client")  # registers no task: send_task by name only
    client.config_from_object("config.celeryconfig")
    client.conf.update(overrides)
    celery_delayed.install(client)
    run = uuid.uuid4().hex
    eta = datetime.now(timezone.utc) + timedelta(seconds=4)

    singles = {
        "eta, aware": work.apply_async((run,), eta=eta),
        "eta, naive (UTC)": work.apply_async((run,), eta=eta.replace(tzinfo=None)),
        "countdown": work.apply_async((run,), countdown=4),
        "send_task countdown": app.send_task("tasks.demo.work", (run,), countdown=4),
        "send_task eta, not registered in the client": client.send_task("tasks.demo.work", (run,), eta=eta),
        "pickle": work.apply_async((run,), countdown=4, serializer="pickle"),
        "msgpack": work.apply_async((run,), countdown=4, serializer="msgpack"),
    }
    chained = chain(work.si(run).set(countdown=3), work.si(run).set(countdown=3)).apply_async()
    grouped = group(work.si(run).set(countdown=3) for _ in range(3)).apply_async()
    chorded = chord([work.si(run).set(countdown=3) for _ in range(2)], work.si(run)).apply_async()
    retried_eta = app.tasks["tasks.demo.flaky_eta"].apply_async((run, 1, 2.0), countdown=2)
    retried_auto = app.tasks["tasks.demo.flaky_auto"].apply_async((run, 2), countdown=2)
    first_hops = [*singles.values(), chained.parent, *grouped.results, *chorded.parent.results, retried_eta,
                  retried_auto]
    assert [r.id for r in first_hops if not scheduled(store, r.id)] == []
    assert broker.llen(overrides["task_default_queue"]) == 0
    assert store.get(singles["eta, naive (UTC)"].id)["due_ms"] == int(eta.timestamp() * 1000)

    processes.poller()
    processes.worker("w1")
    wait_for(lambda: app.control.inspect(timeout=1).ping(), 60, "the worker to answer")
    # The autoretry's retry waits in the store (retries header 1, then 2 for 4 s), not in a worker's memory
    # (>= 1: on a loaded machine the worker may answer the ping after the first retry's 2 s are over).
    wait_for(lambda: (store.get(retried_auto.id) or {}).get("headers", {}).get("retries", 0) >= 1, 60,
             "the automatic retry to be scheduled in the store")
    # A worker holds a task in Celery's ETA timer only for the rest of delayed_dispatch_lead (the poller sends
    # it that much early), never for its countdown: nothing it holds is due later than the lead from now.
    asked = datetime.now(timezone.utc)
    horizon = asked + timedelta(seconds=store.settings.dispatch_lead + 0.25)
    assert [t for t in held_by_workers(app, run) if datetime.fromisoformat(t["eta"]) > horizon] == []

    for name, result in singles.items():
        assert result.get(timeout=60) == result.id, name
    assert date_done(app, singles["eta, aware"].id) >= eta
    assert chained.get(timeout=60) == chained.id
    assert grouped.get(timeout=60) == [r.id for r in grouped.results]
    assert chorded.get(timeout=60) == chorded.id
    assert retried_eta.get(timeout=60) == 2 and retried_auto.get(timeout=60) == 3

    counted = runs(app, run)
    ran_once = [*singles.values(), chained.parent, chained, *grouped.results, *chorded.parent.results, chorded]
    assert {r.id: counted.get(r.id) for r in ran_once} == {r.id: 1 for r in ran_once}
    assert (counted[retried_eta.id], counted[retried_auto.id]) == (2, 3)
    assert len(counted) == len(ran_once) + 2  # nothing else ran


def test_after_task_publish_fires_and_the_task_sent_event_carries_the_eta(overrides):
    app = create_app(**overrides)
    published: list[dict] = []
    events: list[dict] = []

    def on_publish(sender=None, headers=None, **_):
        published.append(headers)

    after_task_publish.connect(on_publish, weak=False)
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-sent": events.append})
        listener = threading.Thread(target=_capture, args=(receiver,), daemon=True)
        listener.start()
        binding = "_kombu.binding.celeryev"
        broker = redis.Redis.from_url(app.conf.broker_url)
        wait_for(lambda: any(receiver.queue.name.encode() in m for m in broker.smembers(binding)), 10,
                 "the event receiver to bind")
        try:
            result = app.tasks["tasks.demo.add"].apply_async((2, 2), countdown=600)
            sent = wait_for(lambda: [e for e in events if e["uuid"] == result.id], 10, "the task-sent event")
        finally:
            receiver.should_stop = True
            after_task_publish.disconnect(on_publish)
            listener.join(timeout=5)
    due = datetime.fromtimestamp(store_of(app).get(result.id)["due_ms"] / 1000, timezone.utc)
    assert abs(datetime.fromisoformat(sent[0]["eta"]) - due) < timedelta(milliseconds=1)
    assert [h["eta"] for h in published if h["id"] == result.id] == [sent[0]["eta"]]


def _capture(receiver) -> None:
    try:
        receiver.capture(limit=None, timeout=30, wakeup=False)
    except socket.timeout:
        pass


def test_a_task_that_expires_before_it_is_due_is_recorded_as_expired_not_stored(overrides):
    app = create_app(**overrides)
    store = store_of(app)
    add = app.tasks["tasks.demo.add"]
    by_seconds = add.apply_async((1, 1), countdown=60, expires=30)
    by_datetime = add.apply_async((1, 1), eta=datetime.now(timezone.utc) + timedelta(minutes=5),
                                  expires=datetime.now(timezone.utc) + timedelta(minutes=1))
    for result in (by_seconds, by_datetime):
        assert store.get(result.id) is None
        meta = app.backend.get_task_meta(result.id)
        assert meta["status"] == states.REVOKED and meta["name"] == "tasks.demo.add"
        with pytest.raises(TaskRevokedError, match="expired"):
            result.get(timeout=5)
    assert sum(r["scheduled"] for r in store.counts()) == 0


def test_tasks_that_expire_after_their_due_time_keep_celerys_expiry_handling(overrides, processes):
    app = create_app(**overrides)
    work = app.tasks["tasks.demo.work"]
    run = uuid.uuid4().hex
    fresh = work.apply_async((run,), countdown=2, expires=120)
    stale = work.apply_async((run,), countdown=2, expires=4)  # due, but expired by the time a worker sees it
    assert store_of(app).get(stale.id)["expires"] == stale_expires(app, stale.id)
    time.sleep(5)
    processes.poller()
    processes.worker("w1")
    assert fresh.get(timeout=60) == fresh.id
    wait_for(lambda: app.backend.get_task_meta(stale.id)["status"] == states.REVOKED, 60,
             "the worker to revoke the expired task")
    assert runs(app, run) == {fresh.id: 1}


def stale_expires(app: Celery, task_id: str) -> str:
    return store_of(app).get(task_id)["headers"]["expires"]


def test_revoke_takes_scheduled_tasks_out_of_the_store_for_good(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    work = app.tasks["tasks.demo.work"]
    run = uuid.uuid4().hex
    port = 15900 + uuid.uuid4().int % 90
    processes.start("flower", "flower", f"--port={port}", "--address=127.0.0.1",
                    env={"FLOWER_UNAUTHENTICATED_API": "true"})
    by_result, by_control, by_flower, kept = (work.apply_async((run,), countdown=3) for _ in range(4))
    wait_for(lambda: http_json(f"http://127.0.0.1:{port}/api/workers") is not None, 60, "Flower to answer")

    by_result.revoke()
    app.control.revoke([by_control.id])
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/task/revoke/{by_flower.id}", method="POST",
                                     data=b"")
    assert urllib.request.urlopen(request, timeout=10).status == 200
    for result in (by_result, by_control, by_flower):
        assert store.get(result.id) is None
        assert app.backend.get_task_meta(result.id)["status"] == states.REVOKED

    # Workers started only now never saw the broadcasts: the store alone keeps the revoke.
    processes.poller()
    processes.worker("w1")
    assert kept.get(timeout=60) == kept.id
    time.sleep(2)
    assert runs(app, run) == {kept.id: 1}


def test_revoke_of_a_task_in_flight_falls_back_to_the_workers(overrides, processes):
    overrides["delayed_visibility_timeout"] = 1
    app = create_app(**overrides)
    store = store_of(app)
    run = uuid.uuid4().hex
    processes.worker("w1")
    wait_for(lambda: app.control.inspect(timeout=1).ping(), 60, "the worker to answer")
    result = app.tasks["tasks.demo.work"].apply_async((run,), countdown=1.5)
    time.sleep(1.6)
    claimed = store.claim(store.partition(result.id), token=1, limit=10)  # as a poller that then stalls
    assert [item[0] for item in claimed.items] == [result.id]

    app.control.revoke(result.id)
    assert store.get(result.id)["state"] == "inflight"  # the store cannot drop it any more...
    processes.poller()  # ...the claim expires, a poller dispatches it, and the worker drops it
    wait_for(lambda: app.backend.get_task_meta(result.id)["status"] == states.REVOKED, 60,
             "the worker to revoke the task")
    assert runs(app, run) == {}


def test_a_revoke_is_remembered_for_tasks_already_on_kafka_and_for_running_tasks_that_retry(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    run = uuid.uuid4().hex
    # On Kafka: dispatched and gone from the store, no worker alive to hear the broadcast.
    processes.poller()
    on_kafka = app.tasks["tasks.demo.work"].apply_async((run,), countdown=1.5)
    wait_for(lambda: store.get(on_kafka.id) is None, 60, "Kafka to confirm the task (the store forgets it)")
    app.control.revoke(on_kafka.id)

    # Running, then retrying into the store after its revoke; its worker is then replaced.
    w1 = processes.worker("w1")
    retrying = app.tasks["tasks.demo.flaky"].apply_async((run, 1), {"countdown": 4, "seconds": 2}, countdown=1.5)
    wait_for(lambda: retrying.id in runs(app, run), 60, "the flaky task to start")
    app.control.revoke(retrying.id)
    wait_for(lambda: scheduled(store, retrying.id), 30, "the retry to be stored")
    os.killpg(w1.pid, signal.SIGTERM)
    w1.wait(timeout=30)
    processes.worker("w2")
    for result in (on_kafka, retrying):
        wait_for(lambda: app.backend.get_task_meta(result.id)["status"] == states.REVOKED, 60,
                 f"{result.id} to be recorded as revoked")
    wait_for(lambda: store.get(retrying.id) is None, 30, "the retry to be dispatched")
    time.sleep(2)
    assert runs(app, run) == {retrying.id: 1}  # the task on Kafka never ran, the retry did not run again


def test_a_chord_whose_scheduled_member_is_revoked_still_completes_as_celery_would(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    work = app.tasks["tasks.demo.work"]
    run = uuid.uuid4().hex
    chorded = chord([work.si(run).set(countdown=2) for _ in range(2)], work.si(run)).apply_async()
    revoked, kept = chorded.parent.results
    revoked.revoke()
    assert store.get(revoked.id) is None and scheduled(store, kept.id)
    processes.poller()
    processes.worker("w1")
    wait_for(lambda: chorded.state == states.FAILURE, 60, "the chord callback to fail with Celery's ChordError")
    assert type(chorded.result).__name__ == "ChordError" and revoked.id in str(chorded.result)
    assert runs(app, run) == {kept.id: 1}  # the revoked member and the callback never ran


def test_bad_input_is_refused_with_a_clear_error_and_nothing_is_stored(overrides):
    app = create_app(**overrides, delayed_max_message_bytes=2048)
    store = store_of(app)
    add = app.tasks["tasks.demo.add"]
    with pytest.raises(EncodeError):
        add.apply_async((object(), 1), countdown=60)
    with pytest.raises(DelayedPublishError, match=r"message is \d+ bytes, over delayed_max_message_bytes=2048"):
        add.apply_async(("x" * 3000, "y"), countdown=60)
    with pytest.raises(DelayedPublishError, match="queue name 'no spaces' cannot be a Kafka topic"):
        add.apply_async((1, 1), countdown=60, queue="no spaces")
    with pytest.raises(DelayedPublishError, match="eta 'tomorrow' is not an ISO 8601 time"):
        app.send_task("tasks.demo.add", (1, 1), eta="tomorrow")
    assert sum(r["scheduled"] for r in store.counts()) == 0


def test_a_message_kafkas_producer_would_refuse_is_refused_at_apply_time_naming_both_sizes(overrides):
    app = create_app(**overrides)  # librdkafka's message.max.bytes (1,000,000) under the 1 MiB default
    big = os.urandom(1_030_000)  # pickled: ~1.03 MB, under delayed_max_message_bytes, incompressible
    with pytest.raises(DelayedPublishError, match=r"Kafka record of 103\d{4} bytes .* over the producer's "
                                                  r"message\.max\.bytes=1000000"):
        app.tasks["tasks.demo.add"].apply_async((big, "x"), countdown=60, serializer="pickle")
    assert sum(r["scheduled"] for r in store_of(app).counts()) == 0


def test_the_largest_message_apply_accepts_is_one_kafka_carries(overrides):
    limit = 20_000
    app = create_app(**overrides, delayed_kafka_config={"message.max.bytes": limit},
                     delayed_compress_min_bytes=10**9)  # never compressed: sizes are exact
    amqp, settings = app.amqp, store_of(app).settings
    queue = overrides["task_default_queue"]

    def stored(n: int) -> bytes:
        task_id = str(uuid.uuid4())
        return amqp.stored_form(Envelope(task_id=task_id, queue=queue, headers={"task": "tasks.demo.add",
                                                                                "id": task_id},
                                         body=b"x" * n, content_type="application/json", content_encoding="utf-8"))

    fits = max(n for n in range(limit - 1000, limit) if _accepted(stored, n))
    with pytest.raises(DelayedPublishError, match=f"over the producer's message.max.bytes={limit}"):
        stored(fits + 1)
    data, now = stored(fits), store_of(app).now_ms()
    ensure_topics(settings, [queue])
    producer, reports = make_producer(settings), []
    producer.produce(settings.topic(queue), key=decode_meta(data)["id"], value=data,
                     headers=[(DUE_HEADER, str(now)), (CLAIMED_HEADER, str(now))],  # as the poller sends it
                     on_delivery=lambda err, msg: reports.append(err))
    producer.flush(30)
    assert reports == [None]  # the real producer, with that message.max.bytes, delivered it


def _accepted(stored, n: int) -> bool:
    try:
        stored(n)
        return True
    except DelayedPublishError:
        return False


def test_a_store_that_is_down_fails_the_apply(overrides):
    app = create_app(**{**overrides, "delayed_redis_url": "redis://127.0.0.1:1/0"})
    with pytest.raises(StoreUnavailable, match="delayed store at redis://127.0.0.1:1/0 unavailable"):
        app.tasks["tasks.demo.add"].apply_async((1, 1), countdown=60)
