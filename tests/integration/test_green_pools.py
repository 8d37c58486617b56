"""Green worker pools (issue 42): ``celery worker -P gevent`` and ``-P eventlet`` run Celery's
blocking consumer loop, without the event loop the Kafka feed hands records to in the other pools;
their feed is a greenlet of the worker's hub that must never block it.  Each pool: tasks run once,
many at once, retried through the store, parked when they fail for good; a warm stop loses nothing
and runs nothing twice; a killed worker's tasks run again on another."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis

from celery_delayed import store_of
from celery_delayed.store.dlq import DeadLetters
from tasks import create_app

from .support import own_redis, wait_for
from .test_worker import due_in

POOLS = ["gevent", "eventlet"]



def one_partition(overrides, processes, *worker_args: str, **settings):
    """A poller and worker ``w1`` (``worker_args``) of a topic of one partition, with ``settings``: the app,
    a run id, the store's Redis and the worker."""
    overrides.update(delayed_topic_partitions=1, **settings)
    app = create_app(**overrides)
    processes.poller()
    return app, uuid.uuid4().hex, redis.Redis.from_url(app.conf.delayed_redis_url), processes.worker("w1", *worker_args)


@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_runs_delayed_tasks_at_once_retries_them_and_parks_failures(overrides, processes, pool):
    """``-c 200``, 200 tasks of three seconds each due at once: they run concurrently (a pool fed one
    task at a time would run them in turn, 600 s); one retries once
    through the store; one fails for good and is parked in the dead-letter queue."""
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    when = datetime.now(timezone.utc) + timedelta(seconds=4)  # one due time: sent in turn, they would not overlap
    many = [app.tasks["tasks.demo.overlap"].apply_async((run, 3.0), eta=when) for _ in range(200)]
    retried = due_in(app, "tasks.demo.flaky", (run, 1, 1.0))  # fails once, retries 1 s later
    failed = due_in(app, "tasks.demo.flaky", (run, 9, 0.2))  # max_retries=5: fails for good
    processes.poller()
    processes.worker("w1", "--pool", pool, "-c", "200")
    for x in many:
        x.get(timeout=90)
    most = int(r.zscore(f"demo:{run}:overlap", "most") or 0)
    print(f"\n{pool}: at most {most} of 200 three-second tasks ran at once")
    assert most >= 150, f"only {most} of 200 ran at once"
    assert retried.get(timeout=60) == 2
    letter = wait_for(lambda: DeadLetters(store_of(app)).get(failed.id), 90, "the failed task in the dead-letter queue")
    assert "attempt 6 failed" in letter.reason
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    assert all(runs[x.id] == 1 for x in many), "a task ran twice"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", [*POOLS, "threads"])
def test_a_green_worker_stopped_warm_or_killed_loses_nothing_and_runs_nothing_twice(overrides, processes, pool):
    """(And on the threads pool, whose tasks are not in child processes either.)  A warm stop while
    tasks run: they finish, and the next worker commits their records without
    running them again; then a kill -9 while tasks run: another worker runs them again once their
    run claims lapse (``delayed_run_lease``)."""
    app, run, r, first = one_partition(overrides, processes, "--pool", pool, "-c", "10")
    warm = [due_in(app, "tasks.demo.work", (run, 3.0)) for _ in range(5)]
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 5, 60, "the tasks to start")
    assert processes.warm_stop(first) == 0
    assert {x.get(timeout=10) for x in warm} == {x.id for x in warm}  # finished in the warm shutdown

    second = processes.worker("w2", "--pool", pool, "-c", "10")
    killed = [due_in(app, "tasks.demo.work", (run, 6.0)) for _ in range(5)]
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 10, 60, "the next tasks to start on the second worker")
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    processes.worker("w3", "--pool", pool, "-c", "10")
    assert {x.get(timeout=120) for x in killed} == {x.id for x in killed}
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    assert [runs[x.id] for x in warm] == [1] * 5, "a task finished in a warm stop ran again"
    assert [runs[x.id] for x in killed] == [2] * 5, "a killed worker's task did not run again, once"
    assert {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in killed} == {"w3"}


@pytest.mark.timeout(240)
def test_a_solo_worker_stopped_warm_or_killed_loses_nothing_and_runs_nothing_twice(overrides, processes):
    """The solo pool runs one task at a time, in the worker's own process.  A warm stop while one runs:
    it finishes there, once, and the two the worker held, never started, run on the next worker at once,
    not a run lease (30 s here) later; then a kill -9 while one runs: the next worker runs it again once
    its run claim lapses."""
    lease = 30
    app, run, r, first = one_partition(overrides, processes, "--pool", "solo", delayed_run_lease=lease)
    warm = [due_in(app, "tasks.demo.work", (run, 2.0)) for _ in range(3)]
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 1, 60, "the first task to start")
    stopped = time.monotonic()
    assert processes.warm_stop(first) == 0
    second = processes.worker("w2", "--pool", "solo")
    assert {x.get(timeout=90) for x in warm} == {x.id for x in warm}
    took = time.monotonic() - stopped
    print(f"\nsolo: the held tasks ran {took:.1f} s after the warm stop began")
    assert took < lease - 1, "the held tasks waited for their run claims to lapse"
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    assert [runs[x.id] for x in warm] == [1] * 3, "a task ran twice"

    killed = due_in(app, "tasks.demo.work", (run, 5.0))
    wait_for(lambda: r.hget(f"demo:{run}:runs", killed.id), 60, "the next task to start on the second worker")
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    processes.worker("w3", "--pool", "solo")
    assert killed.get(timeout=120) == killed.id
    assert int(r.hget(f"demo:{run}:runs", killed.id)) == 2, "a killed worker's task did not run again, once"



@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_stopped_cold_runs_its_killed_task_again(overrides, processes, pool):
    """A cold shutdown (SIGQUIT) while a task runs and three wait (``-c 1``): Celery cancels the running
    task by killing its greenlet, which its green pools report as a success (``(False, None, None)``),
    so the task was acknowledged, its record settled and committed, and it never ran again: lost
    (review 51).  It runs again on the next worker, as a killed prefork child's task does; the three
    that waited run once (a copy the dying worker took meanwhile may wait out its run lease).  A green
    worker notices the stop only at its next wait for the broker (seconds, under load): a waiting task it
    started meanwhile is killed too, and runs again as well; one it finished there runs once."""
    app, run, r, first = one_partition(overrides, processes, "--pool", pool, "-c", "1", delayed_run_lease=15)
    tasks = [due_in(app, "tasks.demo.work", (run, 3.0)) for _ in range(4)]
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 1, 60, "the first task to start")
    killed = r.hkeys(f"demo:{run}:runs")[0].decode()
    time.sleep(0.5)
    first.send_signal(signal.SIGQUIT)  # cold shutdown
    first.wait(timeout=60)
    processes.worker("w2", "--pool", pool, "-c", "1")
    assert {x.get(timeout=60) for x in tasks} == {x.id for x in tasks}
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    finished_first = {x.id for x in tasks if f"[{x.id}] succeeded" in processes.log(first)}
    assert runs[killed] == 2 and killed not in finished_first, runs
    assert all(runs[x.id] == 1 for x in tasks if x.id in finished_first), (runs, finished_first)
    assert all(runs[x.id] in (1, 2) for x in tasks), runs



@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_that_cancels_its_tasks_on_a_lost_broker_connection_runs_them_again(
        overrides, processes, pool, tmp_path):
    """``worker_cancel_long_running_tasks_on_connection_loss``: Celery kills a running task's greenlet when
    its broker connection is lost (cut here, on a broker of the test's own), as at a cold shutdown; the
    task was acknowledged as a success and never ran again (review 51).  It runs again."""
    with own_redis(tmp_path / "broker") as broker:
        app, run, r, _ = one_partition(
            overrides, processes, "--pool", pool, "-c", "1", delayed_run_lease=15,
            broker_url=f"redis://127.0.0.1:{broker.connection_pool.connection_kwargs['port']}/1",
            worker_cancel_long_running_tasks_on_connection_loss=True)
        tasks = [due_in(app, "tasks.demo.work", (run, 3.0)) for _ in range(2)]
        wait_for(lambda: r.hlen(f"demo:{run}:runs") == 1, 60, "the first task to start")
        cancelled = r.hkeys(f"demo:{run}:runs")[0].decode()
        broker.client_kill_filter(_type="normal")
        assert {x.get(timeout=60) for x in tasks} == {x.id for x in tasks}
        runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
        assert runs.pop(cancelled) == 2 and list(runs.values()) == [1], runs

@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_that_creates_its_queues_topic_starts(overrides, processes, pool):
    """A worker started before any poller creates its queue's topic itself, waiting on the Kafka admin
    client's futures, which librdkafka completes from a thread of its own: an eventlet worker waiting
    with ``future.result()`` was never woken, and hung at start (it passed whenever a poller had made
    the topic first)."""
    app = create_app(**overrides)
    worker = processes.worker("w1", "--pool", pool, "-c", "10")
    wait_for(lambda: "consuming Kafka topics" in processes.log(worker), 60, "the worker to create its topic and start")
    processes.poller()
    assert due_in(app, "tasks.demo.add", (2, 3)).get(timeout=60) == 5


@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_reads_every_task_sent_ahead_while_it_holds_them(overrides, processes, pool):
    """A green worker holds a task sent ahead of its due time (``delayed_dispatch_lead``), whoever holds
    it (Celery's ETA timer; the feed itself in stop 49), with the prefetch limit raised for each, or holding
    four (``-c 1`` x Celery's prefetch multiplier) would stop it reading the rest until they were due:
    20 tasks due at once are all read well ahead."""
    overrides.update(delayed_dispatch_lead=3.0)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    processes.worker("w1", "--pool", pool, "-c", "1")
    eta = datetime.now(timezone.utc) + timedelta(seconds=8)
    due_ms = int(eta.timestamp() * 1000)
    results = [app.tasks["tasks.demo.fire"].apply_async((run, due_ms), eta=eta) for _ in range(20)]
    for x in results:
        x.get(timeout=90)
    hops = [json.loads(h) for h in r.lrange(f"demo:{run}:hops", 0, -1)]
    ahead = sorted(h["due"] - h["read"] for h in hops)
    assert len(hops) == 20 and ahead[0] >= 1000, f"ms each task was read before its due time: {ahead}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_s_task_revoked_with_terminate_is_not_put_back(overrides, processes, pool):
    """``revoke(terminate=True)`` of a running broker task (``-c 1``, prefetch 1, another task queued):
    Celery kills its greenlet as at a cold shutdown, but on purpose; eventlet's kill runs the task's
    end at once, before Celery acknowledges the revoke, and a lost worker's end rejected it back to the
    broker, where only a worker that remembers the revoke drops it: the next one started ran it again.
    As a killed prefork child's revoked task, it is acknowledged and never runs again."""
    app, run, r, first = one_partition(overrides, processes, "--pool", pool, "-c", "1",
                                       worker_prefetch_multiplier=1)
    revoked = app.tasks["tasks.demo.work"].apply_async((run, 8.0))
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 1, 60, "the task to start")
    after = app.tasks["tasks.demo.work"].apply_async((run, 3.0))  # waits in the broker's queue (prefetch 1)
    time.sleep(0.5)
    revoked.revoke(terminate=True)
    wait_for(lambda: r.hget(f"demo:{run}:runs", after.id), 30, "the queued task to start")
    assert processes.warm_stop(first) == 0  # a worker started next does not know Celery's revoke
    processes.worker("w2", "--pool", pool, "-c", "1")
    assert after.get(timeout=30) == after.id
    time.sleep(5)  # time for w2 to take a copy put back
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    assert runs == {revoked.id: 1, after.id: 1}, "a task revoked with terminate ran again"
    assert revoked.state == "REVOKED"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", POOLS)
def test_a_green_worker_stopped_warm_while_tasks_fall_due_leaves_none_to_wait_out_a_run_lease(
        overrides, processes, pool):
    """Tasks fall due every 20 ms, read 0.5 s ahead, while a green worker is stopped warm and a standby
    takes its partition.  Celery's consumer drops the requests it holds when it closes, then stops its
    steps, last first, several waiting on the network; a green worker's feed (a greenlet of the same hub)
    handed records to Celery meanwhile, whose requests nothing dropped: the stop could not tell whether
    they would run, and they ran a run lease late (bench.fleet, gevent: 10 tasks of a rolling restart
    10 s late).  Each task runs once, none a run lease (30 s here) late."""
    lease = 30
    app, run, r, first = one_partition(overrides, processes, "--pool", pool, "-c", "50", delayed_run_lease=lease,
                                       delayed_dispatch_lead=0.5)
    second = processes.worker("w2", "--pool", pool, "-c", "50")
    wait_for(lambda: "ready." in processes.log(second), 60, "the standby worker")
    start_ms = int(time.time() * 1000) + 3_000
    fire = app.tasks["tasks.demo.fire"]
    results = [fire.apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
               for due_ms in range(start_ms, start_ms + 6_000, 20)]
    time.sleep(max(0.0, start_ms / 1000 + 2 - time.time()))
    assert processes.warm_stop(first) == 0
    for x in results:
        x.get(timeout=2 * lease)
    lag = [int(x) for x in r.lrange(f"demo:{run}:lag", 0, -1)]
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    print(f"\n{pool}: a warm stop among 300 tasks due 20 ms apart: lateness max {max(lag)} ms, "
          f"{sum(v > 1 for v in runs.values())} run twice")
    assert sorted(runs.values()) == [1] * len(results)
    assert max(lag) < lease * 1000 / 2, f"{sum(x > lease * 500 for x in lag)} tasks waited out their run lease"
