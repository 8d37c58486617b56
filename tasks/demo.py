"""Demo tasks: arithmetic, and a task that records when it ran for the demo's report."""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime, timedelta, timezone

import redis
from celery import current_app, shared_task

from celery_delayed import store_of
from celery_delayed.worker.once import FROM_KAFKA


def _redis() -> redis.Redis | redis.RedisCluster:
    """The delayed store's Redis client (standalone or cluster), where the demo records its runs."""
    return store_of(current_app).redis


@shared_task(name="tasks.demo.add")
def add(x: int, y: int) -> int:
    return x + y


@shared_task(name="tasks.demo.fire", bind=True)
def fire(self, run: str, due_ms: int, seconds: float = 0.0) -> int:
    """Record one execution of this task id and its lag behind the due time (ms); run from
    Kafka, also when each hop on its way happened (the worker's feed says: ``hops``).  With
    ``seconds``: then wait that long (I/O, say a web call) and record when it ended (``done``)."""
    started_ms = int(time.time() * 1000)
    pipe = _redis().pipeline(transaction=False)
    pipe.hincrby(f"demo:{run}:runs", self.request.id, 1)
    pipe.rpush(f"demo:{run}:lag", started_ms - due_ms)
    hops = getattr(self.request, FROM_KAFKA, None)
    if isinstance(hops, dict):
        pipe.rpush(f"demo:{run}:hops", json.dumps({"due": due_ms, **hops, "started": started_ms}))
    pipe.execute()
    if seconds:
        time.sleep(seconds)
        _redis().rpush(f"demo:{run}:done", int(time.time() * 1000))
    return started_ms - due_ms


@shared_task(name="tasks.demo.work", bind=True)
def work(self, run: str, seconds: float = 0.0) -> str:
    """Count this execution of the task id, then take ``seconds`` (a stand-in for real work)."""
    _redis().hincrby(f"demo:{run}:runs", self.request.id, 1)
    time.sleep(seconds)
    return self.request.id


@shared_task(name="tasks.demo.overlap", bind=True)
def overlap(self, run: str, seconds: float) -> int:
    """Like :func:`work`, and record the most executions of the run that were running at once
    (``demo:<run>:overlap``): how many a worker's pool really ran concurrently."""
    r = _redis()
    r.hincrby(f"demo:{run}:runs", self.request.id, 1)
    running = r.incr(f"demo:{run}:running")
    r.zadd(f"demo:{run}:overlap", {"most": running}, gt=True)
    time.sleep(seconds)
    r.decr(f"demo:{run}:running")
    return running


@shared_task(name="tasks.demo.eta_seen", bind=True)
def eta_seen(self) -> str | None:
    """The ETA the task sees in its request (Celery's ISO string), as task code reading it would."""
    eta = self.request.eta
    return eta.isoformat() if isinstance(eta, datetime) else eta


@shared_task(name="tasks.demo.crash_once", bind=True)
def crash_once(self, run: str) -> str:
    """Kill the process running it on its first execution (as the OOM killer would)."""
    if _redis().hincrby(f"demo:{run}:runs", self.request.id, 1) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


@shared_task(name="tasks.demo.flaky", bind=True, max_retries=5)
def flaky(self, run: str, failures: int, countdown: float = 2.0, seconds: float = 0.0) -> int:
    """Take ``seconds``, then fail ``failures`` times, retrying after ``countdown`` s each time
    (through the delayed store)."""
    attempt = _redis().hincrby(f"demo:{run}:runs", self.request.id, 1)
    time.sleep(seconds)
    if attempt <= failures:
        raise self.retry(countdown=countdown, exc=RuntimeError(f"attempt {attempt} failed"))
    return attempt


@shared_task(name="tasks.demo.flaky_eta", bind=True, max_retries=5)
def flaky_eta(self, run: str, failures: int, delay: float = 2.0) -> int:
    """Like :func:`flaky`, but each retry is given an ``eta`` rather than a countdown."""
    attempt = _redis().hincrby(f"demo:{run}:runs", self.request.id, 1)
    if attempt <= failures:
        raise self.retry(eta=datetime.now(timezone.utc) + timedelta(seconds=delay),
                         exc=RuntimeError(f"attempt {attempt} failed"))
    return attempt


@shared_task(name="tasks.demo.flaky_auto", bind=True, autoretry_for=(RuntimeError,), retry_backoff=2,
             retry_jitter=False, max_retries=5)
def flaky_auto(self, run: str, failures: int) -> int:
    """Fail ``failures`` times; Celery's ``autoretry_for`` retries with backoff (2 s, 4 s...) through the store."""
    attempt = _redis().hincrby(f"demo:{run}:runs", self.request.id, 1)
    if attempt <= failures:
        raise RuntimeError(f"attempt {attempt} failed")
    return attempt


@shared_task(name="tasks.demo.retry_then_replace", bind=True, max_retries=3)
def retry_then_replace(self, run: str) -> None:
    """Retry once through the store, then replace itself with ``work`` due 3 s later: the replacement
    keeps the task id and starts its retries over at 0."""
    if not self.request.retries:
        raise self.retry(countdown=2)
    raise self.replace(work.si(run).set(countdown=3))


@shared_task(name="tasks.demo.tick", bind=True)
def tick(self, run: str, label: str = "") -> None:
    """Record one execution of a recurring schedule's occurrence: per nominal time, how many times it ran
    (``demo:<run>:ticks``) and, once, the label, definition version, start time and Kafka hops of its run
    (``demo:<run>:tick``)."""
    nominal = self.request.delayed_nominal
    pipe = _redis().pipeline(transaction=False)
    pipe.hincrby(f"demo:{run}:ticks", nominal, 1)
    pipe.hsetnx(f"demo:{run}:tick", nominal, json.dumps({
        "label": label, "version": self.request.delayed_version, "id": self.request.id,
        "started": int(time.time() * 1000), "hops": getattr(self.request, FROM_KAFKA, None)}))
    pipe.execute()
