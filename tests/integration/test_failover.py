"""The store on the Redis Cluster with replicas: a primary killed (``kill -9``) and its replica promoted.

A poller and a worker run as real processes while tasks are scheduled before,
during and after the failover; the cluster client must ride out the window
(connection refused, ``CLUSTERDOWN``, ``MOVED``) without a crash or a dead
letter, and every task acknowledged to its caller must run, its side effect
once.  Schedule writes wait for a replica (``delayed_schedule_wait``), so an
acknowledged task is on two nodes and no failover loses it.
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from celery_delayed import StoreUnavailable, store_of
from celery_delayed.dlq import DeadLetters
from celery_delayed.store import partition_of
from tasks import create_app
from tasks.chaos import ledger
from tests.chaos.faults import redis_failover

from .support import wait_for

pytestmark = pytest.mark.parametrize("store_redis", ["cluster"], indirect=True)


def schedule(app, path: str, task_id: str, kind: str, countdown: float) -> None:
    """apply_async until the store acknowledges it (scheduling again is safe: one copy is kept)."""
    due_ms = int((time.time() + countdown) * 1000)
    while True:
        try:
            app.tasks["tasks.chaos.step"].apply_async(
                (path, kind, due_ms), task_id=task_id, eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
            return
        except StoreUnavailable:  # the failover window, or no replica acknowledged it in time
            time.sleep(0.2)


@pytest.mark.timeout(300)
def test_tasks_scheduled_across_a_primary_kill_and_promotion_all_run_once(overrides, processes, servers, tmp_path):
    servers.require_ours("redis-cluster-1")
    overrides.update(delayed_partitions=8, delayed_schedule_wait="replicas=1,timeout=1")
    app = create_app(**overrides)
    path = str(tmp_path / "ledger.db")
    ledger(path)
    poller = processes.poller()
    worker = processes.worker("w1", "-c", "2")
    kinds: dict[str, str] = {}
    acked_at: list[float] = []
    stop = threading.Event()

    def load() -> None:  # 20 tasks a second, due 2-6 s later, a third of them retrying once
        i = 0
        while not stop.is_set():
            task_id = str(uuid.uuid4())
            kinds[task_id] = "retry" if i % 3 == 0 else "effect"
            schedule(app, path, task_id, kinds[task_id], 2 + (i % 5))
            acked_at.append(time.monotonic())
            i += 1
            time.sleep(0.05)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(6)  # tasks running, some due during the failover, some retries written just before it
    killed = time.monotonic()
    note = redis_failover(SimpleNamespace(settings=app.amqp.delayed_settings, services_dir=servers.run_dir.parent))
    back = time.monotonic()
    print(f"\n{note}")
    time.sleep(4)
    stop.set()
    loader.join(timeout=120)
    acknowledged = dict(kinds)
    final = {task_id: 1 if kind == "retry" else 0 for task_id, kind in acknowledged.items()}
    db = ledger(path)

    def finished() -> set[str]:
        ran = {(t, a) for t, a in db.execute("SELECT task_id, attempt FROM runs")}
        return {t for t, a in final.items() if (t, a) in ran}

    wait_for(lambda: len(finished()) == len(final), timeout=180,
             what=f"all {len(final)} acknowledged tasks to run their final attempt")
    effects = dict(db.execute("SELECT task_id, COUNT(*) FROM effects GROUP BY task_id").fetchall())
    runs = dict(db.execute("SELECT task_id, COUNT(*) FROM runs WHERE attempt = 0 GROUP BY task_id").fetchall())
    twice = {t: n for t, n in runs.items() if n > 1}
    print(f"{len(final)} tasks acknowledged ({sum(k == 'retry' for k in acknowledged.values())} retrying once), "
          f"all ran; {len(twice)} first attempts ran twice (allowed: a claim or ack the failover undid), "
          f"side effects {sum(effects.values())} for {sum(k == 'effect' for k in acknowledged.values())} tasks; "
          f"{sum(killed < t < back for t in acked_at)} acknowledged during the failover")
    # scheduled before the kill and after the promotion (during it, once a replica had it)
    assert sum(t < killed for t in acked_at) > 20 and sum(t > back for t in acked_at) > 20, \
        (killed, back, len(acked_at))
    assert all(effects.get(t) == 1 for t, k in acknowledged.items() if k == "effect"), \
        {t: effects.get(t) for t, k in acknowledged.items() if k == "effect" and effects.get(t) != 1}
    assert DeadLetters(store_of(app)).count() == 0
    assert poller.poll() is None and worker.poll() is None, "a poller or worker did not survive the failover"


@pytest.mark.timeout(240)
def test_the_retry_of_a_task_the_broker_delivered_is_stored_across_a_primary_failover(overrides, processes,
                                                                                       servers, tmp_path):
    """Tasks sent without a countdown go through Celery's broker (the standalone Redis, up all
    along); their retry, 3 s later, goes to the store, on a cluster whose primary was just killed.
    Until its replica is promoted (seconds) the writes of its partitions are refused: the retry of
    a running task is retried until stored, whoever delivered the task; given up after Celery's
    publish retry policy (~1 s) the task would fail for good, never having run its retry."""
    servers.require_ours("redis-cluster-1")
    app = create_app(**overrides)
    path = str(tmp_path / "ledger.db")
    ledger(path)
    processes.poller()
    worker = processes.worker("w1", "-c", "4")
    partitions = app.amqp.delayed_settings.partitions
    ids: list[str] = []
    while len(ids) < 2 * partitions:  # two tasks in each partition: some are on the killed primary
        task_id = str(uuid.uuid4())
        if sum(partition_of(t, partitions) == partition_of(task_id, partitions) for t in ids) < 2:
            ids.append(task_id)
    failover = threading.Thread(target=redis_failover, args=(
        SimpleNamespace(settings=app.amqp.delayed_settings, services_dir=servers.run_dir.parent),), daemon=True)
    failover.start()
    time.sleep(1)  # the primary is dead; its replica is promoted seconds later
    for task_id in ids:
        app.tasks["tasks.chaos.step"].apply_async((path, "retry", int(time.time() * 1000)), task_id=task_id)
    failover.join(timeout=120)
    db = ledger(path)
    wait_for(lambda: db.execute("SELECT COUNT(DISTINCT task_id) FROM runs WHERE attempt = 1").fetchone()[0]
             == len(ids), timeout=120, what=f"the retries of all {len(ids)} tasks to run")
    refused = processes.log(worker).count("store write failed")
    print(f"\n{len(ids)} broker-delivered tasks retried through the store across the failover; "
          f"{refused} retry writes refused and tried again")
    assert refused > 0, "no retry was written while the primary was down: the test did not test the window"
    assert {app.AsyncResult(t).get(timeout=30, propagate=False) for t in ids} == {"retry"}
    assert DeadLetters(store_of(app)).count() == 0
