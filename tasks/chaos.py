"""The chaos suite's ledger task (``python -m tests.chaos``): every execution is recorded in SQLite.

The ledger is a SQLite file in the run's results folder, not a server the
suite's faults stop or kill, so what it holds is what really ran: one row
per execution (task id, attempt, pid, start and due time), and the side
effects written through the task id as their idempotency key (``INSERT OR
IGNORE``), with every attempt to write one counted.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time

from celery import shared_task

#: Seconds before the retry of a ``retry`` task is due (through the delayed store).
RETRY_COUNTDOWN = 3.0
#: Seconds a side effect's task works after writing it: a kill then is a kill mid-task.
EFFECT_WORK_SECONDS = 0.005
#: The environment variable in which the chaos runner gives its wall clock minus the monotonic clock (s).
WALL_MINUS_MONOTONIC = "CD_CHAOS_WALL_MINUS_MONOTONIC"
_WALL_MINUS_MONOTONIC = float(os.environ.get(WALL_MINUS_MONOTONIC) or time.time() - time.monotonic())

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (task_id TEXT NOT NULL, attempt INTEGER NOT NULL, pid INTEGER NOT NULL,
                                 start_ms INTEGER NOT NULL, due_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS retries (task_id TEXT NOT NULL, attempt INTEGER NOT NULL, due_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS effects (task_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL, pid INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS effect_attempts (task_id TEXT NOT NULL, attempt INTEGER NOT NULL,
                                            written INTEGER NOT NULL);
"""

_connections: dict[tuple[int, int, str], sqlite3.Connection] = {}


class MeantToFail(RuntimeError):
    """The failure of a task the chaos suite expects in the dead-letter queue."""


def ledger(path: str) -> sqlite3.Connection:
    """This thread's connection to the ledger at ``path`` (WAL: writers in many processes at once)."""
    key = (os.getpid(), threading.get_ident(), path)
    if key not in _connections:
        db = sqlite3.connect(path, timeout=60, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=60000")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        _connections[key] = db
    return _connections[key]


def wall_ms() -> int:
    """Now in epoch ms by the runner's wall clock (the machine's monotonic clock plus the runner's offset),
    not this process's, which a chaos fault may have stepped (tests/chaos/clock.py)."""
    return int((time.monotonic() + _WALL_MINUS_MONOTONIC) * 1000)


@shared_task(name="tasks.chaos.step", bind=True, max_retries=1)
def step(self, path: str, kind: str, due_ms: int) -> str:
    """Record this execution; then, by ``kind``: ``effect`` writes a side effect keyed by the task id,
    ``retry`` retries once through the store (recording when its retry is due), ``fail`` fails for good
    (so it is dead-lettered).  ``due_ms`` is the task's first due time (a worker sees no ETA header)."""
    start_ms = wall_ms()
    attempt = self.request.retries or 0
    db = ledger(path)
    db.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
               (self.request.id, attempt, os.getpid(), start_ms, due_ms))
    if kind == "effect":
        written = db.execute("INSERT OR IGNORE INTO effects VALUES (?, ?, ?)",
                             (self.request.id, attempt, os.getpid())).rowcount
        db.execute("INSERT INTO effect_attempts VALUES (?, ?, ?)", (self.request.id, attempt, written))
        time.sleep(EFFECT_WORK_SECONDS)
    elif kind == "retry" and attempt == 0:
        db.execute("INSERT INTO retries VALUES (?, ?, ?)",
                   (self.request.id, attempt, wall_ms() + int(RETRY_COUNTDOWN * 1000)))
        raise self.retry(countdown=RETRY_COUNTDOWN, exc=RuntimeError("first attempt of a retry task"))
    elif kind == "fail":
        raise MeantToFail(f"task {self.request.id} is meant to fail")
    return kind
