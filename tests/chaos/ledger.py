"""The chaos run's SQLite ledger, read by the runner: the plan beside what the tasks recorded
(:mod:`tasks.chaos` writes ``runs``, ``effects`` and ``effect_attempts`` from the pool children)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from tasks.chaos import ledger

from .load import NOT_EXPECTED, Planned

PLAN_SCHEMA = """
CREATE TABLE IF NOT EXISTS plan (task_id TEXT PRIMARY KEY, kind TEXT NOT NULL, role TEXT NOT NULL,
                                 due_ms INTEGER NOT NULL, new_due_ms INTEGER, final INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS runs_by_task ON runs (task_id, attempt);
"""


def create(path: Path, tasks: list[Planned]) -> sqlite3.Connection:
    """A new ledger at ``path`` holding the plan (the tasks' tables are made by :func:`tasks.chaos.ledger`)."""
    db = ledger(str(path))
    db.executescript(PLAN_SCHEMA)
    add(db, tasks)
    return db


def add(db: sqlite3.Connection, tasks: list[Planned]) -> None:
    """Add ``tasks`` to the plan."""
    db.execute("BEGIN")
    db.executemany("INSERT INTO plan VALUES (?, ?, ?, ?, ?, ?)",
                   [(t.task_id, t.kind, t.role, t.due_ms, t.new_due_ms, t.final_attempt) for t in tasks])
    db.execute("COMMIT")


def done(db: sqlite3.Connection) -> int:
    """Tasks whose final attempt has run (revoked and unacknowledged ones never count)."""
    return db.execute(f"SELECT COUNT(*) FROM plan p WHERE p.role NOT IN ({', '.join('?' * len(NOT_EXPECTED))}) "
                      "AND EXISTS (SELECT 1 FROM runs r WHERE r.task_id = p.task_id AND r.attempt = p.final)",
                      NOT_EXPECTED).fetchone()[0]


def runs(db: sqlite3.Connection) -> list[tuple[str, int, int, int, int]]:
    """Every execution, ``(task_id, attempt, pid, start_ms, due_ms)``, in start order; ``due_ms`` is
    that attempt's: the first (or rescheduled) due time, or when the previous attempt's retry was due."""
    return db.execute(
        "SELECT r.task_id, r.attempt, r.pid, r.start_ms, CASE WHEN r.attempt = 0 THEN "
        "COALESCE(p.new_due_ms, p.due_ms, r.due_ms) ELSE (SELECT MAX(q.due_ms) FROM retries q WHERE "
        "q.task_id = r.task_id AND q.attempt = r.attempt - 1) END FROM runs r LEFT JOIN plan p USING (task_id) "
        "ORDER BY r.start_ms").fetchall()


def effects(db: sqlite3.Connection) -> tuple[dict[str, int], dict[str, int], int]:
    """Side-effect rows per task id, attempts to write one per task id, attempts the key absorbed."""
    rows = dict(db.execute("SELECT task_id, COUNT(*) FROM effects GROUP BY task_id").fetchall())
    attempts = dict(db.execute("SELECT task_id, COUNT(*) FROM effect_attempts GROUP BY task_id").fetchall())
    absorbed = db.execute("SELECT COUNT(*) FROM effect_attempts WHERE written = 0").fetchone()[0]
    return rows, attempts, absorbed
