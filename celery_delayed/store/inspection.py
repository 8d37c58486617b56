"""Reading the store without changing it: one task, the next page of the schedule, counts, fences.

:class:`.DelayedStore` inherits these (as BullMQ's ``Queue`` its ``QueueGetters``), so
the operators' views (``delayed show/upcoming/status``, Flower, metrics) live apart
from the writes that move tasks.  Every read is bounded: a page reads at most its
``limit`` (+1) entries per partition, counts one script call per partition.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from celery_delayed.envelope import Envelope, EnvelopeError
from celery_delayed.store.layout import BUCKET_SECONDS, iso_of, member_of, parse_stored, task_id_of

if TYPE_CHECKING:
    from celery_delayed.settings import Settings
    from celery_delayed.store.keys import Keys
    from celery_delayed.store.scripts import Scripts

#: Where a read of the schedule goes on from: after the task due at this ms with this stored
#: id (None, b"": from the first task; (due, b""): from the first task due then or later).
Position = tuple[int | None, bytes]

#: Most tasks one :meth:`DelayedStore.upcoming` page may hold.
MAX_PAGE = 10_000
#: The task name shown for a stored message that cannot be decoded (see ``delayed show``; cancel it).
UNREADABLE = "(unreadable message)"
#: Most buckets one histogram script call counts (about 2 ms of Redis' time).
HISTOGRAM_BUCKETS = 1_080


@dataclass(frozen=True)
class Page:
    """One page of :meth:`DelayedStore.upcoming`: tasks in due order, and where the next page starts."""

    items: list[dict]
    cursor: str | None  # pass as ``after`` for the next page; None when this was the last


class Inspection:
    """The store's reads (a base of :class:`.DelayedStore`, whose client, keys, scripts and
    ``partition``/``execute``/``now_ms`` they use)."""

    settings: Settings
    redis: Any
    keys: Keys
    scripts: Scripts

    if TYPE_CHECKING:  # DelayedStore's
        def partition(self, task_id: str) -> int: ...
        def now_ms(self) -> int: ...
        def execute(self, pipe: Any) -> list: ...
        def _call(self, name: str, keys: list[str], args: list) -> Any: ...
        def _call_redis(self, command: Callable, *args: Any, **kwargs: Any) -> Any: ...

    def get(self, task_id: str) -> dict | None:
        """Where a task stands in the store, or None if the store does not hold it."""
        p, member = self.partition(task_id), member_of(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.msgs(p), member)
        pipe.zscore(self.keys.inflight(p), member)
        stored, deadline = self.execute(pipe)
        if stored is None:
            return None
        start, lane, data = parse_stored(stored)
        try:
            envelope = Envelope.decode(data)
        except EnvelopeError as exc:  # shown as such (the reason in ``error``), for an operator to cancel
            envelope, error = None, str(exc)
        due = None
        if deadline is None:
            due = self._call_redis(self.redis.zscore, self.keys.bucket(p, start, lane), member)
        due_ms = int(due) if due is not None else None
        headers = envelope.headers if envelope else {}
        return {"task_id": task_id, "task": envelope.task_name if envelope else UNREADABLE,
                "queue": envelope.queue if envelope else None, "partition": p,
                "state": "inflight" if deadline is not None else "scheduled",
                "due_ms": due_ms, "eta": iso_of(due_ms),
                "inflight_deadline_ms": int(deadline) if deadline is not None else None,
                "expires": headers.get("expires"), "stored_bytes": len(data), "headers": headers,
                **({} if envelope else {"error": error})}

    def message(self, task_id: str) -> bytes | None:
        """The stored envelope of a task (scheduled or in flight), or None."""
        stored = self._call_redis(self.redis.hget, self.keys.msgs(self.partition(task_id)), member_of(task_id))
        return None if stored is None else parse_stored(stored)[2]

    def lapsed_claims(self, partition: int, now_ms: int) -> list[tuple[str, int]]:
        """The ``(task_id, claim stamp)`` of a partition's in-flight tasks whose claim ran out by
        ``now_ms`` (their poller died before Kafka had them; the next claim puts them back)."""
        entries = self._call_redis(self.redis.zrange, self.keys.inflight(partition), "-inf", now_ms,
                                   byscore=True, withscores=True)
        return [(task_id_of(member), int(stamp)) for member, stamp in entries]

    def upcoming(self, limit: int = 100, after: str | None = None) -> Page:
        """The next ``limit`` scheduled tasks across all partitions, in due order.

        Each partition's next ``limit`` entries are read in one pipeline and merged
        (ties in due time are ordered by stored task id, as within a sorted set).
        ``after`` is the ``cursor`` of the previous page: the due time and id of
        its last task, so a page goes on after it even when tasks before it were
        removed or added since.  Items: see :meth:`describe`; a task dispatched
        between the two reads is left out.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
        page = list(itertools.islice(self.scan(parse_cursor(after), limit + 1), limit + 1))  # a next page?
        return Page(self.describe(page[:limit]), cursor_after(page[limit - 1]) if len(page) > limit else None)

    def scan(self, position: Position = (None, b""), chunk: int = 500) -> Iterator[tuple[int, bytes, int]]:
        """Every scheduled entry after ``position`` (a due ms and stored id, see :func:`parse_cursor`;
        ``(None, b"")``: from the first), in due order across partitions: ``(due ms, member, partition)``.

        Each partition is read ``chunk`` entries at a time, its first chunk for all
        partitions in one pipeline, the next only when the merge reaches it: reading
        ``n`` entries costs about ``n + partitions * chunk`` entry reads, whatever
        the store holds.
        """
        pipe = self.redis.pipeline(transaction=False)
        for p in range(self.settings.partitions):
            self._read_entries(pipe, p, position, chunk)
        firsts = self.execute(pipe)
        return heapq.merge(*(self._partition_scan(p, _entries_of(rows, p), chunk) for p, rows in enumerate(firsts)))

    def partition_scan(self, partition: int, position: Position = (None, b""), chunk: int = 500
                       ) -> Iterator[tuple[int, bytes, int]]:
        """One partition's entries after ``position`` in due order, read ``chunk`` at a time: the next
        chunk is read only once the last entry of this one was taken, after it (due time and id)."""
        return self._partition_scan(partition, self.entries(partition, chunk, position), chunk)

    def _partition_scan(self, p: int, batch: list[tuple[int, bytes, int]], chunk: int
                        ) -> Iterator[tuple[int, bytes, int]]:
        while True:
            yield from batch
            if len(batch) < chunk:
                return
            batch = self.entries(p, chunk, batch[-1][:2])

    def entries(self, partition: int, limit: int, position: Position = (None, b"")
                ) -> list[tuple[int, bytes, int]]:
        """One partition's next ``limit`` tasks after ``position`` (due ms, stored id), in due order:
        ``(due ms, member, partition)``, for :meth:`describe`."""
        pipe = self.redis.pipeline(transaction=False)
        self._read_entries(pipe, partition, position, limit)
        return _entries_of(self.execute(pipe)[0], partition)

    def _read_entries(self, pipe: Any, p: int, position: Position, limit: int) -> None:
        due_ms, member = position
        self.scripts["upcoming"](keys=[self.keys.buckets(p), self.keys.lanes(p)],
                                 args=[self.keys.bucket_prefix(p), BUCKET_SECONDS,
                                       "" if due_ms is None else due_ms, member, limit], client=pipe)

    def describe(self, entries: list[tuple[int, bytes, int]]) -> list[dict]:
        """What an operator sees of each entry still stored: ``task_id``, ``due_ms``, ``eta``,
        ``partition``, ``task``, ``queue``, and Celery's ``argsrepr``, ``kwargsrepr`` and ``retries``
        headers (one pipelined read; a task dispatched meanwhile is left out).  An entry whose message
        cannot be decoded has ``task`` :data:`UNREADABLE` and the reason in ``argsrepr``."""
        by_partition: dict[int, list[bytes]] = {}
        for _, member, p in entries:
            by_partition.setdefault(p, []).append(member)
        pipe = self.redis.pipeline(transaction=False)
        for p, members in by_partition.items():  # one HMGET per partition: a page is a few commands
            pipe.hmget(self.keys.msgs(p), members)
        found = {(p, member): stored for (p, members), replies in zip(by_partition.items(), self.execute(pipe))
                 for member, stored in zip(members, replies)}
        items = []
        for due_ms, member, p in entries:
            stored = found[p, member]
            if stored is not None:
                item = {"task_id": task_id_of(member), "due_ms": due_ms, "eta": iso_of(due_ms), "partition": p}
                try:
                    envelope = Envelope.decode(parse_stored(stored)[2])
                except EnvelopeError as exc:  # shown for what it is, never a failed page or bulk action
                    items.append({**item, "task": UNREADABLE, "queue": None, "argsrepr": str(exc),
                                  "kwargsrepr": None, "retries": 0})
                    continue
                headers = envelope.headers
                items.append({**item, "task": envelope.task_name, "queue": envelope.queue,
                              "argsrepr": headers.get("argsrepr"), "kwargsrepr": headers.get("kwargsrepr"),
                              "retries": headers.get("retries") or 0})
        return items

    def histogram(self, from_ms: int, to_ms: int, bin_ms: int) -> list[int]:
        """Tasks due in each ``bin_ms`` wide bin of ``[from_ms, to_ms)``, all partitions summed, counted
        from the bucket index (no task is read).  ``from_ms`` and ``bin_ms`` must be whole buckets.

        One script call counts at most :data:`HISTOGRAM_BUCKETS` buckets of one partition, and
        the calls go one at a time, not pipelined: Redis serves the pollers' claims between
        them, so a histogram of days never delays a dispatch by more than a call's ~2 ms.
        """
        width = BUCKET_SECONDS * 1000
        if from_ms % width or bin_ms % width or bin_ms <= 0 or to_ms <= from_ms:
            raise ValueError(f"histogram bins must be whole {BUCKET_SECONDS} s buckets from a bucket's start "
                             f"(from {from_ms} ms, bins of {bin_ms} ms)")
        bins = -(-(to_ms - from_ms) // bin_ms)
        per_call = max(1, HISTOGRAM_BUCKETS * width // bin_ms)  # bins one call may count
        counts = [0] * bins
        for p in range(self.settings.partitions):
            for first in range(0, bins, per_call):
                start = from_ms + first * bin_ms
                span = min(per_call, bins - first)
                reply = self._call("histogram", [self.keys.buckets(p), self.keys.lanes(p)],
                                   [self.keys.bucket_prefix(p), start, start + span * bin_ms, bin_ms])
                for i, n in enumerate(reply):
                    counts[first + i] += n
        return counts

    def counts(self) -> list[dict]:
        """Per partition: ``scheduled``, ``inflight``, ``overdue`` (due by Redis' clock, still waiting),
        ``failing`` (their delivery to Kafka failed, and none has gone through since: a nack made
        them due again shortly, so ``overdue`` does not count them), ``next_due_ms`` (its earliest
        task, overdue or not), ``oldest_overdue_s`` (how long the latest of them is past due, a
        failing one by the due time it first failed at; None when none is overdue or failing) and
        ``upcoming_due_ms`` (the earliest task not yet due)."""
        now_ms, replies = self._counts()
        rows = []
        for p, (scheduled, inflight, overdue, next_due, upcoming, failing, failed_due, *_) in enumerate(replies):
            late = [due for due, counted in ((next_due, overdue), (failed_due, failing)) if counted]
            rows.append({"partition": p, "scheduled": scheduled, "inflight": inflight, "overdue": overdue,
                         "failing": failing, "next_due_ms": next_due if next_due >= 0 else None,
                         "oldest_overdue_s": (now_ms - min(late)) / 1000 if late else None,
                         "upcoming_due_ms": upcoming if upcoming >= 0 else None})
        return rows

    def queues(self) -> list[dict]:
        """Per queue holding tasks, paused or rate-limited, by name: ``overdue`` (due, still waiting: a
        paused queue's held back tasks), ``next_due_ms`` (its earliest task), ``paused_since_ms`` (None
        when not paused) and ``rate`` (most tasks a second, None for no limit).  Queue "" stands for
        the tasks stored before lanes (any queue; never paused nor limited)."""
        paused = self.paused()
        rates = self.queue_rates()
        lanes: dict[str, dict] = {}

        def row(queue: str) -> dict:
            return lanes.setdefault(queue, {"queue": queue, "overdue": 0, "next_due_ms": None,
                                            "paused_since_ms": paused.get(queue), "rate": rates.get(queue)})

        for queue in [*paused, *rates]:
            row(queue)
        for reply in self._counts()[1]:
            for i in range(7, len(reply), 3):
                lane = row(reply[i].decode())
                lane["overdue"] += reply[i + 1]
                lane["next_due_ms"] = min(filter(None, (lane["next_due_ms"], reply[i + 2])))
        return sorted(lanes.values(), key=lambda lane: lane["queue"])

    def paused(self) -> dict[str, int]:
        """The paused queues (:meth:`.DelayedStore.pause`), each with when it was paused (ms, Redis clock)."""
        return {queue.decode(): int(since) for queue, since in self._call_redis(self.redis.hgetall,
                                                                               self.keys.paused).items()}

    def rates(self) -> dict[str, float]:
        """The dispatch rates set at run time (:meth:`.DelayedStore.set_rate`), tasks a second per queue
        (0 = no limit), over ``delayed_queue_rates``."""
        return {queue.decode(): float(rate) for queue, rate in self._call_redis(self.redis.hgetall,
                                                                               self.keys.rates).items()}

    def queue_rates(self) -> dict[str, float]:
        """The limits the pollers obey, tasks a second per queue: ``delayed_queue_rates`` with those set
        at run time over it; a queue without a limit is left out."""
        return {queue: rate for queue, rate in {**self.settings.queue_rates, **self.rates()}.items() if rate > 0}

    def _counts(self) -> tuple[int, list[list]]:
        """Redis' clock now, and per partition the reply of ``lua/counts.lua``."""
        now_ms = self.now_ms()
        pipe = self.redis.pipeline(transaction=False)
        for p in range(self.settings.partitions):
            self.scripts["counts"](keys=[*self.keys.core(p), self.keys.failing(p)],
                                   args=[self.keys.bucket_prefix(p), now_ms, BUCKET_SECONDS], client=pipe)
        return now_ms, self.execute(pipe)

    def fences(self) -> list[int]:
        """Per partition, the highest fencing token that has claimed it (0 = none yet)."""
        pipe = self.redis.pipeline(transaction=False)
        for p in range(self.settings.partitions):
            pipe.get(self.keys.fence(p))
        return [int(fence or 0) for fence in self.execute(pipe)]


def totals(rows: list[dict]) -> dict:
    """:meth:`Inspection.counts` over all partitions: the counts summed, the oldest overdue age and
    the earliest upcoming due time."""
    ages = [r["oldest_overdue_s"] for r in rows if r["oldest_overdue_s"] is not None]
    upcoming = [r["upcoming_due_ms"] for r in rows if r["upcoming_due_ms"] is not None]
    return {**{k: sum(r[k] for r in rows) for k in ("scheduled", "inflight", "overdue", "failing")},
            "oldest_overdue_s": max(ages, default=None), "upcoming_due_ms": min(upcoming, default=None)}


def _entries_of(rows: list, partition: int) -> list[tuple[int, bytes, int]]:
    """``upcoming.lua``'s reply as ``(due ms, member, partition)`` entries."""
    return [(int(rows[i + 1]), rows[i], partition) for i in range(0, len(rows), 2)]


def parse_cursor(cursor: str | None) -> Position:
    """The position of a page cursor (``<due ms>:<stored id in hex>``); None: the start."""
    if cursor is None:
        return None, b""
    try:
        due, _, member = cursor.partition(":")
        return int(due), bytes.fromhex(member)
    except ValueError:
        raise ValueError(f"not a cursor of upcoming(): {cursor!r}") from None


def cursor_after(entry: tuple[int, bytes, int]) -> str:
    """The cursor of the position just after ``entry``: its due time and stored id."""
    return f"{entry[0]}:{entry[1].hex()}"
