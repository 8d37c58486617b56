"""The poller against Kafka errors it must survive: a full local queue.  The fault is injected by a
thin wrapper around the REAL producer (chosen calls raise); every message it lets through goes to
the real broker."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from confluent_kafka import Producer

from celery_delayed.dlq import DeadLetters
from celery_delayed.kafka import make_producer
from celery_delayed.poller import Poller
from celery_delayed.store import DelayedStore

from .support import TopicReader, envelopes, wait_for
from .test_poller import now_ms, settings_for, small_topic, too_big


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


@contextmanager
def running(poller: Poller) -> Iterator[threading.Thread]:
    """``poller.run()`` in a thread, stopped and joined at the end."""
    thread = threading.Thread(target=poller.run, name="test-poller", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        poller.stop()
        thread.join(30)


def test_a_full_local_queue_while_resending_a_refused_batch_alone_is_waited_out(overrides):
    settings = settings_for(overrides, partitions=1)
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
