"""A worker fleet that changes under load: group protocols, warm stops that hand partitions over,
and the jobs Celery flushes out of its pool when a worker stops (real workers, Kafka, Redis)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from datetime import datetime, timezone

import pytest
import redis
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, NewTopic

from celery_delayed.kafka import consumer_config
from celery_delayed.settings import Settings
from celery_delayed.worker.consumer import LEAVE_TIMEOUT, KafkaFeed, incremental
from celery_delayed.worker.offsets import OffsetTracker
from celery_delayed.worker.once import DRAINED, FROM_KAFKA, HANDED_BACK
from tasks import create_app

from .conftest import SERVERS
from .support import wait_for
from .test_worker import committed, due_in


def runs(r: redis.Redis, run: str) -> dict[str, int]:
    """How often each task id of ``run`` ran (``tasks.demo.work`` counts them)."""
    return {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}


def pool_children(worker: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(worker.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def warm_stop_soon(processes, worker: subprocess.Popen) -> threading.Thread:
    """SIGTERM to the worker's main process (a warm shutdown), waited for in a thread."""
    stopping = threading.Thread(target=processes.warm_stop, args=(worker, 120), daemon=True)
    stopping.start()
    return stopping


def assigned(processes, worker: subprocess.Popen) -> bool:
    return "assigned Kafka partitions" in processes.log(worker)


def poller_and_worker(overrides: dict, processes, concurrency: int) -> tuple:
    """A poller and a worker ``w1`` (``-c concurrency``) that took the partitions of the test's queue.
    Returns the app, a run id, the store's Redis and the worker."""
    app = create_app(**overrides)
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    first = processes.worker("w1", "-c", str(concurrency))
    wait_for(lambda: assigned(processes, first), 60, "the first worker to take the partitions")
    return app, uuid.uuid4().hex, r, first


def one_reading_one_waiting(overrides: dict, processes) -> tuple:
    """A poller and two workers of one pool slot each on a topic of one partition: the first reads
    it, the second waits for it.  Returns the app, a run id, the store's Redis and both workers."""
    app, run, r, first = poller_and_worker(overrides, processes, 1)
    second = processes.worker("w2", "-c", "1")
    wait_for(lambda: "ready." in processes.log(second), 60, "the second worker")
    return app, run, r, first, second


@pytest.mark.parametrize("protocol", ["consumer", "classic"])
def test_workers_run_delayed_tasks_on_either_group_protocol(overrides, processes, protocol):
    """KIP-848's protocol made every worker exit at start (librdkafka refuses its session.timeout.ms);
    each protocol now runs every task once, on both workers, and the log says which one it uses."""
    overrides.update(delayed_group_protocol=protocol, delayed_kafka_config={"session.timeout.ms": 9000})
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    workers = [processes.worker(name, "-c", "2") for name in ("w1", "w2")]
    wait_for(lambda: all(assigned(processes, w) for w in workers), 60, "both workers to be assigned partitions")
    results = [due_in(app, "tasks.demo.work", (run,), seconds=2.0) for _ in range(40)]
    assert {x.get(timeout=90) for x in results} == {x.id for x in results}
    assert set(runs(r, run).values()) == {1}
    assert {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in results} == {"w1", "w2"}
    for worker in workers:
        assert f"group protocol {protocol}" in processes.log(worker)


def test_a_stopping_worker_hands_its_partitions_over_before_its_running_task_ends(overrides, processes):
    """F5: a worker in its warm shutdown stayed in the group, its partitions paused, until its running
    task ended (up to 60 s): tasks due on them meanwhile waited for it.  It now leaves the group at
    once: the other worker runs them on time, and the long task runs once."""
    overrides.update(delayed_topic_partitions=2, delayed_dispatch_lead=0)
    app, run, r, first = poller_and_worker(overrides, processes, 1)
    long = due_in(app, "tasks.demo.work", (run, 25.0), seconds=1.5)
    wait_for(lambda: long.id in runs(r, run), 60, "the long task to start")
    second = processes.worker("w2", "-c", "1")
    wait_for(lambda: assigned(processes, second), 60, "the second worker to take a partition")
    time.sleep(2)  # the group settles: one partition each
    stopping = warm_stop_soon(processes, first)
    stopped = time.time()
    later = [due_in(app, "tasks.demo.work", (run,), seconds=2.0) for _ in range(10)]  # on both partitions
    wait_for(lambda: all(x.id in runs(r, run) for x in later), 60, "the tasks due after the stop to run")
    took = time.time() - stopped
    print(f"\nwarm stop: tasks due 2 s after it all ran {took:.1f} s after it, the long task still running")
    assert took < 15, f"the tasks due 2 s after the stop waited {took:.1f} s for the stopping worker's task"
    assert {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in later} == {"w2"}
    stopping.join(120)
    assert long.get(timeout=60) == long.id
    assert app.backend.get_task_meta(long.id)["worker"].split("@")[0] == "w1"
    time.sleep(3)  # a copy of the long task the second worker read must not run it again
    assert set(runs(r, run).values()) == {1}


def test_a_request_waiting_for_a_pool_slot_at_a_warm_stop_runs_on_the_next_worker_at_once(overrides, processes):
    """A request waiting for the only pool slot (its child busy) when a warm stop begins never runs
    there: Celery drops it.  Its run claim is given up and the partition handed over at once, so the
    next worker runs it without waiting for the busy task to end, nor for the run lease (30 s here)."""
    overrides.update(delayed_topic_partitions=1, delayed_dispatch_lead=0, delayed_run_lease=30)
    app, run, r, first, second = one_reading_one_waiting(overrides, processes)
    busy = due_in(app, "tasks.demo.work", (run, 10.0), seconds=1.5)
    wait_for(lambda: busy.id in runs(r, run), 60, "the task keeping the only child busy to start")
    waiting = due_in(app, "tasks.demo.work", (run,), seconds=2.0)
    wait_for(lambda: f"[{waiting.id}] received" in processes.log(first), 30, "the first worker to receive it")
    time.sleep(0.5)
    stopping = warm_stop_soon(processes, first)
    stopped = time.time()
    wait_for(lambda: waiting.id in runs(r, run), 60, "the flushed task to run")
    took = time.time() - stopped
    print(f"\nwaiting for a pool slot at a warm stop: ran {took:.1f} s after the stop")
    assert app.backend.get_task_meta(waiting.id)["worker"].split("@")[0] == "w2"
    assert took < 8, f"the dropped task waited {took:.1f} s (the busy task ends 10 s after it started)"
    stopping.join(120)
    assert busy.get(timeout=60) == busy.id
    assert set(runs(r, run).values()) == {1}


def read_ahead_at_a_warm_stop(overrides: dict, processes) -> tuple:
    """A task ``tasks.demo.fire`` due in 5 s, read 3 s ahead (a partition, a poller, a worker ``w1`` of one
    pool slot), then ``w1``'s warm stop.  Returns the app, the run id, the store's Redis, ``w1``, the task's
    result and its due time (ms)."""
    overrides.update(delayed_topic_partitions=1, delayed_dispatch_lead=3.0, delayed_run_lease=3)
    app, run, r, first = poller_and_worker(overrides, processes, 1)
    due_ms = int(time.time() * 1000) + 5_000
    task = app.tasks["tasks.demo.fire"].apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
    wait_for(lambda: f"[{task.id}] received" in processes.log(first), 30, "the worker to receive it")
    processes.warm_stop(first)
    return app, run, r, first, task, due_ms


def test_a_task_read_ahead_of_its_due_time_at_a_warm_stop_is_handed_back_to_the_broker_and_runs_once(overrides,
                                                                                                      processes):
    """A task a worker read ahead of its due time (``delayed_dispatch_lead``) and holds when it stops never
    runs there: its claim was given up and its record left for the partition's next owner, which reads it
    once the group gave it the partition (a heartbeat or more after the stop: in a rolling restart by
    process-group SIGTERM, bench.fleet, such tasks were up to 1.3 s late).  The stopping worker now hands
    it back to Celery's broker, as Celery's own ETA path does: the copy there is the stored message, due
    when it is, marked drained (no Kafka marks); the next worker runs the task only once (from that copy,
    or from the Kafka copy should its Kafka reading come first: the other is then acknowledged unrun).  (The worker is alone when it stops, so the copy is
    still in the broker's queue when looked at; with others, one of them takes it at once.)"""
    app, run, r, first, task, due_ms = read_ahead_at_a_warm_stop(overrides, processes)
    broker = redis.Redis.from_url(app.conf.broker_url)
    handed = [json.loads(raw) for raw in broker.lrange(overrides["task_default_queue"], 0, -1)]
    assert [m["headers"]["id"] for m in handed] == [task.id], processes.log(first)[-2000:]
    headers = handed[0]["headers"]
    assert headers["eta"] == datetime.fromtimestamp(due_ms / 1000, timezone.utc).isoformat()
    assert DRAINED in headers and HANDED_BACK in headers and FROM_KAFKA not in headers
    second = processes.worker("w2", "-c", "1")
    wait_for(lambda: task.id in runs(r, run), 30, "the next worker to run it")
    time.sleep(8)  # its Kafka copy: read by the next worker (claimed: put back past the claim), then come round
    lag = [int(x) for x in r.lrange(f"demo:{run}:lag", 0, -1)]
    print(f"\nhanded back at a warm stop: runs {runs(r, run)}, started {lag} ms after due")
    assert app.backend.get_task_meta(task.id)["worker"].split("@")[0] == "w2"
    assert runs(r, run) == {task.id: 1}
    assert lag[0] >= 0


def test_with_no_done_record_a_task_read_ahead_at_a_warm_stop_is_not_handed_back_and_runs_once(overrides, processes):
    """With ``delayed_done_ttl = 0`` nothing tells a Kafka copy read again that its task ran from the broker
    when its result is ignored (nor that an attempt retried, whose RETRY state is not final): a task handed
    back at a warm stop ran twice, from the broker and then from Kafka, where it had run once.  Such a
    worker hands nothing back: the Kafka copy alone runs it, once."""
    overrides.update(delayed_done_ttl=0, task_ignore_result=True)
    app, run, r, first, task, _ = read_ahead_at_a_warm_stop(overrides, processes)
    processes.worker("w2", "-c", "1")
    wait_for(lambda: task.id in runs(r, run), 30, "the next worker to run it")
    time.sleep(8)  # a broker copy's Kafka copy: read by the next worker (claimed: put back past the claim), then come round
    assert runs(r, run) == {task.id: 1}


def test_a_job_flushed_from_the_pool_after_it_reached_a_child_runs_once_and_its_worker_exits(overrides, processes):
    """F1: a job written to a child's pipe but not yet accepted is dropped from the pool's cache by
    a warm stop's flush, yet the child runs it.  Its run claim was forgotten, lapsed after the run
    lease (4 s here), and the next worker ran the task a second time while the child still ran it.
    F2: nobody read that child's result, so it waited 30 s to exit, and its worker with it.  The job
    goes back in the pool's books now: its claim is held until Celery settles it, and the worker exits
    once it ends.  (The child is SIGSTOPped while the job is written to it, so the moment is certain.)"""
    overrides.update(delayed_topic_partitions=1, delayed_dispatch_lead=0, delayed_run_lease=4)
    app, run, r, first, second = one_reading_one_waiting(overrides, processes)
    (child,) = pool_children(first)
    os.kill(child, signal.SIGSTOP)
    try:
        task = due_in(app, "tasks.demo.work", (run, 12.0), seconds=1.5)
        wait_for(lambda: f"[{task.id}] received" in processes.log(first), 30, "the first worker to receive it")
        time.sleep(1)  # written to the stopped child's pipe; not accepted
        stopping = warm_stop_soon(processes, first)
        wait_for(lambda: assigned(processes, second), 30, "the second worker to take the partition")
        time.sleep(6)  # past the run lease: the second worker has read the task's record again
    finally:
        os.kill(child, signal.SIGCONT)
    wait_for(lambda: task.id in runs(r, run), 30, "the child to run the task")
    started = time.monotonic()
    stopping.join(60)
    exited = time.monotonic() - started
    time.sleep(10)  # a copy the second worker put back while the claim was held comes round again
    print(f"\nflushed after reaching a child: runs {runs(r, run)}; its worker exited {exited:.1f} s after it started")
    assert runs(r, run) == {task.id: 1}
    assert exited < 22, f"the worker took {exited:.1f} s to exit after its last task (12 s) started"


def test_a_queue_with_more_workers_than_partitions_says_so_and_its_topic_grows(overrides, processes):
    """Two workers on a queue whose topic has one partition: the one left without it says so in its
    log, ``delayed topics`` counts it idle; ``--grow`` gives the topic a second partition, and then
    each worker reads one."""
    from .test_cli import celery

    overrides.update(delayed_topic_partitions=1)
    queue = overrides["task_default_queue"]
    workers = [processes.worker(name, "-c", "1") for name in ("w1", "w2")]
    wait_for(lambda: any(assigned(processes, w) for w in workers), 60, "a worker to take the partition")
    said = "reads none of the partitions"
    wait_for(lambda: sum(said in processes.log(w) for w in workers) == 1, 60, "the idle worker to say so")

    def fleet() -> dict:
        out = celery(overrides, "delayed", "topics", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert fleet() == {"topics": [{"queue": queue, "partitions": 1, "consumers": 1, "lag": 0}], "idle_workers": 1}
    grown = celery(overrides, "delayed", "topics", "--grow", queue, "--partitions", "2")
    assert grown.returncode == 0, grown.stderr
    wait_for(lambda: fleet() == {"topics": [{"queue": queue, "partitions": 2, "consumers": 2, "lag": 0}],
                                 "idle_workers": 0}, 60, "each worker to read one partition")
    bad = celery(overrides, "delayed", "topics", "--grow", queue)
    assert bad.returncode != 0 and "go together" in bad.stderr


def test_a_rolling_restart_of_three_workers_under_load_loses_nothing_and_runs_nothing_twice(overrides, processes):
    """Tasks due steadily (20 a second, some of them long) while each of three workers in turn is
    stopped warm and replaced: every task runs, once."""
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    workers = [processes.worker(f"w{n}", "-c", "2") for n in (1, 2, 3)]
    wait_for(lambda: all(assigned(processes, w) for w in workers), 60, "every worker to be assigned partitions")
    results, sending = [], threading.Event()

    def send() -> None:
        for i in range(600):  # 30 s at 20 a second; every 10th task takes 3 s
            results.append(due_in(app, "tasks.demo.work", (run, 3.0 if i % 10 == 0 else 0.0), seconds=2.0))
            time.sleep(0.05)
        sending.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(5)
    for n, old in enumerate(workers, start=4):
        assert processes.warm_stop(old, timeout=60) == 0
        new = processes.worker(f"w{n}", "-c", "2")
        wait_for(lambda: assigned(processes, new), 60, f"w{n} to be assigned partitions")
    sender.join(60)
    assert sending.is_set()
    wait_for(lambda: len(runs(r, run)) == len(results), 120,
             lambda: f"every task to run: {len(runs(r, run))} of {len(results)}")
    time.sleep(12)  # past a run lease: a copy put back behind a running one comes round again
    counts = runs(r, run)
    print(f"\nrolling restart of 3 workers: {len(counts)} tasks, {sum(counts.values())} executions")
    assert set(counts) == {x.id for x in results}
    assert [task_id for task_id, n in counts.items() if n > 1] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["consumer", "classic"])
def test_a_warm_stop_while_kafka_is_down_ends_within_the_leave_timeout_and_loses_nothing(overrides, processes, servers,
                                                                                        protocol):
    """A warm stop with Kafka down took ~34 s (28 s on the classic protocol): librdkafka holds an offset
    commit made while the group coordinator is unreachable until it is back or session.timeout.ms passed
    (45 s on the consumer protocol, 10 s here on the classic one), and the feed's commits waited for their
    answer -- the one the feed's loop makes every half second, then the last one, then the revoke's -- or,
    made without waiting, the consumer's close() waited for them all; the 30 s join of
    ``KafkaFeed.close()`` ended the stop, past Docker's 10 s grace period.  Commits no longer wait, nor
    does the stop for close() past ``CLOSE_TIMEOUT``; once Kafka answers again every task runs once.
    (The tasks are due in 2 s: one due sooner than delayed_min_delay, 1 s, takes Celery's broker and
    never reaches Kafka, and a feed that read nothing commits nothing.)"""
    overrides.update(delayed_topic_partitions=2, delayed_dispatch_lead=0, delayed_group_protocol=protocol)
    app, run, r, first = poller_and_worker(overrides, processes, 2)
    before = [due_in(app, "tasks.demo.work", (run, 3.0), seconds=2.0) for _ in range(4)]
    wait_for(lambda: len(runs(r, run)) == 2, 60, "the first tasks to start")
    wait_for(lambda: max(committed(app, 0), committed(app, 1)) >= 0, 30, "a commit of the records read from Kafka")
    servers.stop("kafka")
    time.sleep(3)  # the feed's commits meet a coordinator gone
    stopped = time.monotonic()
    status = processes.warm_stop(first, 120)
    took = time.monotonic() - stopped
    servers.start("kafka")
    print(f"\nwarm stop with Kafka down ({protocol}): {took:.1f} s, exit status {status} "
          f"(LEAVE_TIMEOUT {LEAVE_TIMEOUT:g} s)")
    assert took < LEAVE_TIMEOUT + 5, f"the warm stop took {took:.1f} s while Kafka was down"
    assert status == 0
    processes.worker("w2", "-c", "2")
    after = [due_in(app, "tasks.demo.work", (run,), seconds=2.0) for _ in range(10)]
    assert {x.get(timeout=150) for x in before + after} == {x.id for x in before + after}
    time.sleep(3)  # a copy read again from an offset the stop did not commit must not run twice
    assert set(runs(r, run).values()) == {1}


def test_a_worker_killed_and_replaced_stalls_only_its_own_partitions(overrides, processes):
    """F4: on the classic protocol a kill -9 and a replacement at once made every member give up every
    partition at the replacement's join and wait for the dead member's session: the whole fleet read
    nothing for seconds.  Now only the dead worker's partitions wait; the survivor's run on time."""
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    victim, survivor = processes.worker("w1", "-c", "2"), processes.worker("w2", "-c", "2")
    wait_for(lambda: all(assigned(processes, w) for w in (victim, survivor)), 60, "both workers to take partitions")
    time.sleep(3)  # the group settles
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    replacement = processes.worker("w3", "-c", "2")
    wait_for(lambda: "ready." in processes.log(replacement), 60, "the replacement to join")
    due = [int(time.time() * 1000) + 1500 + 80 * i for i in range(40)]  # due within the dead member's session
    for due_ms in due:
        app.tasks["tasks.demo.fire"].apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == len(due), 90, "every task to run")
    lags = sorted(int(lag) for lag in r.lrange(f"demo:{run}:lag", 0, -1))
    on_time = sum(lag <= 1000 for lag in lags)
    print(f"\nkill -9 and a replacement: {on_time} of {len(lags)} due after its join ran on time; lags {lags}")
    assert on_time >= len(lags) // 4, "the survivor's partitions stalled too"


PROTOCOLS = pytest.mark.parametrize("protocol, assignor", [("consumer", None), ("classic", None),
                                                           ("classic", "cooperative-sticky")])


class _ClosingConsumer(Consumer):
    """A consumer that knows when it is inside ``close()``."""

    closing = False

    def close(self) -> None:
        self.closing = True
        super().close()


def _rebalance_feed(services, protocol: str, assignor: str | None, seen: dict[str, list]):
    """A real consumer of a fresh 3-partition topic, subscribed with a feed's rebalance callbacks
    (its rebalance bookkeeping alone), polled until assigned; ``seen`` records from inside the
    callbacks the assignment after each change and whether the consumer was closing."""
    topic = f"rebalance-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(services.kafka())
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(timeout=30)
    extra = {"group.id": topic, "enable.auto.commit": False}
    if assignor:
        extra["partition.assignment.strategy"] = assignor
    config = consumer_config(Settings.from_mapping({**SERVERS, "group_protocol": protocol}), **extra)
    feed = object.__new__(KafkaFeed)
    feed.offsets, feed._paused, feed._incremental, feed._green = OffsetTracker(), set(), incremental(config), False

    def on_assign(consumer, partitions):
        feed._on_assign(consumer, partitions)
        seen["assigned"] = [tp.partition for tp in consumer.assignment()]

    def on_revoke(consumer, partitions):
        feed._on_revoke(consumer, partitions)
        seen["left after revoke"] = [tp.partition for tp in consumer.assignment()]
        seen["revoked while closing"] = [consumer.closing]

    consumer = feed._consumer = _ClosingConsumer(config)
    consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
    deadline = time.monotonic() + 60
    while "assigned" not in seen and time.monotonic() < deadline:
        consumer.poll(0.2)
    return feed, consumer, lambda: admin.delete_topics([topic])


@PROTOCOLS
def test_the_feeds_rebalance_callbacks_apply_each_change_themselves(services, protocol, assignor):
    """A warm stop froze a worker for good (4 of 29 rolling restarts with Kafka stalling): a change of assignment
    its callbacks leave undone, confluent-kafka applies after asking librdkafka for the rebalance
    protocol, holding the GIL; during the close, with the coordinator stalled, that answer never came
    (py-spy: Consumer_rebalance_cb > rd_kafka_rebalance_protocol > rd_kafka_op_req), and no other
    thread of the worker ran again.  The feed's callbacks now apply each change themselves, so that
    call is never made: seen here from inside the callbacks, on a real consumer of each kind."""
    seen: dict[str, list] = {}
    feed, consumer, delete_topic = _rebalance_feed(services, protocol, assignor, seen)
    try:
        consumer.close()
    finally:
        delete_topic()
    assert sorted(seen["assigned"]) == [0, 1, 2], seen
    assert seen["left after revoke"] == [], seen


@PROTOCOLS
def test_a_stopping_feed_gives_its_partitions_up_before_its_consumer_closes(services, protocol, assignor):
    """The callbacks' own (un)assign call waits on librdkafka's group thread holding the GIL too, and
    inside ``close()`` it can wait for good as well: a warm stop in CI froze the same way after the fix
    above, with no Kafka stall at all.  A stopping feed unsubscribes and polls until its partitions
    are revoked, so the close has nothing left to call back."""
    seen: dict[str, list] = {}
    feed, consumer, delete_topic = _rebalance_feed(services, protocol, assignor, seen)
    try:
        feed._leave(consumer)
    finally:
        delete_topic()
    assert sorted(seen["assigned"]) == [0, 1, 2], seen
    assert seen["left after revoke"] == [] and seen["revoked while closing"] == [False], seen
