"""The dead-letter queue: messages that cannot be dispatched or run, kept for operators.

Stored in Redis beside the store (``<prefix>:{dlq}:msg`` HASH and
``<prefix>:{dlq}:index`` ZSET by time, one hash tag so it works on a cluster),
so it survives restarts of every component.  A record is one JSON line
(reason, traceback, attempts, time, source) followed by the original bytes.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from .store import DelayedStore


@dataclass
class DeadLetter:
    """One parked message and why it was parked."""

    task_id: str
    reason: str
    source: str
    traceback: str = ""
    attempts: int = 0
    timestamp: float = 0.0
    message: bytes = b""

    def encode(self) -> bytes:
        meta = {k: v for k, v in asdict(self).items() if k != "message"}
        return json.dumps(meta, separators=(",", ":")).encode() + b"\n" + self.message

    @classmethod
    def decode(cls, data: bytes) -> "DeadLetter":
        end = data.index(b"\n")
        return cls(**json.loads(data[:end]), message=data[end + 1:])


class DeadLetters:
    """Add, list and read dead letters by task id."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        prefix = store.settings.key_prefix
        self.keys = [f"{prefix}:{{dlq}}:msg", f"{prefix}:{{dlq}}:index"]
        self._script = store.redis.register_script(store.lua_source("dead_letter"))

    def add(self, letter: DeadLetter) -> None:
        letter.timestamp = letter.timestamp or time.time()
        self._script(keys=self.keys, args=[letter.task_id, letter.encode()])

    def get(self, task_id: str) -> DeadLetter | None:
        data = self.store.redis.hget(self.keys[0], task_id)
        return DeadLetter.decode(data) if data is not None else None

    def list(self, limit: int = 100) -> list[DeadLetter]:
        """The most recent ``limit`` dead letters, newest first."""
        ids = self.store.redis.zrevrange(self.keys[1], 0, limit - 1)
        if not ids:
            return []
        return [DeadLetter.decode(d) for d in self.store.redis.hmget(self.keys[0], ids) if d is not None]

    def count(self) -> int:
        return self.store.redis.zcard(self.keys[1])
