"""Kafka's side of the poller: produce claimed copies, and settle each in the store when Kafka reports it.

A delivered copy is acked (forgotten by the store), a failed one nacked (due
again shortly); both run on the poller's store thread, in order, so the loop
never waits for Redis.  Reports of one task id and topic come in produce order,
so two copies of an id in flight at once each settle their own claim.  A copy
Kafka can never carry is dead-lettered; a batch the broker refused is sent again
one message at a time, so only its culprit is parked.  A producer that failed
fatally is replaced, what it held returning to due.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from celery_delayed import inert
from celery_delayed import metrics
from celery_delayed.envelope import queue_of
from celery_delayed.kafka import Verdict, address, classify, ensure_topics, make_producer
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters, ResultBackend
from celery_delayed.store.outcomes import STORE_ERRORS

logger = inert.logger(__name__)

#: Longest wait for a fatally failed producer's last delivery reports (s).
REPLACE_TIMEOUT = 5.0


class Delivery:
    """The producer of one poller, and the bookkeeping of what it sent until Kafka reports it.

    ``store_thread`` runs the acks and nacks (the poller's claims too, so the
    store sees them in the order they were made); ``on_nacked(partition)`` is
    told when copies of a partition return to due; ``stats`` is the poller's counts.
    """

    def __init__(self, settings: Settings, store: DelayedStore, store_thread: ThreadPoolExecutor,
                 stats: metrics.PollerCounts, on_nacked: Callable[[int], None], producer: Producer | None = None,
                 backend: ResultBackend | None = None) -> None:
        self.settings = settings
        self.store = store
        self.producer = producer or make_producer(settings)
        self.stats = stats
        self.backend = backend
        self.dead_letters = DeadLetters(store)
        self._store_thread = store_thread
        self._on_nacked = on_nacked
        self._settling: deque[tuple[Future, Callable[[Any], None] | None]] = deque()  # in submission order
        self._topics: set[str] = set()  # created
        self._checked_topic = functools.lru_cache(maxsize=1024)(settings.checked_topic)  # refusals are not cached
        self._topics_blocked_until = 0.0
        self._reports: list[tuple[int, str, int, int | None, KafkaError | None]] = []
        # (task id, topic) -> [(claim stamp, partition, due ms)] in produce order, until reported
        self._in_flight: dict[tuple[str, str], list[tuple[int, int, int | None]]] = {}
        self._suspects: list[tuple[int, str, int, int | None, str, bytes]] = []  # in a batch Kafka refused
        self._alone: tuple[str, int] | None = None  # the copy being sent on its own
        self._pending = 0
        self.clock_offset_ms = 0  # Redis clock minus local clock, as the poller last saw it
        self._expired = 0  # the last expired claim a copy was not sent of (said once a claim)

    @property
    def pending(self) -> int:
        """Copies handed to the producer whose report is not settled yet."""
        return self._pending

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for delivery reports, then settle them."""
        self.producer.poll(timeout)
        self.serve(timeout=0)

    def produce(self, partition: int, task_id: str, stamp: int, due_ms: int, data: bytes,
                 headers: list[tuple[str, str | bytes | None]] | None = None) -> int:
        """Route one claimed message to its topic and hand it to the producer; 1 when handed.  Not a copy
        whose claim expired (``stamp``, its deadline, passed: this poller was paused past it), which the
        next claim, of the next leader most likely, took back and sent: sent again whenever the paused
        poller goes on, however late, it would run a second time once its run record had lapsed."""
        if time.time() * 1000 + self.clock_offset_ms >= stamp:
            if stamp != self._expired:
                self._expired = stamp
                logger.warning("claim of partition %d expired before its copies went to Kafka (this poller was "
                               "paused?): the rest is left to the next claim", partition)
            return 0
        try:
            topic = self._checked_topic(queue_of(data))
        except Exception as exc:  # whatever one message does (RecursionError...), only it is parked
            self.dead_letter(partition, task_id, stamp, data,
                              f"undecodable stored message: {type(exc).__name__}: {exc}")
            return 0
        if topic not in self._topics and (time.monotonic() < self._topics_blocked_until
                                          or not self._ensure_topic(topic)):
            nack = functools.partial(self.store.nack, failed={task_id: due_ms})  # Kafka unreachable: due again soon
            self._settle(nack, partition, [(task_id, stamp)], then=lambda _: self.stats.add("delivery_failed"))
            return 0
        return int(self._send(partition, task_id, stamp, due_ms, topic, data, headers))

    def _send(self, partition: int, task_id: str, stamp: int, due_ms: int | None, topic: str, data: bytes,
              headers: list[tuple[str, str | bytes | None]] | None = None) -> bool:
        """``produce()`` one message, serving delivery reports while the local queue is full.

        False when the producer raised: a message Kafka can never carry is
        dead-lettered; after any other error it returns to due with the failed
        deliveries (and a fatal error replaces the producer there).
        """
        while True:
            try:
                self.producer.produce(topic, key=task_id, value=data, headers=headers, on_delivery=self._on_delivery)
            except BufferError:  # local queue full: serve delivery reports, then retry
                self.producer.poll(0.05)
                continue
            except KafkaException as exc:
                err = exc.args[0]
                if classify(err) is Verdict.PERMANENT:
                    self.dead_letter(partition, task_id, stamp, data, f"Kafka refused the message: {err}")
                else:  # reported as a failed delivery: counted as pending until _settle_reports
                    self._pending += 1
                    self._reports.append((partition, task_id, stamp, due_ms, err))
                return False
            self._in_flight.setdefault((task_id, topic), []).append((stamp, partition, due_ms))
            self._pending += 1
            return True

    def drop(self, partition: int, task_id: str, stamp: int, counted: bool = True) -> None:
        """Forget a claimed copy that is not to be sent (an occurrence of a recurring schedule not to run),
        ``counted`` as dropped (a stale one; a missed one is counted as missed)."""
        self._settle(self.store.ack, partition, [(task_id, stamp)])
        self.stats.add("dropped", counted)

    def _ensure_topic(self, topic: str) -> bool:
        """Create a queue's topic if missing; on failure, stop trying for a few seconds."""
        try:
            ensure_topics(self.settings, [topic[len(self.settings.topic_prefix):]], timeout=5.0)
        except KafkaException as exc:
            logger.warning("cannot create topic %s on %s: %s; its tasks stay in the store until it answers "
                           "(is the address right?)", topic, address(self.settings), exc)
            self._topics_blocked_until = time.monotonic() + 5.0
            return False
        self._topics.add(topic)
        return True

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        """Kafka's delivery report (one shared callback: no closure per message for the GC to scan).

        Reports of one key and topic (so one Kafka partition) come in produce
        order: the first copy of the id still waiting for one is this report's,
        so two copies of one id in flight at once (one claimed again after its
        visibility deadline, or a newer copy claimed) settle each its own claim.
        """
        key, topic, data = msg.key(), msg.topic(), msg.value()
        if key is None or topic is None or data is None:  # every message produced here has all three
            raise ValueError(f"a delivery report of a message this poller did not produce: {msg!r}")
        task_id = key.decode()
        waiting = self._in_flight[task_id, topic]
        stamp, partition, due_ms = waiting.pop(0)
        if not waiting:
            del self._in_flight[task_id, topic]
        if err is not None and classify(err) is Verdict.PERMANENT:
            # The broker refuses whole batches: this message may only have shared one with the
            # culprit.  Sent alone and refused again, it is the culprit: park it.
            self._pending -= 1
            if (task_id, stamp) == self._alone:
                self.dead_letter(partition, task_id, stamp, data, f"Kafka refused the message: {err}")
            else:
                self._suspects.append((partition, task_id, stamp, due_ms, topic, data))
            return
        self._reports.append((partition, task_id, stamp, due_ms, err))

    def _send_suspects_alone(self) -> None:
        """Produce each message of a refused batch on its own, so only the culprit is parked."""
        suspects, self._suspects = self._suspects, []
        for partition, task_id, stamp, due_ms, topic, data in suspects:
            self._alone = (task_id, stamp)
            if self._send(partition, task_id, stamp, due_ms, topic, data):
                self.producer.flush(10)
        self._alone = None

    def _settle(self, action: Callable[[int, list[tuple[str, int]]], int], partition: int,
                claimed: list[tuple[str, int]], then: Callable[[int], None] | None = None) -> None:
        """Ack or nack ``(task_id, stamp)`` copies in the store, on the store thread; ``then`` gets how
        many were still in flight under their claim (the others gave way to a newer copy, which
        stays), on this thread (:meth:`_collect_settled`).  On a Redis error they stay in flight and
        return after the visibility timeout (a duplicate at worst), so the loop goes on."""
        def settle() -> int | None:
            try:
                return action(partition, claimed)
            except STORE_ERRORS as exc:
                logger.warning("could not settle %d tasks of partition %d: %s", len(claimed), partition, exc)
                return None
        self._settling.append((self._store_thread.submit(settle), then))

    def _collect_settled(self, wait: bool = False) -> None:
        """Run the ``then`` of each settle done so far (of all, waiting for them, with ``wait``)."""
        while self._settling and (wait or self._settling[0][0].done()):
            future, then = self._settling.popleft()
            settled = future.result()
            if then is not None and settled is not None:
                then(settled)

    def serve(self, timeout: float) -> None:
        """Serve Kafka delivery reports: ack the delivered, return the failed to due, and replace
        a producer that failed fatally."""
        if timeout:
            self.producer.flush(timeout)
        else:
            self.producer.poll(0)
        if self._suspects:
            self._send_suspects_alone()
        fatal = self._settle_reports()
        if fatal is not None:
            self._replace_producer(fatal)
        self._collect_settled(wait=bool(timeout))

    def _replace_producer(self, err: KafkaError) -> None:
        """After a fatal error a producer refuses everything for good (an idempotent producer that
        lost its sequence cannot go on): what it still holds returns to due, a new one takes over."""
        logger.error("Kafka producer failed fatally (%s): replacing it", err)
        self.stats.add("producer_replaced")
        old, self.producer = self.producer, make_producer(self.settings)
        try:
            old.purge()  # each undelivered message gets a failed delivery report...
            old.flush(REPLACE_TIMEOUT)  # ...served here
        except KafkaException as exc:
            logger.warning("the failed producer could not report its messages: %s", exc)
        # what it never reported failed too: nothing will ever report it
        self._reports += [(partition, task_id, stamp, due_ms, err) for (task_id, _), copies in self._in_flight.items()
                          for stamp, partition, due_ms in copies]
        self._in_flight = {}
        self._settle_reports()  # a fatal error among these is the one being handled
        self._pending = 0

    def _settle_reports(self) -> KafkaError | None:
        """Ack the delivered and nack the failed of the reports served so far; returns a fatal
        error among them, if any."""
        if not self._reports:
            return None
        reports, self._reports = self._reports, []
        self._pending -= len(reports)
        now_ms = time.time() * 1000 + self.clock_offset_ms
        delivered: dict[int, list[tuple[str, int]]] = defaultdict(list)
        failed: dict[int, list[tuple[str, int]]] = defaultdict(list)
        failed_due: dict[int, dict[str, int]] = defaultdict(dict)  # the due times they failed at
        fatal = None
        errors: dict[str, list[str]] = defaultdict(list)  # one log line per error, not one per task
        lags: list[float] = []
        for partition, task_id, stamp, due_ms, err in reports:
            if err:
                failed[partition].append((task_id, stamp))
                if due_ms is not None:
                    failed_due[partition][task_id] = due_ms
                errors[str(err)].append(task_id)
                if classify(err) is Verdict.FATAL:
                    fatal = err
            else:
                delivered[partition].append((task_id, stamp))
                if due_ms is not None:
                    lags.append(max(0.0, now_ms - due_ms) / 1000)
        metrics.DISPATCH_LAG.observe_many(lags)
        for error, ids in errors.items():
            logger.warning("delivery of %d task(s) failed (%s%s): %s; due again shortly", len(ids), ids[0],
                           f" and {len(ids) - 1} more" if len(ids) > 1 else "", error)
        for partition, copies in delivered.items():
            self._settle(self.store.ack, partition, copies, then=functools.partial(self._acked, len(copies)))
        for partition, copies in failed.items():
            self._settle(functools.partial(self.store.nack, failed=failed_due[partition]), partition, copies,
                         then=functools.partial(self._nacked, partition, len(copies)))
        return fatal

    def _acked(self, delivered: int, acked: int) -> None:
        self.stats.add("dispatched", delivered)
        self.stats.add("superseded", delivered - acked)  # a retry or put-back came first

    def _nacked(self, partition: int, failed: int, _nacked: int) -> None:
        """``failed`` deliveries of ``partition`` went back to due (each counts, however many of them, ``_nacked``,
        were still in flight under their claim)."""
        self._on_nacked(partition)
        self.stats.add("delivery_failed", failed)

    def dead_letter(self, partition: int, task_id: str, stamp: int, data: bytes, reason: str) -> None:
        logger.error("task %s: %s; moved to the dead-letter queue", task_id, reason)
        try:
            self.dead_letters.park(DeadLetter(task_id=task_id, reason=reason, source="poller", message=data),
                                   self.backend)
        except STORE_ERRORS as exc:  # stays in flight: it comes back after the visibility timeout
            logger.warning("could not dead-letter %s: %s", task_id, exc)
            return
        self._settle(self.store.ack, partition, [(task_id, stamp)])
        self.stats.add("dead_lettered")
