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
from celery_delayed.store.dlq import DeadLetters
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
def test_what_running_tasks_write_to_the_store_across_a_primary_failover_is_kept(overrides, processes,
                                                                                  servers, tmp_path):
    """Tasks sent without a countdown go through Celery's broker (the standalone Redis, up all
    along) just after the primary holding the dead-letter queue and some partitions was killed.
    Until its replica is promoted (seconds) its writes are refused.  Given up after Celery's publish
    retry policy (~1 s), each would lose a task: a retry (of a task the broker delivered: its retry
    goes to the store) that never runs, a task failing for good that is never parked.  Both are
    tried until the store takes them."""
    servers.require_ours("redis-cluster-1")
    overrides.update(delayed_partitions=16)  # every primary holds some
    app = create_app(**overrides)
    path = str(tmp_path / "ledger.db")
    ledger(path)
    processes.poller()
    worker = processes.worker("w1", "-c", "12")  # every task at once: a write tried until stored holds its child
    store = store_of(app)
    dlq_key = DeadLetters(store).keys[0]
    doomed = store.redis.get_node_from_key(dlq_key).port
    ids: list[str] = []
    while len(ids) < 8:  # tasks whose retry goes to a partition of the killed primary
        task_id = str(uuid.uuid4())
        if store.redis.get_node_from_key(store.keys.msgs(store.partition(task_id))).port == doomed:
            ids.append(task_id)
    failing = [str(uuid.uuid4()) for _ in range(4)]
    failover = threading.Thread(target=redis_failover, args=(
        SimpleNamespace(settings=app.amqp.delayed_settings, services_dir=servers.run_dir.parent), dlq_key),
        daemon=True)
    failover.start()
    time.sleep(1)  # the primary is dead; its replica is promoted seconds later
    for kind, task_ids in (("fail", failing), ("retry", ids)):
        for task_id in task_ids:
            app.tasks["tasks.chaos.step"].apply_async((path, kind, int(time.time() * 1000)), task_id=task_id)
    failover.join(timeout=120)
    db = ledger(path)
    wait_for(lambda: db.execute("SELECT COUNT(DISTINCT task_id) FROM runs WHERE attempt = 1").fetchone()[0]
             == len(ids), timeout=120, what=f"the retries of all {len(ids)} tasks to run")
    dead_letters = DeadLetters(store)
    wait_for(lambda: all(dead_letters.holds(t) for t in failing), timeout=60,
             what=f"the {len(failing)} tasks that failed for good to be parked")
    log = processes.log(worker)
    refused = log.count("store write failed"), log.count("dead-letter queue cannot be written")
    print(f"\n{len(ids)} broker-delivered tasks retried through the store, {len(failing)} parked, across "
          f"the failover; refused and tried again: {refused[0]} retry writes, {refused[1]} dead letters")
    assert all(refused), "nothing was written while the primary was down: the test did not test the window"
    assert {app.AsyncResult(t).get(timeout=30, propagate=False) for t in ids} == {"retry"}
    assert dead_letters.count() == len(failing)
