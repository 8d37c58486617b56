"""Which Kafka offsets may be committed when tasks finish out of order.

A partition's committable offset is one past the last offset below which every
message has been settled (acked, rejected or dead-lettered).  Committing any
further could skip a task still running if the worker died now.
"""
from __future__ import annotations

import threading
from collections import deque
from celery_delayed import inert

logger = inert.logger(__name__)


class PartitionOffsets:
    """Outstanding offsets of one assigned partition, in the order they were read."""

    def __init__(self, before: PartitionOffsets | None = None) -> None:
        self._outstanding: deque[int] = deque()
        self._settled: set[int] = set()
        self._next: int | None = None  # offset to commit: first one not yet settled
        self._last: int | None = None  # the last offset read
        self._before = before  # what was read before Kafka moved the partition back here (see cut)

    def follows(self, offset: int) -> bool:
        """Whether ``offset`` comes after every offset read so far (Kafka's order within a partition)."""
        return self._last is None or offset > self._last

    def add(self, offset: int) -> None:
        if not self.follows(offset):
            raise ValueError(f"offset {offset} read after {self._last}")
        if not self._outstanding and self._next is None:
            self._next = offset
        self._outstanding.append(offset)
        self._last = offset

    def cut(self, offset: int) -> None:
        """Kafka moved the partition back to ``offset``: the records read from there on are gone from
        its log (their settles are ignored); those below it are still there, and hold the commit back
        until they settle (a truncation seeks to where the logs diverge, above a long-running task)."""
        while self._outstanding and self._outstanding[-1] >= offset:
            self._settled.discard(self._outstanding.pop())
        if self._last is not None:  # an earlier rewind may have cut it lower
            self._last = min(self._last, offset - 1)
        if self._before is not None:
            self._before.cut(offset)

    def settle(self, offset: int) -> None:
        if self._last is None or not self._outstanding or not self._outstanding[0] <= offset <= self._last:
            return  # nothing read, or cut off by a rewind
        self._settled.add(offset)
        while self._outstanding and self._outstanding[0] in self._settled:
            done = self._outstanding.popleft()
            self._settled.discard(done)
            self._next = done + 1

    @property
    def committable(self) -> int | None:
        """Offset to commit (Kafka's convention: the next one to read), or None if nothing read."""
        earlier = self._earlier()
        if earlier is not None:
            return earlier.committable
        if self._outstanding:
            return self._outstanding[0]
        return self._next

    def __len__(self) -> int:
        """Records read and not yet committable: unsettled ones, and settled ones behind them."""
        earlier = self._earlier()
        return len(self._outstanding) + (len(earlier) if earlier is not None else 0)

    @property
    def unsettled(self) -> int:
        """Records read and not settled yet (what a worker holds)."""
        earlier = self._earlier()
        return len(self._outstanding) - len(self._settled) + (earlier.unsettled if earlier is not None else 0)

    def _earlier(self) -> PartitionOffsets | None:
        """The records read before Kafka moved the partition back, while any is not committable."""
        if self._before is not None and not len(self._before):
            self._before = None
        return self._before


class OffsetTracker:
    """Thread-safe offsets of every assigned partition, keyed by ``(topic, partition)``.

    Each assignment gets fresh :class:`PartitionOffsets`; a settle that arrives
    for an assignment since revoked is ignored (that message is redelivered).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], PartitionOffsets] = {}

    def assign(self, keys: list[tuple[str, int]]) -> None:
        with self._lock:
            for key in keys:
                self._partitions[key] = PartitionOffsets()

    def assigned(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._partitions)

    def revoke(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Forget partitions; returns their committable offsets."""
        with self._lock:
            gone = {key: self._partitions.pop(key) for key in keys if key in self._partitions}
        return {key: p.committable for key, p in gone.items() if p.committable is not None}

    def add(self, key: tuple[str, int], offset: int) -> PartitionOffsets | None:
        """Track a record read; None when its partition is not assigned (any more): drop it.

        A record at or before one already read means Kafka moved the partition back (its log
        was truncated after a leader change, or the topic was recreated): the partition is
        tracked afresh from it, so every record from there on is tracked and committed in
        order; of those read before, the ones from that offset on are gone from the log (their
        settles are ignored) and the ones below it still hold the commit back until they settle.
        """
        with self._lock:
            partition = self._partitions.get(key)
            if partition is None:
                return None
            if not partition.follows(offset):
                logger.warning("Kafka partition %s[%d] went back to offset %d: tracked afresh from there",
                               *key, offset)
                partition.cut(offset)
                partition = self._partitions[key] = PartitionOffsets(before=partition)
            partition.add(offset)
            return partition

    def settle(self, partition: PartitionOffsets, offset: int) -> None:
        with self._lock:
            partition.settle(offset)

    def committable(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return {key: p.committable for key, p in self._partitions.items() if p.committable is not None}

    def unsettled(self) -> int:
        """Records read and not settled yet, over every partition."""
        with self._lock:
            return sum(p.unsettled for p in self._partitions.values())

    def backlogs(self) -> dict[tuple[str, int], int]:
        """Per partition, the records read and not committable yet (settled ones behind an unsettled head too)."""
        with self._lock:
            return {key: len(p) for key, p in self._partitions.items()}
