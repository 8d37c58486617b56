"""The poller against errors it must survive: Kafka's transient ones, a producer that fails fatally,
a full local queue; pause records it cannot read.  Each fault is injected by a thin wrapper around the REAL producer (one chosen
call raises, or one report carries an error); every message it lets through goes to the real broker."""
from __future__ import annotations

import logging
import time

import redis
from confluent_kafka import KafkaError, KafkaException, Producer
from prometheus_client import REGISTRY

from celery_delayed.kafka import make_producer
from celery_delayed.poller.loop import Poller
from celery_delayed.sandbox import running
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetters

from .support import TopicReader, envelopes, wait_for
from .test_poller import now_ms, small_topic, too_big


class Wrapped:
    """The real producer; subclasses change one thing about ``produce``."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.producer, name)

    def produce(self, topic: str, key: str, value: bytes, on_delivery, **options) -> None:
        self.calls += 1
        self.producer.produce(topic, key=key, value=value, on_delivery=on_delivery, **options)


class RaisesOnce(Wrapped):
    """The first ``produce`` raises ``error``; with ``sticky``, so does every later one (as a
    producer in a fatal state does)."""

    def __init__(self, producer: Producer, error: KafkaError, sticky: bool = False) -> None:
        super().__init__(producer)
        self.error, self.sticky, self.raised = error, sticky, 0

    def produce(self, topic: str, key: str, value: bytes, on_delivery, **options) -> None:
        if not self.raised or self.sticky:
            self.raised += 1
            raise KafkaException(self.error)
        super().produce(topic, key, value, on_delivery, **options)


class FatalReport(Wrapped):
    """The first message goes to Kafka but its delivery report says the producer failed fatally;
    from then on every ``produce`` raises, as librdkafka's does in that state."""

    FATAL = KafkaError(KafkaError._FATAL, "injected: idempotent producer out of sequence", fatal=True)

    def produce(self, topic: str, key: str, value: bytes, on_delivery, **options) -> None:
        if self.calls:
            raise KafkaException(self.FATAL)
        super().produce(topic, key, value, lambda err, msg: on_delivery(err or self.FATAL, msg), **options)


class BufferFullFirst(Wrapped):
    """Every first try to produce a message finds the local queue full (BufferError): every other
    call raises, and the poller retries the same message right after one that raised."""

    def __init__(self, producer: Producer) -> None:
        super().__init__(producer)
        self.full = False

    def produce(self, topic: str, key: str, value: bytes, on_delivery, **options) -> None:
        self.full = not self.full
        if self.full:
            raise BufferError("Local: Queue full")
        super().produce(topic, key, value, on_delivery, **options)


def dispatch_with(settings: Settings, queue: str, producer: Wrapped, n: int = 5) -> Poller:
    """Schedule ``n`` due tasks, run a poller with ``producer`` until all reach Kafka, none dead-lettered."""
    store = DelayedStore(settings)
    reader = TopicReader(settings, settings.topic(queue))
    store.schedule_many(envelopes(n, queue, now_ms()))
    poller = Poller(settings, store=store, producer=producer)
    with running(poller) as thread:
        keys = reader.read_until(n, timeout=30)
        alive = thread.is_alive()
    reader.close()
    assert alive, "the poller loop died"
    assert sorted(keys) == sorted(f"task-{i}" for i in range(n)), f"dead letters: {DeadLetters(store).count()}"
    assert DeadLetters(store).count() == 0
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 20, "the store to empty")
    return poller


def test_a_transient_produce_error_defers_the_task_and_it_is_delivered(overrides):
    settings = Settings.from_conf(overrides, partitions=1)
    producer = RaisesOnce(make_producer(settings), KafkaError(KafkaError._TRANSPORT, "injected: broker went away"))
    poller = dispatch_with(settings, overrides["task_default_queue"], producer)
    assert producer.raised == 1
    assert poller.stats["delivery_failed"] == 1 and poller.stats["dead_lettered"] == 0


def test_a_fatal_produce_error_replaces_the_producer_and_nothing_is_dead_lettered(overrides):
    settings = Settings.from_conf(overrides, partitions=1)
    fatal = KafkaError(KafkaError._FATAL, "injected: fatal idempotent producer error", fatal=True)
    producer = RaisesOnce(make_producer(settings), fatal, sticky=True)
    poller = dispatch_with(settings, overrides["task_default_queue"], producer)
    assert poller.stats["producer_replaced"] == 1
    assert type(poller.delivery.producer) is Producer  # the wrapper, for ever fatal, is gone


def test_a_fatal_error_in_a_delivery_report_replaces_the_producer(overrides):
    settings = Settings.from_conf(overrides, partitions=1)
    poller = dispatch_with(settings, overrides["task_default_queue"], FatalReport(make_producer(settings)))
    assert poller.stats["producer_replaced"] == 1
    assert type(poller.delivery.producer) is Producer


def test_a_full_local_queue_while_resending_a_refused_batch_alone_is_waited_out(overrides):
    settings = Settings.from_conf(overrides, partitions=1)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, small_topic(settings, queue))
    store.schedule_many([("big", now_ms(), too_big("big", queue)), *envelopes(5, queue, now_ms())])
    producer = BufferFullFirst(make_producer(settings))
    poller = Poller(settings, store=store, producer=producer)
    with running(poller) as thread:
        letter = wait_for(lambda: DeadLetters(store).get("big") or not thread.is_alive(), 30,
                          "the refused message in the dead-letter queue")
        keys = reader.read_until(5, timeout=30)
        alive = thread.is_alive()
    reader.close()
    assert alive, "the poller loop died"
    assert "Kafka refused the message" in letter.reason
    assert len(keys) == 5


def test_a_poller_that_cannot_read_the_paused_queues_dispatches_nothing_until_it_can(overrides, caplog):
    """Fail closed (issue 41): a poller whose Redis user may not read the pause and rate records
    (an ACL without those keys; on a cluster, the node holding them away) does not know whether a
    queue is paused, so it claims nothing, says so once and in a metric, and goes on by itself once
    it can read them: the paused queue's tasks stay in the store all along, the other queue's go."""
    tag, queue = overrides["delayed_key_prefix"], overrides["task_default_queue"]
    bulk = f"{queue}-bulk"
    admin = redis.Redis.from_url(overrides["delayed_redis_url"])
    # every key and the wake-up channel of the deployment, but not <prefix>:paused nor <prefix>:rates
    admin.execute_command("ACL", "SETUSER", tag, "on", f">{tag}", "resetkeys", f"~{tag}:{{*", f"~{tag}:layout",
                          f"~{tag}:tokens:*", "resetchannels", f"&{tag}:wake", "+@all")
    try:
        settings = Settings.from_conf(overrides, partitions=2)
        DelayedStore(settings).pause(bulk)
        url = overrides["delayed_redis_url"].replace("redis://", f"redis://{tag}:{tag}@")
        restricted = Settings.from_conf({**overrides, "delayed_redis_url": url}, partitions=2)
        store = DelayedStore(restricted)
        store.schedule_many([*envelopes(10, bulk, now_ms(), prefix="bulk"), *envelopes(10, queue, now_ms())])
        held, other = TopicReader(settings, settings.topic(bulk)), TopicReader(settings, settings.topic(queue))
        poller = Poller(restricted, store=store)
        with caplog.at_level(logging.WARNING, logger="celery_delayed.poller.loop"), running(poller) as thread:
            wait_for(lambda: any("cannot read the paused queues" in r.getMessage() for r in caplog.records), 20,
                     "the poller to say it cannot read the paused queues")
            time.sleep(3)  # several rounds that could have dispatched
            held.read(timeout=1)
            other.read(timeout=1)
            assert not held.keys, f"{len(held.keys)} tasks of the paused queue reached its topic"
            assert not other.keys, "a poller that cannot read the controls dispatched"
            assert REGISTRY.get_sample_value("celery_delayed_controls_unreadable") == 1
            warnings = [r for r in caplog.records if "cannot read the paused queues" in r.getMessage()]
            assert len(warnings) == 1, "said once per change, not every second"

            admin.execute_command("ACL", "SETUSER", tag, f"~{tag}:paused", f"~{tag}:rates")
            assert len(other.read_until(10, timeout=30)) == 10
            held.read(timeout=1)
            alive = thread.is_alive()
        assert alive, "the poller loop died"
        assert not held.keys, f"{len(held.keys)} tasks of the paused queue reached its topic"
        assert REGISTRY.get_sample_value("celery_delayed_controls_unreadable") == 0
        held.close()
        other.close()
    finally:
        admin.execute_command("ACL", "DELUSER", tag)
