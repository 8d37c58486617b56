"""The poller: moves due tasks from the store to Kafka, one leader per partition.

Loop: claim what is due in each partition this poller leads (Lua, Redis clock,
fencing token) -> produce each message to its queue's topic (key = task_id) ->
on Kafka's delivery report, ack (forget) or nack (due again).  It sleeps until
the next due time, woken early by a ``PUBLISH`` from the schedule script.  A
crash anywhere leaves claimed tasks in the inflight set, and they become due
again after the visibility timeout: duplicates are possible, loss is not.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from .dlq import DeadLetter, DeadLetters
from .envelope import EnvelopeError, decode_meta
from .kafka import ensure_topics, make_producer
from .leadership import Leadership
from .settings import Settings
from .store import DelayedStore, Fenced, StoreUnavailable

logger = logging.getLogger(__name__)


class Poller:
    """Dispatches due tasks of the partitions this process leads."""

    def __init__(self, settings: Settings, store: DelayedStore | None = None,
                 leadership: Leadership | None = None, producer: Producer | None = None) -> None:
        self.settings = settings
        self.store = store or DelayedStore(settings)
        self.leadership = leadership or Leadership(settings)
        self.producer = producer or make_producer(settings)
        self.dead_letters = DeadLetters(self.store)
        self.stats: dict[str, int] = defaultdict(int)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._topics: set[str] = set()
        self._reports: list[tuple[int, str, KafkaError | None]] = []
        self._pending = 0
        self._next_due_ms: int | None = None  # Redis clock
        self._clock_offset_ms = 0  # Redis clock minus local clock

    # -- lifecycle -----------------------------------------------------------
    def run(self, on_dispatch: Callable[[int], None] | None = None) -> None:
        """Dispatch until :meth:`stop`; then hand the batch in hand to Kafka and resign."""
        leader = threading.Thread(target=self._lead, name="delayed-leadership", daemon=True)
        leader.start()
        pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(**{self.store.wake_channel: self._on_wake})
        waker = pubsub.run_in_thread(sleep_time=0.5, daemon=True)
        logger.info("poller %s started (%d partitions)", self.leadership.id, self.settings.partitions)
        try:
            while not self._stopping.is_set():
                dispatched = self.tick()
                if on_dispatch and dispatched:
                    on_dispatch(dispatched)
                if not dispatched:
                    self._sleep()
        finally:
            waker.stop()
            self._drain_reports(timeout=10.0)
            leader.join(timeout=self.settings.lease_ttl)
            self.leadership.release()
            logger.info("poller %s stopped: %s", self.leadership.id, dict(self.stats))

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    # -- one round -------------------------------------------------------------
    def tick(self) -> int:
        """Claim and produce one batch from every led partition; returns tasks produced."""
        produced = 0
        next_due = None
        for partition, token in self.leadership.owned().items():
            try:
                claim = self.store.claim(partition, token, self.settings.claim_batch)
            except Fenced as exc:
                self.stats["fenced"] += 1
                logger.warning("%s: stop dispatching it", exc)
                self.leadership.lose(partition)
                continue
            except StoreUnavailable as exc:
                logger.warning("%s", exc)
                break
            self._clock_offset_ms = claim.now_ms - int(time.time() * 1000)
            for task_id, data in claim.items:
                produced += self._produce(partition, task_id, data)
            if len(claim.items) >= self.settings.claim_batch:
                next_due = claim.now_ms  # more is due right now
            elif claim.next_due_ms is not None:
                next_due = claim.next_due_ms if next_due is None else min(next_due, claim.next_due_ms)
        self._next_due_ms = next_due
        self._drain_reports(timeout=0)
        return produced

    def _produce(self, partition: int, task_id: str, data: bytes) -> int:
        try:
            topic = self.settings.topic(decode_meta(data)["q"])
        except EnvelopeError as exc:
            self._dead_letter(partition, task_id, data, f"undecodable stored message: {exc}")
            return 0
        if topic not in self._topics:
            ensure_topics(self.settings, [topic[len(self.settings.topic_prefix):]])
            self._topics.add(topic)

        def report(err: KafkaError | None, msg: Message) -> None:
            self._reports.append((partition, task_id, err))

        while True:
            try:
                self.producer.produce(topic, key=task_id, value=data, on_delivery=report)
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self.producer.poll(0.05)
        self._pending += 1
        return 1

    def _drain_reports(self, timeout: float) -> None:
        """Serve Kafka delivery reports: ack the delivered, return the failed to due."""
        if timeout:
            self.producer.flush(timeout)
        else:
            self.producer.poll(0)
        if not self._reports:
            return
        reports, self._reports = self._reports, []
        self._pending -= len(reports)
        delivered: dict[int, list[str]] = defaultdict(list)
        failed: dict[int, list[str]] = defaultdict(list)
        for partition, task_id, err in reports:
            (failed if err else delivered)[partition].append(task_id)
            if err:
                logger.warning("delivery of %s failed: %s; due again shortly", task_id, err)
        try:
            for partition, ids in delivered.items():
                self.store.ack(partition, ids)
                self.stats["dispatched"] += len(ids)
            for partition, ids in failed.items():
                self.store.nack(partition, ids)
                self.stats["delivery_failed"] += len(ids)
        except StoreUnavailable as exc:  # entries stay inflight and return after the visibility timeout
            logger.warning("could not settle %d delivery reports: %s", len(reports), exc)

    def _dead_letter(self, partition: int, task_id: str, data: bytes, reason: str) -> None:
        logger.error("task %s: %s; moved to the dead-letter queue", task_id, reason)
        self.dead_letters.add(DeadLetter(task_id=task_id, reason=reason, source="poller", message=data))
        self.store.ack(partition, [task_id])
        self.stats["dead_lettered"] += 1

    # -- waiting ---------------------------------------------------------------
    def _sleep(self) -> None:
        """Sleep until the next due task, a wake-up, or ``max_sleep``; serve reports meanwhile."""
        deadline = time.monotonic() + self.settings.max_sleep
        if self._next_due_ms is not None:
            local_due = (self._next_due_ms - self._clock_offset_ms) / 1000
            deadline = min(deadline, time.monotonic() + max(0.0, local_due - time.time()))
        while not self._wake.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._pending:
                self.producer.poll(min(remaining, 0.005))
                self._drain_reports(timeout=0)
            else:
                self._wake.wait(remaining)
        self._wake.clear()

    def _on_wake(self, message: dict) -> None:
        try:
            due = int(message["data"])
        except (TypeError, ValueError):
            return
        if self._next_due_ms is None or due < self._next_due_ms:
            self._wake.set()

    def _lead(self) -> None:
        interval = self.settings.lease_ttl / 3
        while not self._stopping.is_set():
            before = self.leadership.owned()
            if self.leadership.step() != before:
                self._wake.set()
            self._stopping.wait(interval)
