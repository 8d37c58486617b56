"""The comparison benchmark's Celery app (``celery -A bench.compare_app``): one task that records
when it started, its ETA tasks handled by the system ``COMPARE_SYSTEM`` names (see bench.compare).

Every system gets the demo project's servers and Celery settings (``config.celeryconfig``,
``task_acks_late`` included) without results or events, so what differs is only where an
ETA task waits until it is due.
"""
from __future__ import annotations

import os
import time

import redis
from celery import Celery

#: Where the task records its runs (the demo's Redis, db 0).
RECORDS = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}/0"
_records: redis.Redis | None = None


def create_app(system: str, **overrides: object) -> Celery:
    """The app as ``system`` (native, celery-delayed, longterm-scheduler) configures it, with ``overrides``."""
    options = {}
    if system == "longterm-scheduler":
        import celery_longterm_scheduler  # installed by bench.compare, from PyPI
        options["task_cls"] = celery_longterm_scheduler.Task
    app = Celery("compare", set_as_current=False, **options)
    app.config_from_object("config.celeryconfig")
    app.conf.update(result_backend=None, task_ignore_result=True, worker_send_task_events=False,
                    task_send_sent_event=False, **overrides)
    if system == "celery-delayed":
        import celery_delayed
        celery_delayed.install(app)
    app.task(name="compare.noop", bind=True)(noop)
    return app


def run_keys(run: str) -> list[str]:
    """The keys :func:`noop` writes for one run."""
    return [f"compare:{run}:{kind}" for kind in ("runs", "lag", "per_s", "host")]


def read_run(records: redis.Redis, run: str) -> tuple[dict[str, int], list[int], dict[int, int]]:
    """What :func:`noop` recorded for one run: runs per task id, the lags (ms, in no order), starts per second."""
    runs = {k.decode(): int(v) for k, v in records.hgetall(f"compare:{run}:runs").items()}
    lags = [int(v) for v in records.hvals(f"compare:{run}:lag")]
    per_s = {int(k): int(v) for k, v in records.hgetall(f"compare:{run}:per_s").items()}
    return runs, lags, per_s


def read_starts(records: redis.Redis, run: str) -> dict[str, tuple[int, str]]:
    """Per task id of one run: the lag (ms) of its first start and the worker (hostname) that started it."""
    lags = records.hgetall(f"compare:{run}:lag")
    hosts = records.hgetall(f"compare:{run}:host")
    return {k.decode(): (int(v), hosts.get(k, b"?").decode()) for k, v in lags.items()}


def noop(task, run: str, due_ms: int) -> None:
    """Count this execution of the task id; keep the lag (ms) of its first start behind its due time
    and the worker that started it, and count the starts of each second (epoch s)."""
    global _records
    started_ms = int(time.time() * 1000)
    _records = _records or redis.Redis.from_url(RECORDS)
    pipe = _records.pipeline(transaction=False)
    pipe.hincrby(f"compare:{run}:runs", task.request.id, 1)
    pipe.hsetnx(f"compare:{run}:lag", task.request.id, started_ms - due_ms)
    pipe.hincrby(f"compare:{run}:per_s", started_ms // 1000, 1)
    pipe.hsetnx(f"compare:{run}:host", task.request.id, task.request.hostname or "?")  # bench.fleet's
    pipe.execute()


app = create_app(os.environ.get("COMPARE_SYSTEM", "native"))
