"""The delayed store: scheduled tasks in Redis, one sorted set per partition.

Each partition ``p`` keeps its tasks in time buckets (``<prefix>:{p}:t:<queue>:<start>``),
one lane of buckets per queue with an index of its buckets, a hash of the messages and
an inflight set; :mod:`.keys` names every key and what it holds.  Lanes keep queues
apart at dispatch: a claim takes from each queue's due tasks in turn, so a campaign
of a million tasks due at once on one queue delays no other queue's tasks
(``lua/_buckets.lua``, ``lua/claim.lua``).

Why buckets: one sorted set of millions costs ~150 B per task in Redis (skip
list + hash table); a bucket of at most ``zset-max-listpack-entries`` (128)
tasks is one compact listpack, ~30 B per task.  Ten-second buckets hold a
partition's tasks that way up to ~12 tasks/s of due times per partition
(~17M a day with 16 partitions); a denser bucket is an ordinary sorted set.
Ids are stored as their 16 bytes when they are canonical UUIDs (Celery's
default), saving ~40 B more per task (:func:`.layout.member_of`).

Every change touching more than one key is a Lua script from ``lua/``.  The
store's reads are in :mod:`.inspection`; its start-up checks in :mod:`.durability`.
"""
from __future__ import annotations

import math
import time
import uuid
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized

import redis
from redis.cluster import ClusterNode

from celery_delayed import inert
from celery_delayed.settings import RATE, ConfigurationError, Settings, WaitPolicy, redact_url
from celery_delayed.store.inspection import Inspection
from celery_delayed.store.keys import Keys
from celery_delayed.store.layout import (BUCKET_SECONDS, LAYOUT_FORMAT, MAX_DUE_MS, MAX_LANE, READS_FORMATS,
    due_ms_of, lane_of, member_of, parse_stored, partition_of, stored_message, task_id_of)
from celery_delayed.store.outcomes import (STORE_ERRORS, Change, Fenced, LayoutMismatch, StoreNotDurable, Stored,
    StoreRefused, StoreUnavailable, write_retrying)
from celery_delayed.store.redis_client import UNREACHABLE, connect, execute, refusal
from celery_delayed.store.scripts import Scripts

logger = inert.logger(__name__)

#: A task to schedule: ``(task_id, due_ms, envelope)``, or with its envelope's queue as a fourth item.
Item = tuple[str, int, bytes] | tuple[str, int, bytes, str]
#: Tasks per schedule script call: each costs Redis ~8 µs (a bucket ZADD apiece
#: when due times are spread out), so a call stalls other clients ~2 ms at most
#: (a 128-task chunk: 1 ms, but 15% fewer tasks/s).
SCHEDULE_CHUNK = 256
#: Items grouped and sent per pipeline by :meth:`DelayedStore.schedule_many`.
SCHEDULE_BATCH = 4000
#: Threads sending :meth:`DelayedStore.schedule_many` pipelines at once.
SENDERS = 2
#: Seconds of a queue's rate its token bucket holds at most: how far ahead of its
#: rate a rate-limited queue may go after a pause in its dispatch.
TOKEN_BURST_S = 0.25
#: How long (ms) what a cancel request removed is kept for the request sent again after a lost reply
#: (``write_retrying`` does so within seconds), when the request cannot forget it itself.
CANCEL_KEPT_MS = 60_000
#: Most ``(task_id, stamp)`` pairs per ack/nack script call: their variadic commands must stay
#: within Lua's ``unpack`` limit (~8000 values).
SCRIPT_PAIRS = 1000
#: A process's clock is taken as the store's when they differ by less than this (ms): within dispatch's
#: precision and a round trip's noise.  Larger, a due time it computes is moved to the store's clock.
SKEW_TOLERANCE_MS = 1000
#: How long (s) a process's measured skew to the store's clock is kept: a step of its clock is seen within it.
SKEW_KEPT_S = 1.0


@dataclass(frozen=True)
class Claim:
    """Result of one claim call on one partition."""

    now_ms: int
    next_due_ms: int | None
    stamp: int  # names this claim's copies to ack and nack (their visibility deadline, ms)
    items: list[tuple[str, int, bytes]]  # (task_id, due_ms, envelope)
    taken: Counter[str] = field(default_factory=Counter)  # tasks per lane (layout.lane_of): what caps are spent by
    throttled: frozenset[str] = frozenset()  # the capped queues that spent their caps with tasks still due


class DelayedStore(Inspection):
    """Schedule, claim and acknowledge delayed tasks in Redis; read them (:class:`.Inspection`)."""

    def __init__(self, settings: Settings, client: redis.Redis | redis.RedisCluster | None = None) -> None:
        self.settings = settings
        try:
            self.redis = client or connect(settings)
        except UNREACHABLE as exc:  # a cluster client reads the slot map at once
            raise StoreUnavailable(self._unavailable(exc)) from exc
        self.keys = Keys(settings.key_prefix)
        self._layout_checked = False
        self.scripts = Scripts(self.redis)
        self.durable = DurableWrites(self)
        self._unread_claims: dict[int, str] = {}  # partition -> request id of a claim whose reply was not read
        self._skew_ms, self._skew_until = 0, 0.0  # the store's clock minus this process's, and until when it holds

    # -- keys --------------------------------------------------------------
    def partition(self, task_id: str) -> int:
        return partition_of(task_id, self.settings.partitions)


    # -- scheduling ----------------------------------------------------------
    def schedule(self, task_id: str, due_ms: int, data: bytes, attempt: int = 0) -> Stored:
        """Store one task (``data`` as :meth:`DelayedAMQP.stored_form` makes it), attempt number
        ``attempt`` (Celery's ``retries``) of its id; says what became of it.

        A newer attempt replaces the stored copy; the same attempt replaces only
        a copy in flight (being dispatched); an older one replaces nothing (see
        ``lua/schedule.lua``).
        """
        pipe, probes, _ = next(self._schedule_pipelines([(task_id, due_ms, data)], attempt))
        added, replaced, _ = self._schedule_replies(self._send(pipe, probes))
        return Stored.ADDED if added else Stored.REPLACED if replaced else Stored.KEPT

    def schedule_many(self, items: Iterable[Item], progress: Callable[[int], None] | None = None,
                      attempt: int = 0) -> int:
        """Store ``(task_id, due_ms, envelope_bytes)`` items, each attempt number ``attempt``
        (first attempts by default), in bulk; returns how many were stored.  An item may add its
        envelope's queue, ``(task_id, due_ms, envelope_bytes, queue)``, when the caller knows it: its
        lane is then taken from it, not read from the envelope (an inflate per task when deflated);
        one item a batch is checked (``ValueError`` when its queue is not its envelope's).

        An id the store already holds keeps its stored copy while that one is
        scheduled (or is a later attempt); a copy in flight (being dispatched) of
        the same attempt, or an earlier one, is replaced, so the newer copy
        survives that dispatch's ack.

        ``items`` may be any iterable, millions long: it is consumed in batches of
        :data:`SCHEDULE_BATCH`, each grouped by partition and sent as one pipeline
        of schedule scripts; ``progress`` gets the number of items of each batch
        once it is stored.  Past one batch, :data:`SENDERS` helper threads (each
        on its own connection) send pipelines while the next is grouped, so one
        packs commands while Redis runs another's scripts.  When an id occurs
        in two batches, either copy may win.  When a batch fails, the (at most
        two) batches already sent may still be stored without a progress call;
        scheduling again is safe, as scheduled ids are kept.
        A bad item raises ``ValueError`` naming it before its batch is written
        (earlier batches stay stored); each task is stored whole or not at all.
        """
        pipelines = self._schedule_pipelines(items, attempt)
        if isinstance(items, Sized) and len(items) <= SCHEDULE_BATCH:  # a few tasks: no thread
            return sum(self._stored(self._send(pipe, probes), size, progress) for pipe, probes, size in pipelines)
        added = 0
        with ThreadPoolExecutor(SENDERS, thread_name_prefix="delayed-schedule") as sender:
            sending: deque[tuple[Future, int]] = deque()
            for pipe, probes, size in pipelines:
                sending.append((sender.submit(self._send, pipe, probes), size))
                if len(sending) > SENDERS:
                    added += self._stored(sending[0][0].result(), sending.popleft()[1], progress)
            for future, size in sending:
                added += self._stored(future.result(), size, progress)
        return added

    def schedule_attempts(self, items: Sequence[Item], attempts: Sequence[int]) -> int:
        """Store ``items`` as :meth:`schedule_many` does, item ``i`` as attempt number ``attempts[i]`` (as
        :meth:`schedule` stores one), a pipeline per :data:`SCHEDULE_BATCH`; returns how many were stored."""
        return sum(self._stored(self._send(pipe, probes), size, None)
                   for pipe, probes, size in self._schedule_pipelines(items, attempts=attempts))

    def _schedule_pipelines(self, items: Iterable[Item], attempt: int = 0, attempts: Sequence[int] | None = None
                            ) -> Iterator[tuple[redis.client.Pipeline, list[str], int]]:
        """Per batch of items: a pipeline of schedule scripts, one per partition chunk, the probe keys its
        wait uses in a cluster (:meth:`DurableWrites.confirm`), and the batch size.
        Each item is attempt number ``attempt``, or with ``attempts`` its own (by its index in ``items``)."""
        done = 0
        for batch in _chunks(items, SCHEDULE_BATCH):
            by_partition: dict[int, list] = {}
            checked = False  # whether an item's queue given was checked against its message's
            for index, item in enumerate(batch):
                task_id, due_ms, data, queue = item if len(item) == 4 else (*item, None)
                if (type(task_id) is not str or type(due_ms) is not int or type(data) is not bytes or not task_id
                        or task_id[0] == "\0" or not 0 <= due_ms < MAX_DUE_MS
                        or (queue is not None and type(queue) is not str)):
                    # the slow path names the problem
                    due_ms = _checked_due_ms(task_id, due_ms, data, done + index, queue)
                if queue is not None and not checked:
                    checked = _check_queue_given(task_id, data, queue, done + index)
                by_partition.setdefault(self.partition(task_id), []).extend(
                    (member_of(task_id), due_ms, attempt if attempts is None else attempts[done + index],
                     stored_message(due_ms, data, queue)))
            pipe = self.redis.pipeline(transaction=False)
            for p, flat in by_partition.items():
                for start in range(0, len(flat), SCHEDULE_CHUNK * 4):
                    self.scripts["schedule"](keys=[*self.keys.core(p), self.keys.attempts(p), self.keys.failing(p)],
                                             args=[self.keys.wake, self.keys.bucket_prefix(p),
                                                   *flat[start:start + SCHEDULE_CHUNK * 4]],
                                             client=pipe)
            self.durable.end(pipe)
            done += len(batch)
            yield pipe, [self.keys.wait_probe(p) for p in by_partition], len(batch)

    def _send(self, pipe: redis.client.Pipeline, probes: list[str]) -> list:
        """Run a schedule pipeline and confirm its writes as ``delayed_schedule_wait`` asks."""
        return self.durable.confirm(pipe, self.execute(pipe), probes)

    @classmethod
    def _stored(cls, replies: list[list[int]], size: int, progress: Callable[[int], None] | None) -> int:
        if progress:
            progress(size)
        added, replaced, _ = cls._schedule_replies(replies)
        return added + replaced

    @staticmethod
    def _schedule_replies(replies: list[list[int]]) -> tuple[int, int, int]:
        """``(added, replaced, kept)`` summed over a pipeline of schedule scripts."""
        return tuple(sum(column) for column in zip(*replies)) if replies else (0, 0, 0)

    def cancel(self, task_id: str) -> Change:
        """Remove a scheduled task: DONE, UNKNOWN, or IN_FLIGHT (a poller is dispatching it)."""
        removed = self.cancel_many([task_id])[task_id]
        return Change.DONE if isinstance(removed, bytes) else removed

    def cancel_many(self, task_ids: Iterable[str]) -> dict[str, bytes | Change]:
        """Remove scheduled tasks; per id its envelope when removed, else why not (UNKNOWN, IN_FLIGHT).

        Sent again, with the same request id, while the store is unreachable: a reply lost after
        Redis removed the tasks is then answered from what the request removed (``lua/cancel.lua``),
        which is forgotten once read."""
        ids = list(dict.fromkeys(task_ids))
        request = uuid.uuid4().hex

        def send() -> list:
            pipe = self.redis.pipeline(transaction=False)
            for task_id in ids:
                p = self.partition(task_id)
                keys = [*self.keys.core(p), self.keys.attempts(p), self.keys.cancelled(p, request),
                        self.keys.failing(p)]
                self.scripts["cancel"](keys=keys, client=pipe,
                                       args=[self.keys.bucket_prefix(p), member_of(task_id), CANCEL_KEPT_MS])
            return self.execute(pipe)

        replies = write_retrying(send, (), failed=f"cancel of {len(ids)} tasks", errors=(StoreUnavailable,),
                                 unless=(StoreRefused,))  # a refusal is an answer: no reply was lost
        self._forget_cancelled(request, {self.partition(task_id) for task_id, reply in zip(ids, replies)
                                         if isinstance(reply, bytes)})
        return {task_id: reply if isinstance(reply, bytes) else Change(reply) for task_id, reply in zip(ids, replies)}

    def _forget_cancelled(self, request: str, partitions: set[int]) -> None:
        """Drop what a cancel request removed, its reply read (a store away now: it expires)."""
        if not partitions:
            return
        pipe = self.redis.pipeline(transaction=False)
        for p in partitions:  # one key per DEL: a cluster pipeline refuses several
            pipe.delete(self.keys.cancelled(p, request))
        try:
            self.execute(pipe)
        except STORE_ERRORS as exc:
            logger.debug("cancel request %s: its record stays until it expires (%s)", request, exc)

    # -- replace by key ------------------------------------------------------
    def key_holder(self, key: str) -> str | None:
        """The task scheduled under a replace-by-key ``key`` (the ``delayed_key`` header), or None."""
        holder = self._call_redis(self.redis.hget, self._key_index(key), key)
        return None if holder is None else holder.decode()

    def hold_key(self, key: str, task_id: str, seen: str | None = None, *, replace: bool = False
                 ) -> tuple[bool, str | None]:
        """Point ``key`` at ``task_id``: whatever holds it with ``replace``, else only if ``seen`` (None:
        nobody) still holds it.  Returns whether it did, and the holder before (or the current one)."""
        done, holder = self._call("hold_key", [self._key_index(key)], [key, task_id, "*" if replace else seen or ""])
        return bool(done), None if holder is None else holder.decode()

    def release_key(self, key: str, task_id: str) -> bool:
        """Forget ``key`` if ``task_id`` still holds it (its task ended or was cancelled)."""
        return bool(self._call("release_key", [self._key_index(key)], [key, task_id]))

    def _key_index(self, key: str) -> str:
        """The hash of the keys in ``key``'s partition (keys are spread as task ids are)."""
        return self.keys.key_index(self.partition(key))

    def reschedule(self, task_id: str, due: datetime | int) -> int:
        """Move a scheduled task to a new due time (a datetime, or ms since the epoch); returns the due ms.

        Raises :class:`TaskNotScheduled` for an id the store does not hold and
        :class:`TaskInFlight` for a task a poller is already dispatching.
        """
        due_ms = _in_range(due_ms_of(due))
        self.reschedule_many([(task_id, due_ms)])[task_id].check(task_id, "rescheduled")
        return due_ms

    def reschedule_many(self, moves: Iterable[tuple[str, int]]) -> dict[str, Change]:
        """Move scheduled tasks, ``(task_id, new due ms)`` pairs, in one pipeline; per id DONE,
        UNKNOWN or IN_FLIGHT (a poller is dispatching it: it runs when it was due)."""
        due_of = dict(moves)
        pipe = self.redis.pipeline(transaction=False)
        for task_id, due_ms in due_of.items():
            p = self.partition(task_id)
            self.scripts["reschedule"](keys=[*self.keys.core(p), self.keys.failing(p)], client=pipe,
                                       args=[self.keys.wake, self.keys.bucket_prefix(p), BUCKET_SECONDS,
                                             member_of(task_id), _in_range(due_ms)])
        return {task_id: Change(reply) for task_id, reply in zip(due_of, self.execute(pipe))}

    def now_ms(self) -> int:
        """Redis' clock, the one every due comparison uses, in ms since the epoch."""
        seconds, micros = self._call_redis(self.redis.time)
        return seconds * 1000 + micros // 1000

    def on_store_clock(self, due_ms: int) -> int:
        """``due_ms``, worked out by this process's clock (a countdown, a retry's delay), as the store's clock
        reads it: the store's clock decides when a task is due, so a process whose wall clock is off (stepped
        30 s ahead, say) must not make its tasks that late.  The skew is measured (``TIME``) at most once
        every :data:`SKEW_KEPT_S`; one under :data:`SKEW_TOLERANCE_MS` counts as none, and while the store
        cannot be asked, the last one measured holds (the write that follows fails or waits anyway) and it
        is asked again only that much later: a store that stops answering must not cost every task of a
        batch its socket timeout."""
        if time.monotonic() >= self._skew_until:
            try:
                before = time.time() * 1000
                skew = self.now_ms() - (before + time.time() * 1000) / 2
                self._skew_ms = int(skew) if abs(skew) >= SKEW_TOLERANCE_MS else 0
            except STORE_ERRORS:
                pass
            self._skew_until = time.monotonic() + SKEW_KEPT_S
        return due_ms + self._skew_ms

    # -- dispatch ------------------------------------------------------------
    def claim(self, partition: int, token: int, limit: int, paused: Iterable[str] = (),
              caps: dict[str, int] | None = None) -> Claim:
        """Move up to ``limit`` tasks of ``partition`` due within ``delayed_dispatch_lead`` to inflight
        and return them: none of the ``paused`` queues', at most ``caps[q]`` of queue ``q``'s (the
        claim's ``throttled`` names each capped queue, not paused, left with due tasks).

        A claim that raised before its tasks were read (its reply lost after Redis ran it) left them
        in flight: the next claim of ``partition`` sends its request id again and gets them too, rather
        than leaving them to the visibility timeout (``lua/claim.lua``).  So does the first claim of a
        new leader (``token`` above the partition's fence) with every copy its predecessors left in
        flight: a leader killed mid-dispatch delays its copies by a failover, not a visibility timeout."""
        keys = [*self.keys.core(partition), self.keys.fence(partition), self.keys.stamp(partition),
                self.keys.last_claim(partition), self.keys.handover(partition)]
        request = self._unread_claims.setdefault(partition, uuid.uuid4().hex)
        paused = list(paused)
        try:
            reply = self._call("claim", keys, [token, limit, int(self.settings.visibility_timeout * 1000),
                                               self.keys.bucket_prefix(partition), BUCKET_SECONDS,
                                               int(self.settings.dispatch_lead * 1000), request, len(paused),
                                               *paused, *(v for pair in (caps or {}).items() for v in pair)])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise Fenced(f"partition {partition}: {exc}") from None
            raise
        now_ms, next_due, stamp = int(reply[0]), int(reply[1]), int(reply[2])
        items: list[tuple[str, int, bytes]] = []
        taken: Counter[str] = Counter()
        members = reply[4::2]
        for member, due_ms, stored, held in zip(members, reply[5::2], *self._read_claimed(partition, members)):
            if held != stamp or stored is None:  # no longer this claim's (a retry replaced it), or no message
                continue
            _, lane, envelope = parse_stored(stored)
            taken[lane] += 1
            items.append((task_id_of(member), int(float(due_ms)), envelope))
        del self._unread_claims[partition]
        return Claim(now_ms, None if next_due < 0 else next_due, stamp, items, taken,
                     frozenset(lane.decode() for lane in reply[3]))

    def _read_claimed(self, partition: int, members: list[bytes]) -> tuple[list, list]:
        """The stored messages of tasks a claim moved to inflight, then their inflight stamps: read in
        this order, a message is the claimed copy if its stamp is still the claim's (``lua/claim.lua``).

        On a Redis Cluster the stamps are asked for once the messages came back: a cluster pipeline
        sends a command redirected by a slot migration (ASK) again after the others, so it could read
        the stamps first (review of stop 37)."""
        if not members:
            return [], []
        msgs, inflight = self.keys.msgs(partition), self.keys.inflight(partition)
        if self.settings.redis_cluster:
            stored = self._call_redis(self.redis.hmget, msgs, members)
            return stored, self._call_redis(self.redis.zmscore, inflight, members)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(msgs, members)
        pipe.zmscore(inflight, members)
        stored, stamps = self.execute(pipe)
        return stored, stamps

    def ack(self, partition: int, claimed: list[tuple[str, int]]) -> int:
        """Forget tasks whose delivery to Kafka was confirmed: ``(task_id, claim stamp)`` pairs.

        Only a copy still in flight under that claim is forgotten; a newer copy
        scheduled meanwhile, or a later claim, stays.
        """
        keys = [self.keys.inflight(partition), self.keys.msgs(partition), self.keys.attempts(partition),
                self.keys.failing(partition)]
        return sum(self._call("ack", keys, _pairs(chunk)) for chunk in _chunks(claimed, SCRIPT_PAIRS))

    def nack(self, partition: int, claimed: list[tuple[str, int]], delay_ms: int = 1000,
             failed: dict[str, int] | None = None) -> int:
        """Return claimed tasks (``(task_id, claim stamp)`` pairs) to due, due again after ``delay_ms``;
        as for :meth:`ack`, only copies of that claim.  ``failed`` gives the due time (ms) of those
        whose delivery failed: each counts as failing from the first of them until it is delivered
        (:meth:`counts`), where a nack alone would hide it by moving its due time on."""
        failed = failed or {}
        return sum(self._call("nack", [*self.keys.core(partition), self.keys.failing(partition)],
                              [self.keys.bucket_prefix(partition), BUCKET_SECONDS, delay_ms,
                               *(value for task_id, stamp in chunk
                                 for value in (member_of(task_id), stamp, failed.get(task_id, "")))])
                   for chunk in _chunks(claimed, SCRIPT_PAIRS))

    # -- pausing queues --------------------------------------------------------
    def pause(self, queue: str) -> bool:
        """Hold ``queue``'s tasks in the store, due or not, until :meth:`resume`: every poller stops
        claiming them within a second.  False when it was paused already (it stays paused since then)."""
        _check_queue(queue, "pause")
        return bool(self.durable.command(self.keys.paused, "HSETNX", self.keys.paused, queue, self.now_ms()))

    def resume(self, queue: str) -> bool:
        """Let ``queue``'s tasks go again, due ones oldest first; wakes the pollers.  False when it was
        not paused."""
        resumed = bool(self.durable.command(self.keys.paused, "HDEL", self.keys.paused, queue))
        self._call_redis(self.redis.publish, self.keys.wake, 0)
        return resumed

    def set_rate(self, queue: str, rate: float | None) -> None:
        """Limit ``queue``'s dispatch to ``rate`` tasks a second in all pollers (0: no limit), over
        ``delayed_queue_rates``; None: that setting applies again."""
        _check_queue(queue, "limit")
        if rate is None:
            self.durable.command(self.keys.rates, "HDEL", self.keys.rates, queue)
        elif not (rate == 0 or rate in RATE):
            raise ValueError(f"a rate must be tasks a second {RATE}, or 0 (no limit), got {rate!r}")
        else:
            self.durable.command(self.keys.rates, "HSET", self.keys.rates, queue, repr(float(rate)))

    def take_tokens(self, queue: str, rate: float, want: int) -> int:
        """Take up to ``want`` of the tokens ``queue`` earns at ``rate`` a second, shared by every poller
        (``lua/tokens.lua``); ``want`` < 0 gives unused ones back.  Returns how many it took."""
        burst = max(1.0, rate * TOKEN_BURST_S)
        return int(self._call("tokens", [self.keys.tokens(queue)], [repr(float(rate)), repr(burst), want]))

    # -- layout --------------------------------------------------------------
    def layout(self) -> dict[str, int]:
        """What decides where a task is stored: this process's partitions, bucket width and format."""
        return {"partitions": self.settings.partitions, "bucket_seconds": BUCKET_SECONDS, "format": LAYOUT_FORMAT}

    def check_layout(self) -> bool:
        """Record this process's layout in ``<prefix>:layout`` if the store has none, else compare.

        Done once per store object, before its first Redis call (or at start by
        the poller, workers and CLI): ``partition_of`` depends on the partition
        count, so a process with another one would strand tasks or miss them in
        cancel, reschedule and dedup.  Returns True when this call recorded the
        layout, i.e. nothing was stored under this key prefix before.
        Raises :class:`LayoutMismatch`, naming both values, on a difference.
        A store of an older format this one reads as it is (:data:`READS_FORMATS`)
        is recorded as this format, so processes of the older one refuse it from then on.
        """
        mine = {k: str(v) for k, v in self.layout().items()}
        recorded = " ".join(f"{k}={v}" for k, v in mine.items())
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.layout, recorded, nx=True)
        pipe.get(self.keys.layout)
        created, stored = self._unchecked(execute, self.redis, pipe)
        stored_layout = dict(item.split("=", 1) for item in stored.decode().split())
        differences = [f"{'delayed_' if k == 'partitions' else ''}{k}={v} (this process: {mine.get(k)})"
                       for k, v in stored_layout.items() if mine.get(k) != v]
        older = stored_layout.get("format") in {str(f) for f in READS_FORMATS if f < LAYOUT_FORMAT}
        if older and differences == [f"format={stored_layout['format']} (this process: {LAYOUT_FORMAT})"]:
            self._unchecked(self.redis.set, self.keys.layout, recorded)
            logger.warning("delayed store %s: format %s recorded as format %s (lanes); its tasks are read as they "
                           "are. Pollers of the older version do not dispatch tasks stored from now on: upgrade them "
                           "first (docs/operations.md: Upgrading to lanes)", self.keys.layout, stored_layout["format"],
                           LAYOUT_FORMAT)
            differences = []
        if differences:
            raise LayoutMismatch(
                f"the delayed store {self.keys.layout} at {redact_url(self.settings.redis_url)} was laid out with "
                f"{', '.join(differences)}: use the stored value, or drain the store with it and then change it "
                "(docs/operations.md: Changing the store layout)")
        self._layout_checked = True
        return bool(created)

    # -- plumbing ------------------------------------------------------------
    def _call(self, name: str, keys: list[str], args: list):
        return self._call_redis(self.scripts[name], keys=keys, args=args)

    def execute(self, pipe: redis.client.Pipeline) -> list:
        """Run a pipeline of this store's Redis; its errors as :meth:`_unchecked` raises them."""
        return self._call_redis(execute, self.redis, pipe)

    def _call_redis(self, command: Callable, *args, **kwargs):
        """``command(*args, **kwargs)``, once the layout is checked; errors as :meth:`_unchecked` raises them."""
        if not self._layout_checked:
            self.check_layout()
        return self._unchecked(command, *args, **kwargs)

    def _unchecked(self, command: Callable, *args, **kwargs):
        """``command(*args, **kwargs)``: the store's calls to its Redis go through here, so an
        unreachable store is :class:`StoreUnavailable` and one that refuses commands whatever
        they are (full, read-only, an ACL) :class:`StoreRefused`, each naming the store."""
        try:
            return command(*args, **kwargs)
        except UNREACHABLE as exc:
            raise StoreUnavailable(self._unavailable(exc)) from exc
        except redis.ResponseError as exc:
            if (why := refusal(exc)) is None:
                raise
            raise StoreRefused(f"delayed store at {redact_url(self.settings.redis_url)} {why}") from exc

    def _unavailable(self, exc: Exception) -> str:
        return f"delayed store at {redact_url(self.settings.redis_url)} unavailable: {exc}"


def _check_queue(queue: str, what: str) -> None:
    """A queue that can be paused or limited has a lane of its own: a name of 1 to MAX_LANE bytes."""
    if not queue or len(queue.encode()) > MAX_LANE:
        raise ValueError(f"a queue to {what} must be a name of 1 to {MAX_LANE} bytes, got {queue!r}")


def _pairs(claimed: list[tuple[str, int]]) -> list:
    """``(task_id, stamp)`` pairs as the flat script arguments of ack and nack."""
    return [value for task_id, stamp in claimed for value in (member_of(task_id), stamp)]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _checked_due_ms(task_id: object, due_ms: object, data: object, index: int, queue: object = None) -> int:
    """The due ms of item ``index`` as an int; ``ValueError`` naming the item when it cannot be stored."""
    if not isinstance(task_id, str) or not task_id or task_id[0] == "\0":
        raise ValueError(f"item {index}: task id must be a non-empty str not starting with NUL, got {task_id!r}")
    if not isinstance(due_ms, (int, float)) or isinstance(due_ms, bool) or not math.isfinite(due_ms):
        raise ValueError(f"item {index} ({task_id}): due time must be ms since the epoch, got {due_ms!r}")
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"item {index} ({task_id}): message must be bytes, got {type(data).__name__}")
    if queue is not None and not isinstance(queue, str):
        raise ValueError(f"item {index} ({task_id}): queue must be a str, got {type(queue).__name__}")
    return _in_range(int(due_ms), f"item {index} ({task_id}): ")


def _check_queue_given(task_id: str, data: bytes, queue: str, index: int) -> bool:
    """True when item ``index``'s queue given puts it in its message's lane; else ``ValueError`` naming
    both: in another lane, a task is dispatched to its message's queue, yet that queue's pause does not
    hold it.  Checked for one item a batch (reading the queue of a deflated message inflates it)."""
    if stored_message(0, data, queue) != stored_message(0, data):
        raise ValueError(f"item {index} ({task_id}): queue {queue!r} given, its message's is {lane_of(data)!r}")
    return True


def _in_range(due_ms: int, what: str = "") -> int:
    """``due_ms`` if the store can hold it (its bucket start fits 4 bytes), else ``ValueError``."""
    if not 0 <= due_ms < MAX_DUE_MS:
        raise ValueError(f"{what}due time must be between 1970 and 2106 (ms since the epoch), got {due_ms}")
    return due_ms


class DurableWrites:
    """The ``delayed_schedule_wait`` policy of one store's writes that must not be lost: tasks
    scheduled, dead letters (their message settled once parked), and the queue controls (a pause
    lost in a failover would let every poller dispatch the queue)."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        self.policy = store.settings.wait_policy
        self._waitaof_checked = False

    def end(self, pipe: redis.client.Pipeline) -> None:
        """End a pipeline of writes (schedule, dead letter) with its wait: on the pipeline's own
        connection, as ``WAIT`` and ``WAITAOF`` count that connection's writes.  A cluster
        pipeline's connections are not ours: it is waited for after it ran (:meth:`confirm`)."""
        if self.policy is not None and not isinstance(self.store.redis, redis.RedisCluster):
            self._wait(pipe, self.policy)

    def confirm(self, pipe: redis.client.Pipeline, replies: list, probes: list[str]) -> list:
        """The replies of a schedule pipeline that ran, without its wait's; raises
        :class:`StoreNotDurable` when the writes are not held as the policy asks.  In a cluster, the
        wait is on the node of each of ``probes``, a short-lived key in the slot of each group of
        keys written (:meth:`.Keys.wait_probe`, :attr:`.Keys.dlq_wait`)."""
        if self.policy is None:
            return replies
        if isinstance(self.store.redis, redis.RedisCluster):
            self._wait_on_nodes(probes, self.policy)
            return replies
        self._check(replies.pop(), self.policy)
        return replies

    def command(self, key: str, *command: Any) -> Any:
        """Run ``command``, a write of ``key`` alone, and wait for it as the policy asks, on the
        connection that wrote it (in a cluster, to the primary holding ``key``); its reply.
        Raises :class:`StoreNotDurable` as a schedule write does."""
        client = self.store.redis
        if self.policy is None:
            return self.store._call_redis(client.execute_command, *command)
        if isinstance(client, redis.RedisCluster):
            client = client.get_node_from_key(key).redis_connection
        pipe = client.pipeline(transaction=False)
        pipe.execute_command(*command)
        self._wait(pipe, self.policy)
        reply, acked = self.store._call_redis(pipe.execute)
        self._check(acked, self.policy)
        return reply

    def _wait_on_nodes(self, probes: list[str], policy: WaitPolicy) -> None:
        """``WAIT``/``WAITAOF`` on every primary that holds one of ``probes``, after the writes.

        Both count the writes of their own connection, and a cluster pipeline's connections are not
        ours to use; but a primary's replication stream is ordered, so a write sent after the
        pipeline's answer, on a connection of our own, is replicated after them: a ``SET`` of the
        short-lived probe key, then the wait.  A primary that moved meanwhile answers ``MOVED``
        (a store error): the write is then not confirmed, and writing again is safe.
        """
        by_node: dict[str, tuple[ClusterNode, str]] = {}
        for probe in probes:
            node = self.store.redis.get_node_from_key(probe)
            by_node.setdefault(node.name, (node, probe))
        for node, probe in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            pipe.execute_command("SET", probe, 1, "PX", 60_000)
            self._wait(pipe, policy)
            self._check(self.store._unchecked(pipe.execute)[-1], policy)

    def _wait(self, pipe: redis.client.Pipeline, policy: WaitPolicy) -> None:
        if policy.aof:
            self._require_waitaof()
            pipe.execute_command("WAITAOF", 1, policy.replicas, policy.timeout_ms)
        else:
            pipe.execute_command("WAIT", policy.replicas, policy.timeout_ms)

    def _require_waitaof(self) -> None:
        """``WAITAOF`` came with Redis 7.2: say so once, rather than fail on every write."""
        if self._waitaof_checked:
            return
        version = self.store._call_redis(self.store.redis.info, "server")["redis_version"]
        if tuple(map(int, version.split(".")[:2])) < (7, 2):
            raise ConfigurationError(f"delayed_schedule_wait={self.store.settings.schedule_wait!r} needs WAITAOF, "
                                     f"new in Redis 7.2; the store's Redis is {version} (use replicas=N with WAIT "
                                     "instead)")
        self._waitaof_checked = True

    def _check(self, acked: Any, policy: WaitPolicy) -> None:
        """Raise StoreNotDurable unless ``acked`` (a WAIT or WAITAOF reply) meets ``policy``."""
        local, replicas = acked if policy.aof else (1, acked)
        if not local or replicas < policy.replicas:
            raise StoreNotDurable(
                f"store write not durable within {policy.timeout_ms} ms (delayed_schedule_wait="
                f"{self.store.settings.schedule_wait!r}): {replicas} of {policy.replicas} replicas acknowledged "
                f"it{'' if local else ', not fsynced to the AOF'}; what it wrote is on the primary and may be lost if "
                "it fails now (writing it again is safe: scheduled tasks and dead letters keep one copy)")
