"""Which Kafka offsets may be committed when tasks finish out of order.

A partition's committable offset is one past the last offset below which every
message has been settled (acked, rejected or dead-lettered).  Committing any
further could skip a task still running if the worker died now.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

logger = logging.getLogger(__name__)


class PartitionOffsets:
    """Outstanding offsets of one assigned partition, in the order they were read."""

    def __init__(self) -> None:
        self._outstanding: deque[int] = deque()
        self._settled: set[int] = set()
        self._next: int | None = None  # offset to commit: first one not yet settled
        self._last: int | None = None  # the last offset read

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

    def settle(self, offset: int) -> None:
        self._settled.add(offset)
        while self._outstanding and self._outstanding[0] in self._settled:
            done = self._outstanding.popleft()
            self._settled.discard(done)
            self._next = done + 1

    @property
    def committable(self) -> int | None:
        """Offset to commit (Kafka's convention: the next one to read), or None if nothing read."""
        if self._outstanding:
            return self._outstanding[0]
        return self._next

    def __len__(self) -> int:
        """Records read and not yet committable: unsettled ones, and settled ones behind them."""
        return len(self._outstanding)

    @property
    def unsettled(self) -> int:
        """Records read and not settled yet (what a worker holds)."""
        return len(self._outstanding) - len(self._settled)


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

    def revoke(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Forget partitions; returns their committable offsets."""
        with self._lock:
            gone = {key: self._partitions.pop(key) for key in keys if key in self._partitions}
        return {key: p.committable for key, p in gone.items() if p.committable is not None}

    def add(self, key: tuple[str, int], offset: int) -> PartitionOffsets | None:
        """Track a record read; None when its partition is not assigned (any more): drop it.

        A record at or before one already read means Kafka moved the partition back (its log
        was truncated after a leader change, or the topic was recreated): the partition is
        tracked afresh from it, as on a new assignment, so every record from there on is
        tracked and committed in order, and the settles of those read before are ignored.
        """
        with self._lock:
            partition = self._partitions.get(key)
            if partition is None:
                return None
            if not partition.follows(offset):
                logger.warning("Kafka partition %s[%d] went back to offset %d: tracked afresh from there",
                               *key, offset)
                partition = self._partitions[key] = PartitionOffsets()
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
