"""The chaos run's load: a seeded plan of ledger tasks, stored in bulk as real Celery messages,
then some of them revoked or rescheduled while still scheduled."""
from __future__ import annotations

import random
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


@dataclass
class Planned:
    """One task of the load: what it does and when it is due."""

    task_id: str
    kind: str        # argument of the task: plain, effect, retry, fail
    role: str        # "", revoke or reschedule
    due_ms: int
    new_due_ms: int | None = None

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
    u = rng.random()
    for name, share in SHARES.items():
        if u < share:
            if name in ("revoke", "reschedule"):
                return ("plain", name) if late_enough else ("plain", "")
            return name, ""
        u -= share
    return "plain", ""


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
    store = store_of(app)
    moved = [store.reschedule(t.task_id, t.new_due_ms) for t in tasks if t.role == "reschedule"]
    return {"revoked": len(revoked), "rescheduled": len(moved)}
