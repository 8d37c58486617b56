"""The poller: moves due tasks from the store to Kafka, one leader per partition.

Loop: claim what is due in each partition this poller leads (Lua, Redis clock,
fencing token) -> produce each message to its queue's topic (key = task_id) ->
on Kafka's delivery report, ack (forget) or nack (due again): :mod:`.delivery`.
Claims, acks and nacks run on one store thread, in the order they are made, so
Redis claims the next partition while this thread produces the one before, and no
ack holds the loop up.  Each round obeys the paused queues and takes from Redis the
tokens, shared by every poller, of the rate-limited queues its partitions have due
tasks of.  It sleeps until the next due time, woken early by a ``PUBLISH`` from the
schedule script.  A crash
anywhere leaves claimed tasks in the inflight set, and they become due again
after the visibility timeout: duplicates are possible, loss is not.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import redis
from confluent_kafka import KafkaException, Producer

from celery_delayed import inert
from celery_delayed import metrics
from celery_delayed.kafka import CLAIMED_HEADER, DUE_HEADER, fleet, unread_warning
from celery_delayed.poller.delivery import Delivery
from celery_delayed.poller.leadership import Leadership
from celery_delayed.recurring.definitions import BEAT, Definitions
from celery_delayed.recurring.occurrences import maybe_occurrence
from celery_delayed.recurring.policy import Options
from celery_delayed.recurring.rules import Rule
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import Claim, DelayedStore
from celery_delayed.store.dlq import ResultBackend
from celery_delayed.store.durability import preflight
from celery_delayed.store.outcomes import STORE_ERRORS, Fenced

logger = inert.logger(__name__)

#: "Nothing scheduled" as a due time.
NEVER = float("inf")
#: How often leadership is refreshed and rebalanced (s), at most; a standby
#: notices a resigned leader's partitions within this.
LEADERSHIP_INTERVAL = 0.5
#: How old (s) the paused queues and queue rates this poller obeys may be; a wake-up reads them
#: again at once.
CONTROLS_REFRESH = 1.0
#: How soon (ms) a partition whose rate-limited queue ran out of tokens with tasks due is claimed again
#: (at once when the claim held none of that queue's tokens, not knowing the partition had its tasks).
THROTTLED_RETRY_MS = 50
#: After a claim failed on a store error (Redis down, a failover...): ms before the round's partitions are
#: claimed again.  A refused connection fails at once: retried at once, the poller would spin (and log) non-stop.
STORE_RETRY_MS = 1000
#: Seconds between two looks at whether the workers read every queue's topic.
READERS_EVERY = 30.0
#: Seconds between two looks at the marks of recurring schedule puts (:meth:`Poller._complete_stopped_puts`).
PUTS_EVERY = 10.0


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
    gets its FAILURE result (so its waiters wake up); ``producer``: instead of a
    new one (tests); ``beat_schedule``: the recurring schedules of the app's
    ``beat_schedule`` (schedule id -> template, rule, options), synced at start
    (:meth:`.Definitions.sync`; None: not synced).
    """

    def __init__(self, settings: Settings, store: DelayedStore | None = None,
                 leadership: Leadership | None = None, producer: Producer | None = None,
                 backend: ResultBackend | None = None,
                 beat_schedule: dict[str, tuple[bytes, Rule, Options]] | None = None) -> None:
        self.settings = settings
        self.store = store or DelayedStore(settings)
        self.recurring = Definitions(self.store)
        self._beat_schedule = beat_schedule
        self.leadership = leadership or Leadership(settings)
        self.stats = metrics.PollerCounts()
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="delayed-store")
        self.delivery = Delivery(settings, self.store, self._store_thread, self.stats, on_nacked=self._due_again,
                                 producer=producer, backend=backend)
        self._limit = RateLimit(settings.max_dispatch_rate)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._next_due: dict[int, float] = {}  # partition -> next due ms (Redis clock); absent = unknown
        self._wake_ups = 0  # how many times the next due times were forgotten (a wake-up, a nack)
        self._last_sweep = 0.0
        self._rotation = 0
        self._clock_offset_ms = 0  # Redis clock minus local clock
        self._paused: tuple[str, ...] = ()  # the queues whose tasks stay in the store
        self._rates: dict[str, float] = dict(settings.queue_rates)  # queue -> most tasks a second
        self._controls_read = -CONTROLS_REFRESH  # when both were last read (monotonic s)
        self._controls_known: bool | None = None  # whether that read succeeded (None: not read yet)
        # partition -> the rate-limited queues its last claim took tasks of or was throttled on: the
        # queues whose tokens a round claiming it takes (absent: none known)
        self._demand: dict[int, frozenset[str]] = {}

    # -- lifecycle -----------------------------------------------------------
    def run(self) -> None:
        """Dispatch until :meth:`stop`; then hand the batch in hand to Kafka and resign.

        Raises ConfigurationError at start when the store must not be used (:func:`preflight`).
        """
        if not self._preflight() or not self._sync_beat_schedule():
            return
        leader = threading.Thread(target=self._lead, name="delayed-leadership", daemon=True)
        leader.start()
        threading.Thread(target=self._watch_readers, name="delayed-readers", daemon=True).start()
        threading.Thread(target=self._complete_stopped_puts, name="delayed-puts", daemon=True).start()
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
                self.delivery.serve(timeout=10.0)
            finally:
                self._store_thread.shutdown(wait=True)
                leader.join(timeout=self.settings.lease_ttl + 5)
                self.leadership.release()
            metrics.LEADING.clear()
            metrics.PAUSED.clear()
            logger.info("poller %s stopped: %s", self.leadership.id, self.stats)

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

    def _sync_beat_schedule(self) -> bool:
        """Sync ``beat_schedule`` into the store, waiting for the store while it fails; False if stopped
        meanwhile.  A definitions key of another type (written over by something else: waiting does not
        mend it) is logged, and the poller dispatches without the sync rather than not at all."""
        while self._beat_schedule is not None and not self._stopping.is_set():
            try:
                self.recurring.sync(self._beat_schedule, BEAT)
                logger.info("beat_schedule synced: %d recurring schedule(s)", len(self._beat_schedule))
                return True
            except STORE_ERRORS as exc:
                if "WRONGTYPE" in str(exc):
                    logger.error("cannot sync beat_schedule to the delayed store (%s): dispatching without it", exc)
                    return True
                logger.warning("cannot sync beat_schedule to the delayed store (%s): trying again", exc)
                self._stopping.wait(1.0)
        return not self._stopping.is_set()

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
        produced, wake_ups = 0, self._wake_ups
        if not self._read_controls():  # fail closed: any queue may be paused
            self.delivery.serve(timeout=0)
            return 0
        sweep = time.monotonic() - self._last_sweep >= self.settings.max_sleep
        if sweep:
            self._last_sweep = time.monotonic()
        horizon_ms = time.time() * 1000 + self._clock_offset_ms + self.settings.dispatch_lead * 1000
        owned = list(self.leadership.owned().items())
        self._rotation = (self._rotation + 1) % max(len(owned), 1)  # a rate limit must not starve the last ones
        due = [(partition, token) for partition, token in owned[self._rotation:] + owned[:self._rotation]
               if sweep or self._next_due.get(partition, 0) <= horizon_ms]
        wanted = Counter(queue for partition, _ in due for queue in self._demand.get(partition, ()))
        tokens = self._take_tokens(wanted)
        for partition, token, budget, claim in self._claims(due, tokens, wanted):
            if isinstance(claim, Fenced):
                self.stats.add("fenced")
                logger.warning("%s: stop dispatching it", claim)
                self._fenced(partition, token)
                continue
            self._clock_offset_ms = self.delivery.clock_offset_ms = claim.now_ms - int(time.time() * 1000)
            self._limit.take(len(claim.items))
            claimed = (CLAIMED_HEADER, str(claim.now_ms))
            held_back = self._advance_occurrences(partition, claim)
            for task_id, due_ms, data in claim.items:
                if task_id in held_back:
                    continue
                produced += self.delivery.produce(partition, task_id, claim.stamp, due_ms, data,
                                                  [(DUE_HEADER, str(due_ms)), claimed])
            full = len(claim.items) >= budget
            unforeseen = claim.throttled - self._demand.get(partition, frozenset())  # it held no tokens of these
            self._demand[partition] = claim.throttled | (claim.taken.keys() & self._rates.keys())
            # throttled: due as a task due a retry from now (a partition is claimed dispatch_lead ahead),
            # at once when a queue it was throttled on was not known to be due there (it held none of its tokens)
            retry = (NEVER if not claim.throttled else claim.now_ms if unforeseen
                     else claim.now_ms + THROTTLED_RETRY_MS + self.settings.dispatch_lead * 1000)
            if self._wake_ups == wake_ups:  # else a sooner task may have come since the claim read its next one
                self._next_due[partition] = claim.now_ms if full else min(claim.next_due_ms or NEVER, retry)
        self._give_back(tokens)
        self.delivery.serve(timeout=0)
        return produced

    def _advance_occurrences(self, partition: int, claim: Claim) -> set[str]:
        """The claimed copies (of version-5 ids) not to produce: the recurring schedules' occurrences have
        their successors written first, all at once (:meth:`.Definitions.advance_many`), and those not
        to run (stale, missed, overlapping) are acked unsent.  When the successors cannot be written,
        none of the occurrences goes: they stay in flight and are claimed again after the visibility
        timeout.  A copy whose schedule cannot be read (a corrupt definition or occurrence) is
        dead-lettered: only it, never the poller, stops."""
        candidates = [(task_id, data) for task_id, _, data in claim.items if maybe_occurrence(task_id)]
        return self._advance(partition, claim, candidates) if candidates else set()

    def _advance(self, partition: int, claim: Claim, candidates: list[tuple[str, bytes]]) -> set[str]:
        """:meth:`_advance_occurrences` of ``candidates`` (task id, message).  A command that Redis refuses
        for what a key holds (WRONGTYPE: a definitions key written over), not for its own state, is one
        schedule's fault: the candidates are then advanced one by one, and only those it concerns stay in
        flight.  Advanced together, the others stayed with them and were claimed again with them, each
        visibility timeout, never to run.  An error of any other kind is dead-lettered with the one copy
        it concerns (found the same way)."""
        try:
            advances = self.recurring.advance_many([data for _, data in candidates], claim.now_ms)
        except STORE_ERRORS as exc:
            if len(candidates) > 1 and isinstance(exc, redis.ResponseError):  # (refusals: StoreRefused)
                return set().union(*(self._advance(partition, claim, [candidate]) for candidate in candidates))
            logger.warning("cannot write the next occurrences of %d recurring schedule(s) (%s): due again after "
                           "the visibility timeout", len(candidates), exc)
            return {task_id for task_id, _ in candidates}
        except Exception as exc:  # a fault of no known kind: only the copy that meets it is parked, never the
            # poller stopped (a new leader takes the copy back at once: it would stop each next one too)
            if len(candidates) > 1:
                return set().union(*(self._advance(partition, claim, [candidate]) for candidate in candidates))
            (task_id, data), = candidates
            self.delivery.dead_letter(partition, task_id, claim.stamp, data,
                                      f"its recurring schedule cannot advance: {type(exc).__name__}: {exc}")
            return {task_id}
        held_back = set()
        for (task_id, data), advance in zip(candidates, advances):
            self.stats.add("occurrences_fired", advance.fired)
            self.stats.add("occurrences_missed", advance.missed)
            self.stats.add("occurrences_overlapped", advance.overlapped)
            if advance.fault is not None:
                self.delivery.dead_letter(partition, task_id, claim.stamp, data, advance.fault)
            elif not advance.goes:
                self.delivery.drop(partition, task_id, claim.stamp, counted=advance.stale)
            if not advance.goes:
                held_back.add(task_id)
        return held_back

    def _claims(self, due: Iterable[tuple[int, int]], tokens: dict[str, int], wanted: Counter[str]
                ) -> Iterator[tuple[int, int, int, Claim | Fenced]]:
        """``(partition, token, budget, claim or its Fenced refusal)`` of each due partition, in order.

        The next partition's claim is sent to the store thread before this one's
        tasks are handed back, so Redis claims while the caller produces.  So a
        claim may spend a share of the tokens in ``tokens`` (queue -> tokens held)
        of each queue its partition has due tasks of, one of as many shares as
        ``wanted`` (queue -> such partitions still to claim) counts, none of the
        others; they are kept for it until it returns, and what it left goes to
        the later ones.  A store error (down, read-only after a failover...) ends
        the round: what was already claimed is still handed back, nothing more
        is asked.
        """
        due = iter(due)
        ahead: deque[tuple[int, int, int, dict[str, int], Future]] = deque()
        failed = False

        def send_next() -> None:
            reserved = sum(budget for _, _, budget, _, _ in ahead)
            budget = int(min(self.settings.claim_batch, self._limit.available() - reserved))
            if budget >= 1 and (nxt := next(due, None)):
                partition, token = nxt
                demand = self._demand.get(partition, frozenset())
                caps = {queue: math.ceil(held / wanted[queue]) if queue in demand else 0
                        for queue, held in tokens.items()}
                for queue, cap in caps.items():
                    tokens[queue] -= cap
                wanted.subtract(demand)
                ahead.append((partition, token, budget, caps, self._store_thread.submit(
                    self.store.claim, partition, token, budget, self._paused, caps)))

        send_next()
        while ahead:
            partition, token, budget, caps, future = ahead.popleft()
            if not failed:
                send_next()
            try:
                claim: Claim | Fenced | None = future.result()
            except Fenced as exc:
                claim = exc
            except STORE_ERRORS as exc:
                logger.warning("claim of partition %d failed: %s; claiming again in %.0f s", partition, exc,
                               STORE_RETRY_MS / 1000)
                failed, claim = True, None
                self._retry_later(partition)
            spent = claim.taken if isinstance(claim, Claim) else Counter()  # a failed claim spent nothing
            for queue, cap in caps.items():
                tokens[queue] += cap - spent[queue]
            if claim is not None:
                yield partition, token, budget, claim
        if failed:  # the round ended there: the partitions it did not ask either
            for partition, _ in due:
                self._retry_later(partition)

    def _retry_later(self, partition: int) -> None:
        """Claim ``partition`` again :data:`STORE_RETRY_MS` from now (unless a wake-up comes first)."""
        self._next_due[partition] = (time.time() * 1000 + self._clock_offset_ms + self.settings.dispatch_lead * 1000
                                     + STORE_RETRY_MS)

    def _take_tokens(self, wanted: Counter[str]) -> dict[str, int]:
        """The tokens this round may spend, queue -> tokens, of each rate-limited queue not paused
        (shared by every poller, ``lua/tokens.lua``): a claim's worth per partition to claim that
        holds its due tasks (``wanted``), at most, and none without one, so that the bucket is left
        to the pollers that have its tasks (a claim capped to 0 says when one has due tasks, and is
        made again at once).  A paused queue has no cap: its pause closes it."""
        tokens = {}
        for queue, rate in self._rates.items():
            if queue in self._paused:
                continue
            try:
                tokens[queue] = self.store.take_tokens(queue, rate, self.settings.claim_batch * wanted[queue]) \
                    if wanted[queue] else 0
            except STORE_ERRORS as exc:  # none then: the claims fail too
                logger.warning("cannot take tokens of queue %s: %s", queue, exc)
                tokens[queue] = 0
        return tokens

    def _give_back(self, tokens: dict[str, int]) -> None:
        """Return the tokens the round left, for other pollers and the next round."""
        for queue, left in tokens.items():
            if left > 0:
                try:
                    self.store.take_tokens(queue, self._rates[queue], -left)
                except STORE_ERRORS as exc:  # lost: the bucket refills at its rate
                    logger.warning("cannot give tokens of queue %s back: %s", queue, exc)

    def _read_controls(self) -> bool:
        """Read the paused queues and the queue rates (``delayed_queue_rates`` and those set at run
        time) when the last read is :data:`CONTROLS_REFRESH` old; a resumed queue is claimed at once.
        Returns whether the last read succeeded: a poller that cannot read them (the store down, a
        cluster node away, an ACL) does not know which queues are paused, so it claims nothing until it
        can read them again, and says so once (and in ``celery_delayed_controls_unreadable``)."""
        if time.monotonic() - self._controls_read < CONTROLS_REFRESH:
            return bool(self._controls_known)
        self._controls_read = time.monotonic()
        try:
            paused = tuple(sorted(self.store.paused()))
            rates = self.store.queue_rates()
        except STORE_ERRORS as exc:
            if self._controls_known is not False:
                logger.warning("cannot read the paused queues and queue rates (%s): claiming nothing until they "
                               "can be read", exc)
                metrics.CONTROLS_UNREADABLE.set(1)
            self._controls_known = False
            return False
        if self._controls_known is False:
            logger.warning("the paused queues and queue rates can be read again: dispatching")
        metrics.CONTROLS_UNREADABLE.set(0)
        self._controls_known = True
        if rates != self._rates:
            logger.info("queue rates (tasks/s): %s", ", ".join(f"{q} {r:g}" for q, r in sorted(rates.items()))
                        or "none")
            self._rates = rates
        if paused != self._paused:
            logger.info("paused queues: %s", ", ".join(paused) or "none")
            if set(self._paused) - set(paused):
                self._next_due.clear()
            metrics.PAUSED.clear()
            for queue in paused:
                metrics.PAUSED.labels(queue).set(1)
            self._paused = paused
        return True

    def _fenced(self, partition: int, token: int) -> None:
        """Hand a refused claim to the leadership, with the store's fences (see :meth:`Leadership.fenced`)."""
        try:
            self.leadership.fenced(partition, token, self.store.fences())
        except Exception as exc:  # Redis or etcd away: the partition stays forgotten until the next step
            logger.warning("partition %d: cannot settle the refused claim now (%s)", partition, exc)

    # -- waiting ---------------------------------------------------------------
    def _sleep(self) -> None:
        """Sleep until the next due task, a wake-up, or the next sweep; serve reports meanwhile."""
        owned = self.leadership.owned()
        next_due = min((self._next_due.get(p, 0) for p in owned), default=NEVER)
        local_due = time.monotonic() + (next_due - self._clock_offset_ms) / 1000 - time.time() \
            - self.settings.dispatch_lead
        deadline = max(min(self._last_sweep + self.settings.max_sleep, local_due),
                       time.monotonic() + self._limit.wait_time())
        if not self._controls_known:  # nothing is claimed until they are read again
            deadline = self._controls_read + CONTROLS_REFRESH
        while not self._wake.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self.delivery.pending:
                self.delivery.poll(min(remaining, 0.005))
            else:
                self._wake.wait(remaining)
        self._wake.clear()

    def _due_again(self, partition: int) -> None:
        """Copies of ``partition`` returned to due (their delivery failed): look at it again soon."""
        self._wake_ups += 1
        self._next_due[partition] = 0

    def _on_wake(self, message: dict) -> None:
        """A task was scheduled sooner than anything in its lane, or a queue resumed: look at every
        partition, and read the paused queues again.  A claim in progress read its next due time
        before this: :meth:`tick` does not keep it (``_wake_ups``)."""
        self._wake_ups += 1
        self._next_due.clear()
        self._controls_read = -CONTROLS_REFRESH
        self._wake.set()

    def _on_pubsub_error(self, exc: BaseException, pubsub: object, thread: object) -> None:
        """Redis went away under the wake-up subscription: keep the thread, retry shortly."""
        logger.warning("wake-up subscription: %s; retrying", exc)
        self._stopping.wait(1.0)

    def _watch_readers(self) -> None:
        """Every :data:`READERS_EVERY` s, off the dispatch path: say (once, until it changes) which
        queues' topics hold tasks no worker reads, which is all a worker started without
        ``celery_delayed.install(app)`` shows, and when a worker reads one again."""
        unread: set[str] = set()
        while not self._stopping.wait(READERS_EVERY):
            try:
                topics = {topic.queue: topic for topic in fleet(self.settings).unread}
            except (KafkaException, ValueError) as exc:  # Kafka away: the dispatch says so; look again later
                logger.debug("cannot tell whether the workers read every queue's topic: %s", exc)
                continue
            for queue in sorted(topics.keys() - unread):
                logger.warning(unread_warning(self.settings, topics[queue]))
            for queue in sorted(unread - topics.keys()):
                logger.info("queue %s: its topic is read again", queue)
            unread = set(topics)

    def _complete_stopped_puts(self) -> None:
        """Every :data:`PUTS_EVERY` s, off the dispatch path: complete the recurring schedule puts that
        stopped after their compare-and-set (the client killed, or its next write failed), those whose mark
        the look before found already, at the same version (a put under way clears its own in
        milliseconds).  Else such a schedule ran no more until a poller started: its old occurrence
        is stale, its new one never written."""
        seen: dict[str, int] = {}
        while not self._stopping.wait(PUTS_EVERY):
            try:
                marks = self.recurring.marks()
                stopped = {schedule_id: version for schedule_id, version in marks.items()
                           if seen.get(schedule_id) == version}
                if stopped:
                    self.recurring.complete_puts(stopped)
                seen = marks
            except STORE_ERRORS as exc:  # the store away: look again later
                logger.warning("cannot complete the stopped puts of recurring schedules: %s", exc)

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
