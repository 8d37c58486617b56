"""The poller: moves due tasks from the store to Kafka, one leader per partition.

Loop: claim what is due in each partition this poller leads (Lua, Redis clock,
fencing token) -> produce each message to its queue's topic (key = task_id) ->
on Kafka's delivery report, ack (forget) or nack (due again).  Store calls run on
one store thread, in the order they are made, so Redis claims the next partition
while this thread produces the one before, and no ack holds the loop up.  It
sleeps until the next due time, woken early by a ``PUBLISH`` from the schedule
script.  A crash anywhere leaves claimed tasks in the inflight set, and they
become due again after the visibility timeout: duplicates are possible, loss is not.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from . import metrics
from .dlq import DeadLetter, DeadLetters, ResultBackend
from .durability import preflight
from .envelope import queue_of
from .kafka import CLAIMED_HEADER, DUE_HEADER, Verdict, classify, ensure_topics, make_producer
from .leadership import Leadership
from .settings import Settings
from .store import STORE_ERRORS, Claim, DelayedStore, Fenced

logger = logging.getLogger(__name__)

#: "Nothing scheduled" as a due time.
NEVER = float("inf")
#: How often leadership is refreshed and rebalanced (s), at most; a standby
#: notices a resigned leader's partitions within this.
LEADERSHIP_INTERVAL = 0.5
#: Longest wait for a fatally failed producer's last delivery reports (s).
REPLACE_TIMEOUT = 5.0


class RateLimit:
    """Token bucket: at most ``rate`` tasks per second, bursts up to one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._at = time.monotonic()

    def available(self) -> float:
        """Tasks that may go now (infinite without a limit)."""
        if not self.rate:
            return float("inf")
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def take(self, n: int) -> None:
        if self.rate:
            self._tokens -= n

    def wait_time(self) -> float:
        """Seconds until one more task may go."""
        return 0.0 if not self.rate or self._tokens >= 1 else (1 - self._tokens) / self.rate


class Poller:
    """Dispatches due tasks of the partitions this process leads.

    ``backend``: the app's result backend, where a task the poller dead-letters
    gets its FAILURE result (so its waiters wake up).
    """

    def __init__(self, settings: Settings, store: DelayedStore | None = None,
                 leadership: Leadership | None = None, producer: Producer | None = None,
                 backend: ResultBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store or DelayedStore(settings)
        self.leadership = leadership or Leadership(settings)
        self.producer = producer or make_producer(settings)
        self.dead_letters = DeadLetters(self.store)
        self.stats: dict[str, int] = defaultdict(int)
        self._limit = RateLimit(settings.max_dispatch_rate)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="delayed-store")
        self._settling: deque[tuple[Future, Callable[[Any], None] | None]] = deque()  # in submission order
        self._topics: set[str] = set()  # created
        self._checked_topic = functools.lru_cache(maxsize=1024)(settings.checked_topic)  # refusals are not cached
        self._reports: list[tuple[int, str, int, int | None, KafkaError | None]] = []
        # (task id, topic) -> [(claim stamp, partition, due ms)] in produce order, until reported
        self._in_flight: dict[tuple[str, str], list[tuple[int, int, int | None]]] = {}
        self._suspects: list[tuple[int, str, int, int | None, str, bytes]] = []  # in a batch Kafka refused
        self._alone: tuple[str, int] | None = None  # the copy being sent on its own
        self._pending = 0
        self._next_due: dict[int, float] = {}  # partition -> next due ms (Redis clock); absent = unknown
        self._last_sweep = 0.0
        self._rotation = 0
        self._topics_blocked_until = 0.0
        self._clock_offset_ms = 0  # Redis clock minus local clock

    # -- lifecycle -----------------------------------------------------------
    def run(self) -> None:
        """Dispatch until :meth:`stop`; then hand the batch in hand to Kafka and resign.

        Raises ConfigurationError at start when the store must not be used (:func:`preflight`).
        """
        if not self._preflight():
            return
        leader = threading.Thread(target=self._lead, name="delayed-leadership", daemon=True)
        leader.start()
        pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(**{self.store.keys.wake: self._on_wake})
        waker = pubsub.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=self._on_pubsub_error)
        logger.info("poller %s started (%d partitions)", self.leadership.id, self.settings.partitions)
        try:
            while not self._stopping.is_set():
                dispatched = self.tick()
                if not dispatched or self._limit.wait_time():
                    self._sleep()
        finally:
            self._stopping.set()  # also when the loop crashed: the leadership thread must not outlive it
            waker.stop()
            try:
                self._drain_reports(timeout=10.0)
            finally:
                self._store_thread.shutdown(wait=True)
                leader.join(timeout=self.settings.lease_ttl + 5)
                self.leadership.release()
            metrics.LEADING.clear()
            logger.info("poller %s stopped: %s", self.leadership.id, dict(self.stats))

    def _preflight(self) -> bool:
        """Check the store before leading anything, waiting for it while it is down; False if stopped meanwhile."""
        while not self._stopping.is_set():
            try:
                preflight(self.store, "poller")
                return True
            except STORE_ERRORS as exc:
                logger.warning("cannot check the delayed store (%s): waiting for it", exc)
                self._stopping.wait(1.0)
        return False

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    # -- one round -------------------------------------------------------------
    def tick(self) -> int:
        """Claim and produce one batch from each led partition that may have due tasks.

        A partition is claimed when its next due time (as of its last claim) has
        come, when a wake-up made it unknown, and in a full sweep every
        ``max_sleep`` (which also returns a dead poller's expired claims to due).
        """
        produced = 0
        sweep = time.monotonic() - self._last_sweep >= self.settings.max_sleep
        if sweep:
            self._last_sweep = time.monotonic()
        horizon_ms = time.time() * 1000 + self._clock_offset_ms + self.settings.dispatch_lead * 1000
        owned = list(self.leadership.owned().items())
        self._rotation = (self._rotation + 1) % max(len(owned), 1)  # a rate limit must not starve the last ones
        due = [(partition, token) for partition, token in owned[self._rotation:] + owned[:self._rotation]
               if sweep or self._next_due.get(partition, 0) <= horizon_ms]
        for partition, token, budget, claim in self._claims(due):
            if isinstance(claim, Fenced):
                self.stats["fenced"] += 1
                metrics.FENCE_REJECTIONS.inc()
                logger.warning("%s: stop dispatching it", claim)
                self._fenced(partition, token)
                continue
            self._clock_offset_ms = claim.now_ms - int(time.time() * 1000)
            self._limit.take(len(claim.items))
            claimed = (CLAIMED_HEADER, str(claim.now_ms))
            for task_id, due_ms, data in claim.items:
                produced += self._produce(partition, task_id, claim.stamp, due_ms, data,
                                          [(DUE_HEADER, str(due_ms)), claimed])
            full = len(claim.items) >= budget
            self._next_due[partition] = claim.now_ms if full else (claim.next_due_ms or NEVER)
        self._drain_reports(timeout=0)
        return produced

    def _claims(self, due: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int, Claim | Fenced]]:
        """``(partition, token, budget, claim or its Fenced refusal)`` of each due partition, in order.

        The next partition's claim is sent to the store thread before this one's
        tasks are handed back, so Redis claims while the caller produces.  A store
        error (down, read-only after a failover...) ends the round: what was
        already claimed is still handed back, nothing more is asked.
        """
        due = iter(due)
        ahead: deque[tuple[int, int, int, Future]] = deque()
        failed = False

        def send_next() -> None:
            reserved = sum(budget for _, _, budget, _ in ahead)
            budget = int(min(self.settings.claim_batch, self._limit.available() - reserved))
            if budget >= 1 and (nxt := next(due, None)):
                partition, token = nxt
                ahead.append((partition, token, budget,
                              self._store_thread.submit(self.store.claim, partition, token, budget)))

        send_next()
        while ahead:
            partition, token, budget, future = ahead.popleft()
            if not failed:
                send_next()
            try:
                yield partition, token, budget, future.result()
            except Fenced as exc:
                yield partition, token, budget, exc
            except STORE_ERRORS as exc:
                logger.warning("claim of partition %d failed: %s", partition, exc)
                failed = True

    def _fenced(self, partition: int, token: int) -> None:
        """Hand a refused claim to the leadership, with the store's fences (see :meth:`Leadership.fenced`)."""
        try:
            self.leadership.fenced(partition, token, self.store.fences())
        except Exception as exc:  # Redis or etcd away: the partition stays forgotten until the next step
            logger.warning("partition %d: cannot settle the refused claim now (%s)", partition, exc)

    def _produce(self, partition: int, task_id: str, stamp: int, due_ms: int, data: bytes,
                 headers: list[tuple[str, str]] | None = None) -> int:
        """Route one claimed message to its topic and hand it to the producer; 1 when handed."""
        try:
            topic = self._checked_topic(queue_of(data))
        except Exception as exc:  # whatever one message does (RecursionError...), only it is parked
            self._dead_letter(partition, task_id, stamp, data,
                              f"undecodable stored message: {type(exc).__name__}: {exc}")
            return 0
        if topic not in self._topics:
            if time.monotonic() < self._topics_blocked_until or not self._ensure_topic(topic):
                self._settle(self.store.nack, partition, [(task_id, stamp)])  # Kafka unreachable: due again soon
                return 0
        return int(self._send(partition, task_id, stamp, due_ms, topic, data, headers))

    def _send(self, partition: int, task_id: str, stamp: int, due_ms: int | None, topic: str, data: bytes,
              headers: list[tuple[str, str]] | None = None) -> bool:
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
                    self._dead_letter(partition, task_id, stamp, data, f"Kafka refused the message: {err}")
                else:  # reported as a failed delivery: counted as pending until _settle_reports
                    self._pending += 1
                    self._reports.append((partition, task_id, stamp, due_ms, err))
                return False
            self._in_flight.setdefault((task_id, topic), []).append((stamp, partition, due_ms))
            self._pending += 1
            return True

    def _ensure_topic(self, topic: str) -> bool:
        """Create a queue's topic if missing; on failure, stop trying for a few seconds."""
        try:
            ensure_topics(self.settings, [topic[len(self.settings.topic_prefix):]], timeout=5.0)
        except KafkaException as exc:
            logger.warning("cannot create Kafka topic %s: %s", topic, exc)
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
        task_id, topic = msg.key().decode(), msg.topic()
        waiting = self._in_flight[task_id, topic]
        stamp, partition, due_ms = waiting.pop(0)
        if not waiting:
            del self._in_flight[task_id, topic]
        if err is not None and classify(err) is Verdict.PERMANENT:
            # The broker refuses whole batches: this message may only have shared one with the
            # culprit.  Sent alone and refused again, it is the culprit: park it.
            self._pending -= 1
            if (task_id, stamp) == self._alone:
                self._dead_letter(partition, task_id, stamp, msg.value(), f"Kafka refused the message: {err}")
            else:
                self._suspects.append((partition, task_id, stamp, due_ms, msg.topic(), msg.value()))
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

    def _drain_reports(self, timeout: float) -> None:
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
        self.stats["producer_replaced"] += 1
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
        now_ms = time.time() * 1000 + self._clock_offset_ms
        delivered: dict[int, list[tuple[str, int]]] = defaultdict(list)
        failed: dict[int, list[tuple[str, int]]] = defaultdict(list)
        fatal = None
        errors: dict[str, list[str]] = defaultdict(list)  # one log line per error, not one per task
        lags: list[float] = []
        for partition, task_id, stamp, due_ms, err in reports:
            if err:
                failed[partition].append((task_id, stamp))
                errors[str(err)].append(task_id)
                if classify(err) is Verdict.FATAL:
                    fatal = err
            else:
                delivered[partition].append((task_id, stamp))
                if due_ms is not None:
                    lags.append(max(0.0, now_ms - due_ms) / 1000)
        metrics.DISPATCH_LAG.observe_many(lags)
        for err, ids in errors.items():
            logger.warning("delivery of %d task(s) failed (%s%s): %s; due again shortly", len(ids), ids[0],
                           f" and {len(ids) - 1} more" if len(ids) > 1 else "", err)
        for partition, ids in delivered.items():
            self._settle(self.store.ack, partition, ids, then=lambda acked, n=len(ids): self._acked(n, acked))
        for partition, ids in failed.items():
            self._settle(self.store.nack, partition, ids,
                         then=lambda _, p=partition, n=len(ids): self._nacked(p, n))
        return fatal

    def _acked(self, delivered: int, acked: int) -> None:
        self.stats["dispatched"] += delivered
        self.stats["superseded"] += delivered - acked  # a retry or put-back came first
        metrics.DISPATCHED.inc(delivered)

    def _nacked(self, partition: int, failed: int) -> None:
        self._next_due[partition] = 0  # due again in a second: look then
        self.stats["delivery_failed"] += failed
        metrics.DELIVERY_FAILED.inc(failed)

    def _dead_letter(self, partition: int, task_id: str, stamp: int, data: bytes, reason: str) -> None:
        logger.error("task %s: %s; moved to the dead-letter queue", task_id, reason)
        try:
            self.dead_letters.park(DeadLetter(task_id=task_id, reason=reason, source="poller", message=data),
                                   self.backend)
        except STORE_ERRORS as exc:  # stays in flight: it comes back after the visibility timeout
            logger.warning("could not dead-letter %s: %s", task_id, exc)
            return
        self._settle(self.store.ack, partition, [(task_id, stamp)])
        self.stats["dead_lettered"] += 1
        metrics.DEAD_LETTERED.labels("poller").inc()

    # -- waiting ---------------------------------------------------------------
    def _sleep(self) -> None:
        """Sleep until the next due task, a wake-up, or the next sweep; serve reports meanwhile."""
        owned = self.leadership.owned()
        next_due = min((self._next_due.get(p, 0) for p in owned), default=NEVER)
        local_due = time.monotonic() + (next_due - self._clock_offset_ms) / 1000 - time.time() \
            - self.settings.dispatch_lead
        deadline = max(min(self._last_sweep + self.settings.max_sleep, local_due),
                       time.monotonic() + self._limit.wait_time())
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
        """A task was scheduled sooner than anything in its partition: look at every partition."""
        self._next_due.clear()
        self._wake.set()

    def _on_pubsub_error(self, exc: BaseException, pubsub: object, thread: object) -> None:
        """Redis went away under the wake-up subscription: keep the thread, retry shortly."""
        logger.warning("wake-up subscription: %s; retrying", exc)
        self._stopping.wait(1.0)

    def _lead(self) -> None:
        interval = min(LEADERSHIP_INTERVAL, self.settings.lease_ttl / 3)
        led: set[int] = set()
        while not self._stopping.is_set():
            owned = set(self.leadership.step())
            if owned != led:
                for p in led - owned:
                    metrics.LEADING.remove(str(p))
                for p in owned - led:
                    metrics.LEADING.labels(str(p)).set(1)
                led = owned
                self._wake.set()
            self._stopping.wait(interval)
