"""The delayed store: scheduled tasks in Redis, one sorted set per partition.

Layout per partition ``p`` (the ``{p}`` hash tag keeps a partition's keys in one
Redis Cluster slot):

- ``<prefix>:{p}:due``      ZSET task_id -> due time (ms since the epoch)
- ``<prefix>:{p}:msg``      HASH task_id -> envelope (see :mod:`.envelope`)
- ``<prefix>:{p}:inflight`` ZSET task_id -> visibility deadline (ms)
- ``<prefix>:{p}:fence``    highest fencing token that has claimed ``p``

Every change touching more than one key is a Lua script from ``lua/``.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Iterable, Iterator

import redis

from .envelope import Envelope
from .settings import Settings, redact_url

#: Triples per schedule script call: big enough to amortise the round trip,
#: small enough to keep each script's Redis stall well under a millisecond.
SCHEDULE_CHUNK = 500


class StoreUnavailable(ConnectionError):
    """The delayed store's Redis could not be reached; nothing was written."""


class Fenced(RuntimeError):
    """A newer leader owns the partition: this poller must stop dispatching it."""


@dataclass(frozen=True)
class Claim:
    """Result of one claim call on one partition."""

    now_ms: int
    next_due_ms: int | None
    items: list[tuple[str, int, bytes]]  # (task_id, due_ms, envelope)


def partition_of(task_id: str, partitions: int) -> int:
    """Stable partition of a task id (CRC-32, identical in every process and version)."""
    return zlib.crc32(task_id.encode()) % partitions


class DelayedStore:
    """Schedule, claim, acknowledge and inspect delayed tasks in Redis."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.redis = client or redis.Redis.from_url(settings.redis_url, health_check_interval=30)
        self.wake_channel = f"{settings.key_prefix}:wake"
        self._scripts = {name: self.redis.register_script(self.lua_source(name))
                         for name in ("schedule", "claim", "ack", "nack", "cancel")}

    @staticmethod
    def lua_source(name: str) -> str:
        """The text of ``lua/<name>.lua`` (registered once, then called by SHA)."""
        return (resources.files(__package__) / "lua" / f"{name}.lua").read_text()

    # -- keys --------------------------------------------------------------
    def partition(self, task_id: str) -> int:
        return partition_of(task_id, self.settings.partitions)

    def key(self, partition: int, name: str) -> str:
        return f"{self.settings.key_prefix}:{{{partition}}}:{name}"

    # -- scheduling ----------------------------------------------------------
    def schedule(self, envelope: Envelope, due_ms: int) -> bool:
        """Store one task due at ``due_ms``; False if its id was already scheduled."""
        return self.schedule_many([(envelope.task_id, due_ms, envelope.encode())]) == 1

    def schedule_many(self, items: Iterable[tuple[str, int, bytes]],
                      progress: Callable[[int], None] | None = None) -> int:
        """Store ``(task_id, due_ms, envelope_bytes)`` items in bulk; returns how many were new.

        Items are grouped by partition and sent in pipelined chunks; ``progress``
        is called with the number of items handled after each flush.
        """
        added = 0
        for batch in _chunks(items, SCHEDULE_CHUNK * 8):
            by_partition: dict[int, list] = {}
            for task_id, due_ms, data in batch:
                by_partition.setdefault(self.partition(task_id), []).extend((task_id, int(due_ms), data))
            pipe = self.redis.pipeline(transaction=False)
            for p, flat in by_partition.items():
                for start in range(0, len(flat), SCHEDULE_CHUNK * 3):
                    self._scripts["schedule"](keys=[self.key(p, "due"), self.key(p, "msg")],
                                              args=[self.wake_channel, *flat[start:start + SCHEDULE_CHUNK * 3]],
                                              client=pipe)
            added += sum(self._execute(pipe))
            if progress:
                progress(len(batch))
        return added

    def cancel(self, task_id: str) -> int:
        """Remove a scheduled task: 1 cancelled, 0 unknown, -1 already being dispatched."""
        p = self.partition(task_id)
        return self._call("cancel", [self.key(p, "due"), self.key(p, "msg"), self.key(p, "inflight")], [task_id])

    def get(self, task_id: str) -> dict | None:
        """Where a task stands in the store, or None if the store does not hold it."""
        p = self.partition(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zscore(self.key(p, "due"), task_id)
        pipe.zscore(self.key(p, "inflight"), task_id)
        pipe.hget(self.key(p, "msg"), task_id)
        due, deadline, data = self._execute(pipe)
        if data is None:
            return None
        envelope = Envelope.decode(data)
        return {"task_id": task_id, "task": envelope.task_name, "queue": envelope.queue, "partition": p,
                "state": "inflight" if deadline is not None else "scheduled",
                "due_ms": int(due) if due is not None else None,
                "eta": envelope.headers.get("eta")}

    # -- dispatch ------------------------------------------------------------
    def claim(self, partition: int, token: int, limit: int) -> Claim:
        """Move up to ``limit`` due tasks of ``partition`` to inflight and return them."""
        keys = [self.key(partition, n) for n in ("due", "msg", "inflight", "fence")]
        try:
            reply = self._call("claim", keys, [token, limit, int(self.settings.visibility_timeout * 1000)])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise Fenced(f"partition {partition}: {exc}") from None
            raise
        now_ms, next_due = int(reply[0]), int(reply[1])
        items = [(reply[i].decode(), int(float(reply[i + 1])), reply[i + 2]) for i in range(2, len(reply), 3)]
        return Claim(now_ms, None if next_due < 0 else next_due, items)

    def ack(self, partition: int, task_ids: list[str]) -> int:
        """Forget tasks whose delivery to Kafka was confirmed."""
        return self._call("ack", [self.key(partition, "inflight"), self.key(partition, "msg")], task_ids)

    def nack(self, partition: int, task_ids: list[str], delay_ms: int = 1000) -> int:
        """Return claimed tasks to due (their delivery failed), due again after ``delay_ms``."""
        return self._call("nack", [self.key(partition, "inflight"), self.key(partition, "due")],
                          [delay_ms, *task_ids])

    def counts(self) -> list[dict]:
        """Per-partition ``due``/``inflight`` sizes and the head's due time."""
        pipe = self.redis.pipeline(transaction=False)
        for p in range(self.settings.partitions):
            pipe.zcard(self.key(p, "due"))
            pipe.zcard(self.key(p, "inflight"))
            pipe.zrange(self.key(p, "due"), 0, 0, withscores=True)
        replies = self._execute(pipe)
        return [{"partition": p, "scheduled": replies[3 * p], "inflight": replies[3 * p + 1],
                 "next_due_ms": int(replies[3 * p + 2][0][1]) if replies[3 * p + 2] else None}
                for p in range(self.settings.partitions)]

    def overdue_count(self) -> int:
        """Tasks whose due time has passed (by Redis' clock) but are still waiting."""
        seconds, micros = self.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        pipe = self.redis.pipeline(transaction=False)
        for p in range(self.settings.partitions):
            pipe.zcount(self.key(p, "due"), "-inf", now_ms)
        return sum(self._execute(pipe))

    # -- plumbing ------------------------------------------------------------
    def _call(self, name: str, keys: list[str], args: list):
        try:
            return self._scripts[name](keys=keys, args=args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(self._unavailable(exc)) from exc

    def _execute(self, pipe: redis.client.Pipeline) -> list:
        try:
            return pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(self._unavailable(exc)) from exc

    def _unavailable(self, exc: Exception) -> str:
        return f"delayed store at {redact_url(self.settings.redis_url)} unavailable: {exc}"


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
