"""The chaos run's load: a seeded plan of ledger tasks, stored in bulk as real Celery messages,
then some of them revoked or rescheduled while still scheduled."""
from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterator

from celery import Celery

from celery_delayed import store_of
from celery_delayed.envelope import Envelope, serialize

TASK = "tasks.chaos.step"
#: Shares of the load by kind (the rest are plain tasks); revoked and rescheduled tasks are plain ones.
SHARES = {"retry": 0.10, "effect": 0.30, "fail": 0.01, "revoke": 0.05, "reschedule": 0.05}
#: Tasks revoked or rescheduled are picked among those due this long (s) into the window or later,
#: so they are surely still scheduled when the preparation ends.
SPARE_S = 10.0
REVOKE_CHUNK = 500
#: Tasks a second sent one by one with ``apply_async`` while the faults run, beside the bulk load.
LIVE_RATE = 5
#: Shares of the live tasks by kind (the rest are plain), and their countdowns (s).
LIVE_SHARES = {"retry": 0.3, "effect": 0.3}
LIVE_COUNTDOWN_S = (2.0, 6.0)
#: A live task the store refuses this long (s) is given up: it may or may not run (role ``unacked``).
LIVE_GIVE_UP_S = 120.0
#: Roles of tasks whose final attempt need not run.
NOT_EXPECTED = ("revoke", "unacked")


@dataclass
class Planned:
    """One task of the load: what it does and when it is due."""

    task_id: str
    kind: str        # argument of the task: plain, effect, retry, fail
    role: str        # "", revoke, reschedule; live (sent by apply_async), unacked (a live one never acknowledged)
    due_ms: int
    new_due_ms: int | None = None

    @property
    def expected(self) -> bool:
        """Whether its final attempt must run: not revoked, and acknowledged to its sender."""
        return self.role not in NOT_EXPECTED

    @property
    def final_attempt(self) -> int:
        """``request.retries`` of the attempt that ends the task."""
        return 1 if self.kind == "retry" else 0


def plan(rng: random.Random, n: int, start_ms: int, window_s: float) -> list[Planned]:
    """``n`` tasks due evenly over ``window_s`` from ``start_ms``, kinds drawn by :data:`SHARES`.

    The task ids are fresh ones whatever the seed: a worker acknowledges without running a task id
    that already has a final result, as one from an earlier run with the same seed would."""
    tasks = []
    end_ms = start_ms + int(window_s * 1000)
    for i in range(n):
        due_ms = start_ms + int(i * window_s * 1000 / n)
        kind, role = _draw(rng, due_ms - start_ms >= SPARE_S * 1000)
        task = Planned(str(uuid.uuid4()), kind, role, due_ms)  # never seeded: ids of an earlier run have results
        if role == "reschedule":
            task.new_due_ms = min(end_ms, due_ms + rng.randint(5_000, 30_000))
        tasks.append(task)
    return tasks


def _draw(rng: random.Random, late_enough: bool) -> tuple[str, str]:
    """A (kind, role) by :data:`SHARES`; revokes and reschedules only for tasks due late enough."""
    name = _pick(rng, SHARES)
    if name in ("revoke", "reschedule"):
        return ("plain", name) if late_enough else ("plain", "")
    return name, ""


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    """A name drawn by ``shares`` (fractions of 1); ``plain`` for the rest."""
    u = rng.random()
    for name, share in shares.items():
        if u < share:
            return name
        u -= share
    return "plain"


def stored_items(app: Celery, tasks: list[Planned], ledger_path: str) -> Iterator[tuple[str, int, bytes]]:
    """``(task_id, due_ms, stored bytes)`` of each task, built as ``apply_async(eta=...)`` would build it."""
    queue = app.conf.task_default_queue
    serializer = app.tasks[TASK].serializer
    for task in tasks:
        eta = datetime.fromtimestamp(task.due_ms / 1000, timezone.utc)
        headers, properties, body, _ = app.amqp.create_task_message(
            task.task_id, TASK, [ledger_path, task.kind, task.due_ms], {}, eta=eta)
        data, content_type, content_encoding = serialize(body, serializer, None, headers)
        envelope = Envelope(task_id=task.task_id, queue=queue, headers=headers, body=data,
                            content_type=content_type, content_encoding=content_encoding,
                            properties={k: v for k, v in properties.items() if v not in (None, "")})
        yield task.task_id, task.due_ms, app.amqp.stored_form(envelope)


def schedule(app: Celery, tasks: list[Planned], ledger_path: str, progress: Callable[[int], None]) -> int:
    """Store the whole load in bulk; returns how many tasks were stored."""
    return store_of(app).schedule_many(stored_items(app, tasks, ledger_path), progress=progress)


def revoke_and_reschedule(app: Celery, tasks: list[Planned]) -> dict[str, int]:
    """Revoke (``app.control.revoke``) and reschedule (``store.reschedule``) the tasks given those roles."""
    revoked = [t.task_id for t in tasks if t.role == "revoke"]
    for i in range(0, len(revoked), REVOKE_CHUNK):
        app.control.revoke(revoked[i:i + REVOKE_CHUNK])
    moves = [(t.task_id, t.new_due_ms) for t in tasks if t.role == "reschedule"]
    changes = store_of(app).reschedule_many(moves)  # one pipeline: done before the first of them is due
    for task_id, change in changes.items():
        change.check(task_id, "rescheduled")
    return {"revoked": len(revoked), "rescheduled": len(changes)}


class LiveSender:
    """Sends tasks one by one, as a user's client does, while the faults run: ``apply_async`` with an
    ETA, tried again while it raises (the store down or failing over, the broker down); one whose due
    time passed meanwhile goes through Celery's broker, and its retry through the store."""

    def __init__(self, app: Celery, ledger_path: str, rng: random.Random) -> None:
        self.app, self.path, self.rng = app, ledger_path, rng
        self.sent: list[Planned] = []
        self.refused = 0      # apply_async calls that raised
        self.by_broker = 0    # acknowledged too late for the store: Celery's broker took them

    def run(self, until: float, stop: threading.Event, record: Callable[[Planned], None]) -> None:
        """Send :data:`LIVE_RATE` tasks a second until ``until`` (epoch s) or ``stop``; ``record`` each
        once its sender knows whether it was acknowledged."""
        while time.time() < until and not stop.is_set():
            task = self._send(stop)
            self.sent.append(task)
            record(task)
            stop.wait(1 / LIVE_RATE)

    def _send(self, stop: threading.Event) -> Planned:
        kind = _pick(self.rng, LIVE_SHARES)
        due_ms = int((time.time() + self.rng.uniform(*LIVE_COUNTDOWN_S)) * 1000)
        task = Planned(str(uuid.uuid4()), kind, "live", due_ms)
        eta = datetime.fromtimestamp(due_ms / 1000, timezone.utc)
        give_up = time.monotonic() + LIVE_GIVE_UP_S
        min_delay_ms = self.app.amqp.delayed_settings.min_delay * 1000
        while True:
            late = time.time() * 1000 > due_ms - min_delay_ms
            try:  # sending again is safe: the store keeps one copy of a task id
                self.app.tasks[TASK].apply_async((self.path, kind, due_ms), task_id=task.task_id, eta=eta)
                self.by_broker += late
                return task
            except Exception:  # whatever a client sees while a server is down
                self.refused += 1
                if time.monotonic() > give_up or stop.is_set():
                    task.role = "unacked"
                    return task
                stop.wait(0.2)
