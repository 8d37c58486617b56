"""The worker side with real worker processes: offsets, crashes, duplicates, poison."""
from __future__ import annotations

import json
import re
import os
import signal
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis
from confluent_kafka import Producer, TopicPartition
from celery.result import AsyncResult
from confluent_kafka.admin import AdminClient

from celery_delayed import store_of
from celery_delayed.envelope import Envelope, deflate
from celery_delayed.kafka import DUE_HEADER, ensure_topics
from celery_delayed.store.dlq import DeadLetters
from tasks import create_app

from .support import cut_redis_connections, wait_for


def due_in(app, name: str, args: tuple, seconds: float = 1.5, **options):
    return app.tasks[name].apply_async(args, countdown=seconds, **options)


def taken_out(app, name: str, args: tuple, **options) -> tuple[AsyncResult, bytes]:
    """A task scheduled an hour ahead, then taken out of the store: its result and its stored
    message, for a test to put on Kafka itself (as often as it likes)."""
    result = app.tasks[name].apply_async(args, countdown=3600, **options)
    store = store_of(app)
    envelope = store.message(result.id)
    store.cancel(result.id)
    return result, envelope


def kafka_queue(app) -> tuple[Producer, str]:
    """A producer, and the Kafka topic of the app's default queue."""
    settings = app.amqp.delayed_settings
    return Producer(settings.kafka()), settings.topic(app.conf.task_default_queue)


def committed(app, partition: int = 0) -> int:
    settings = app.amqp.delayed_settings
    topic = settings.topic(app.conf.task_default_queue)
    admin = AdminClient(settings.kafka())
    from confluent_kafka import ConsumerGroupTopicPartitions
    future = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(settings.consumer_group, [TopicPartition(topic, partition)])])
    (result,) = future.values()
    return result.result().topic_partitions[0].offset


def test_out_of_order_completion_never_commits_past_a_running_task(overrides, processes):
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    slow = due_in(app, "tasks.demo.work", (run, 8.0), seconds=1.5)
    processes.poller()
    processes.worker("w1", "-c", "4")
    client = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: client.hexists(f"demo:{run}:runs", slow.id), 60, "the slow task to start")  # first on Kafka
    fast = [due_in(app, "tasks.demo.work", (run, 0.0), seconds=1.5) for _ in range(10)]
    for result in fast:
        result.get(timeout=60)
    time.sleep(1.5)  # several commit intervals
    assert not slow.ready()
    assert committed(app) == 0, "committed past the slow task that is still running"
    slow.get(timeout=60)
    wait_for(lambda: committed(app) == 11, 10, "the commit to move past every task once all ended")


def test_kill_9_of_a_worker_mid_task_loses_nothing_and_charges_once(overrides, processes):
    app = create_app(**overrides)
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    n = 60
    results = [due_in(app, "tasks.payments.charge", (f"order-{i}-{overrides['delayed_key_prefix']}", 100, 0.3))
               for i in range(n)]
    processes.poller()
    first = processes.worker("w1", "-c", "4")
    wait_for(lambda: r.hlen("payments:attempts") and
             sum(r.hexists("payments:attempts", x.id) for x in results) >= 12, 60, "a dozen charges to start")
    os.killpg(first.pid, signal.SIGKILL)  # the main process and its pool children, mid-task
    first.wait()
    processes.worker("w2", "-c", "4")
    for x in results:
        assert x.get(timeout=120) in (True, False)
    attempts = [int(r.hget("payments:attempts", x.id)) for x in results]
    charged = [int(r.get(f"payments:charged:order-{i}-{overrides['delayed_key_prefix']}") or 0) for i in range(n)]
    print(f"\nkill -9 of a worker: {n} tasks, {sum(attempts)} executions, "
          f"{sum(a > 1 for a in attempts)} ran twice, every order charged once")
    assert charged == [100] * n  # the side effect keyed by task id happened once per task


def test_killed_pool_child_task_runs_again(overrides, processes):
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    result = due_in(app, "tasks.demo.crash_once", (run,))
    processes.poller()
    processes.worker("w1", "-c", "2")
    assert result.get(timeout=90) == "survived"
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    assert int(r.hget(f"demo:{run}:runs", result.id)) == 2


def test_a_task_dispatched_ahead_of_its_due_time_starts_at_it_not_before(overrides, processes):
    """``delayed_dispatch_lead`` 0.8 s: the poller puts each task on Kafka up to 0.8 s early and
    the worker holds it with Celery's ETA timer.  None starts before its due time; the task sees
    that time as ``request.eta``."""
    overrides.update(delayed_dispatch_lead=0.8)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    processes.poller()
    processes.worker("w1", "-c", "2")
    due: dict[str, int] = {}
    for i in range(30):
        due_ms = int((time.time() + 4 + i * 0.05) * 1000)
        eta = datetime.fromtimestamp(due_ms / 1000, timezone.utc)
        due[app.tasks["tasks.demo.fire"].apply_async((run, due_ms), eta=eta).id] = due_ms
    eta = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=4)
    seen = app.tasks["tasks.demo.eta_seen"].apply_async(eta=eta)
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: r.llen(f"demo:{run}:hops") == len(due), 60, "every task to run")
    hops = [json.loads(x) for x in r.lrange(f"demo:{run}:hops", 0, -1)]
    early = sorted(h["due"] - h["produced"] for h in hops)
    print(f"\nput on Kafka ahead of due by {early[0]}..{early[-1]} ms; started after due by "
          f"{min(h['started'] - h['due'] for h in hops)}..{max(h['started'] - h['due'] for h in hops)} ms")
    assert [h for h in hops if h["started"] < h["due"]] == []
    assert sum(e > 300 for e in early) >= len(hops) // 2, early  # the lead was used: the test tests it
    assert datetime.fromisoformat(seen.get(timeout=30)) == eta


def test_duplicate_deliveries_run_once(overrides, processes):
    overrides.update(delayed_run_lease=5)
    app = create_app(**overrides)
    store = store_of(app)
    run = uuid.uuid4().hex
    slow, envelope = taken_out(app, "tasks.demo.work", (run, 3.0))
    producer, topic = kafka_queue(app)
    processes.poller()
    processes.worker("w1", "-c", "4")
    for _ in range(2):  # two copies in flight at once
        producer.produce(topic, key=slow.id, value=envelope)
    producer.flush(10)
    wait_for(lambda: store.get(slow.id) is not None, 20, "the second copy to be deferred to the store")
    assert slow.get(timeout=60) == slow.id
    time.sleep(1)
    producer.produce(topic, key=slow.id, value=envelope)  # and a late one after it finished
    producer.flush(10)
    # The copy that arrived while the first ran was put back in the store until the claim's
    # lease ends; it comes back, finds the result, and is acknowledged without running.
    wait_for(lambda: sum(x["scheduled"] + x["inflight"] for x in store.counts()) == 0, 30,
             "the deferred copy to come back from the store")
    time.sleep(2)
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    assert int(r.hget(f"demo:{run}:runs", slow.id)) == 1


def test_a_late_duplicate_of_a_task_whose_result_is_ignored_does_not_run_again(overrides, processes):
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    quiet, envelope = taken_out(app, "tasks.demo.work", (run,), ignore_result=True)
    producer, topic = kafka_queue(app)
    processes.worker("w1")
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    producer.produce(topic, key=quiet.id, value=envelope)
    producer.flush(10)
    wait_for(lambda: r.hget(f"demo:{run}:runs", quiet.id), 60, "the task to run")
    wait_for(lambda: committed(app) == 1, 30, "its offset to be committed")
    assert app.backend.get_task_meta(quiet.id)["status"] == "PENDING"  # no result for the backend check to find
    producer.produce(topic, key=quiet.id, value=envelope)  # a copy redelivered after the task finished
    producer.flush(10)
    wait_for(lambda: committed(app) == 2, 30, "the late copy to be acknowledged")
    assert int(r.hget(f"demo:{run}:runs", quiet.id)) == 1


def test_a_task_that_failed_for_good_but_was_never_parked_is_parked_from_its_next_copy(overrides, processes):
    """The worker was killed after Celery stored the task's FAILURE and before the task was parked
    (the chaos suite's worker-kill hit that window): the redelivered copy is not run, the task
    having ended, but parked, so the dead-letter queue holds every task that failed for good."""
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    result, envelope = taken_out(app, "tasks.demo.work", (run,))
    app.backend.mark_as_failure(result.id, RuntimeError("failed for good"), traceback="Traceback (...)")
    producer, topic = kafka_queue(app)
    processes.worker("w1")
    producer.produce(topic, key=result.id, value=envelope)
    producer.flush(10)
    letters = DeadLetters(store_of(app))
    wait_for(lambda: letters.holds(result.id), 60, "the task to be parked")
    letter = letters.get(result.id)
    assert (letter.reason, letter.traceback, letter.message) == ("RuntimeError: failed for good",
                                                                 "Traceback (...)", envelope)
    wait_for(lambda: committed(app) == 1, 30, "the copy to be acknowledged")
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    assert not r.exists(f"demo:{run}:runs"), "a task that had ended ran again"


def test_poison_message_goes_to_the_dead_letter_queue_and_the_worker_goes_on(overrides, processes):
    app = create_app(**overrides)
    producer, topic = kafka_queue(app)
    processes.worker("w1")
    producer.produce(topic, key=b"garbage-1", value=b"\xff\xfe not an envelope")
    unknown, envelope = taken_out(app, "tasks.demo.add", (1, 2))
    store = store_of(app)
    poisoned = Envelope.decode(envelope)
    poisoned.headers["task"] = "tasks.demo.nope"
    producer.produce(topic, key=unknown.id, value=poisoned.encode())
    producer.flush(10)
    processes.poller()
    ok = due_in(app, "tasks.demo.add", (20, 22))
    assert ok.get(timeout=60) == 42
    letters = DeadLetters(store)
    garbage = wait_for(lambda: letters.get("garbage-1"), 20, "the garbage in the dead-letter queue")
    assert garbage.source == "worker" and "undecodable message" in garbage.reason
    nope = wait_for(lambda: letters.get(unknown.id), 20, "the unknown task in the dead-letter queue")
    assert "unknown task 'tasks.demo.nope'" in nope.reason
    unknown.get(timeout=20, propagate=False)  # its waiter wakes up with the reason
    assert unknown.state == "FAILURE" and "dead-lettered by the worker: unknown task" in str(unknown.result)


def test_a_message_celery_cannot_build_a_request_from_is_dead_lettered_not_retried_for_ever(overrides, processes):
    """Properties that are not an object make Celery's Request raise AttributeError: the message
    can never run, so it is parked, and the records behind it on the partition still run."""
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    producer, topic = kafka_queue(app)
    bad, stored = taken_out(app, "tasks.demo.add", (1, 2))
    envelope = Envelope.decode(stored)
    meta = {"id": envelope.task_id, "q": envelope.queue, "h": envelope.headers, "ct": envelope.content_type,
            "ce": envelope.content_encoding, "p": ["not", "an", "object"]}
    producer.produce(topic, key=envelope.task_id, value=json.dumps(meta).encode() + b"\n" + envelope.body)
    producer.flush(10)
    processes.worker("w1")
    processes.poller()
    assert due_in(app, "tasks.demo.add", (20, 22)).get(timeout=60) == 42
    letter = wait_for(lambda: DeadLetters(store_of(app)).get(bad.id), 20, "the bad message in the dead-letter queue")
    assert "invalid task message" in letter.reason


def test_records_no_poller_wrote_are_dead_lettered_bytes_and_all_and_the_partition_keeps_flowing(
        overrides, processes):
    """A foreign producer's records on a ready topic, none with the poller's headers: garbage, nothing
    at all (no key either), truncated envelopes, JSON that is no task message, and task messages whose
    body is not ``[args, kwargs, embed]`` (Celery ran those, failing in its pool or its callbacks,
    acknowledged them and left them out of the dead-letter queue, two of them PENDING for ever).  Each
    is parked with its bytes and a reason, and the good record behind them all on the partition runs."""
    overrides.update(delayed_topic_partitions=1, result_expires=300)
    app = create_app(**overrides)
    producer, topic = kafka_queue(app)
    tag = overrides["delayed_key_prefix"]
    good, stored = taken_out(app, "tasks.demo.add", (1, 2))
    compact = Envelope.decode(stored).encode()

    def with_body(task_id: str, body: bytes) -> bytes:
        envelope = Envelope.decode(stored)
        envelope.task_id = envelope.headers["id"] = task_id
        envelope.body = body
        return envelope.encode()

    bad = {f"{topic}:0": None,  # first on the fresh topic, keyless: parked under its offset
           f"{tag}-garbage": b"\0\xff\xfe", f"{tag}-empty": b"", f"{tag}-cut": compact[:40],
           f"{tag}-cut-deflated": deflate(compact, 0)[:-3], f"{tag}-cut-body": with_body(f"{tag}-cut-body", b"[[1, "),
           f"{tag}-foreign-json": b'{"event": "signup", "user": 42}', f"{tag}-no-headers": b'{"id": "x", "q": "y"}\n[]',
           f"{tag}-args": with_body(f"{tag}-args", b"[5, {}, {}]"),
           f"{tag}-kwargs": with_body(f"{tag}-kwargs", b"[[1, 2], [], {}]"),
           f"{tag}-embed": with_body(f"{tag}-embed", b"[[1, 2], {}, 7]")}
    ensure_topics(app.amqp.delayed_settings, [app.conf.task_default_queue])  # or the producer waits for it
    for key, value in bad.items():
        producer.produce(topic, key=None if key.startswith(topic) else key, value=value)
    producer.produce(topic, key=good.id, value=stored)
    assert producer.flush(10) == 0
    worker = processes.worker("w1")
    assert good.get(timeout=60) == 3
    letters = DeadLetters(store_of(app))
    for key, value in bad.items():
        letter = wait_for(lambda: letters.get(key), 20, f"{key} in the dead-letter queue")
        assert letter.source == "worker" and letter.reason and letter.message == (value or b""), (key, letter)
    assert "task body is not [args" in letters.get(f"{tag}-kwargs").reason
    assert worker.poll() is None, "the worker died:\n" + processes.log(worker)[-3000:]


def test_a_record_whose_due_header_no_time_can_hold_runs_and_the_ones_behind_it_too(overrides, processes):
    """The poller's timing headers are information: a record whose due header is past what a
    datetime holds (a producer's bug, a hand-made record) runs; it used to make the hand-over to
    Celery raise, be tried again every second for ever, and hold up every record behind it."""
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    producer, topic = kafka_queue(app)
    odd, stored = taken_out(app, "tasks.demo.add", (1, 2))
    producer.produce(topic, key=odd.id, value=stored, headers=[(DUE_HEADER, b"99999999999999999")])
    producer.flush(10)
    processes.worker("w1")
    processes.poller()
    assert due_in(app, "tasks.demo.add", (20, 22)).get(timeout=60) == 42
    assert odd.get(timeout=20) == 3


def test_warm_shutdown_finishes_running_tasks_and_the_next_worker_commits_them_without_running_them(
        overrides, processes):
    """A stopping worker leaves the group at once and finishes its running tasks outside it, so their
    offsets stay uncommitted: the next worker reads them again, finds them finished, and commits them."""
    overrides.update(delayed_topic_partitions=1)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    running = [due_in(app, "tasks.demo.work", (run, 4.0)) for _ in range(2)]
    processes.poller()
    worker = processes.worker("w1", "-c", "2")
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 2, 60, "both tasks to start")
    assert processes.warm_stop(worker) == 0
    assert all(x.get(timeout=5) for x in running)  # they finished during the warm shutdown
    processes.worker("w2", "-c", "2")
    wait_for(lambda: committed(app) == 2, 60, "the next worker to commit the finished tasks' records")
    assert set(r.hvals(f"demo:{run}:runs")) == {b"1"}


@pytest.mark.parametrize("pool", ["threads", "solo", "gevent", "eventlet"])
def test_other_pools_run_kafka_fed_tasks(overrides, processes, pool):
    app = create_app(**overrides)
    results = [due_in(app, "tasks.demo.add", (i, i)) for i in range(20)]
    processes.poller()
    processes.worker("w1", "--pool", pool, "-c", "2")
    assert [x.get(timeout=60) for x in results] == [2 * i for i in range(20)]


def test_rebalance_to_a_second_worker_loses_nothing(overrides, processes):
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    results = [due_in(app, "tasks.demo.work", (run, 0.05), seconds=1.5 + i / 100) for i in range(300)]
    processes.poller()
    processes.worker("w1", "-c", "2")
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: r.hlen(f"demo:{run}:runs") >= 30, 60, "the first worker to get going")
    processes.worker("w2", "-c", "2")  # joins the group: partitions move while tasks are in hand
    store = store_of(app)

    def unfinished() -> str:  # on a timeout: where each task without a result stands
        return "; ".join(f"{x.id}: runs {r.hget(f'demo:{run}:runs', x.id)}, state {x.state}, "
                         f"claim {r.get(store.keys.run(x.id))} (pttl {r.pttl(store.keys.run(x.id))} ms), "
                         f"in the store {store.get(x.id)}" for x in results if not x.ready())

    wait_for(lambda: all(x.ready() for x in results), 120, lambda: f"every task to end: {unfinished()}", 0.5)
    assert {x.get(timeout=10) for x in results} == {x.id for x in results}
    workers = {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in results}
    print(f"\nrebalance: 300 tasks, {sum(int(v) for v in r.hvals(f'demo:{run}:runs'))} executions, "
          f"ran on {sorted(workers)}")
    assert workers == {"w1", "w2"}


def test_the_partitions_of_a_killed_worker_move_to_the_others_within_the_session_timeout(overrides, processes):
    """kill -9 of one of two workers: its Kafka partitions go to the other once the group misses
    its heartbeats for ``session.timeout.ms`` (10 s here, not librdkafka's 45 s), so tasks due
    right after the kill run within 30 s of it."""
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    first, second = processes.worker("w1", "-c", "2"), processes.worker("w2", "-c", "2")
    wait_for(lambda: all("assigned Kafka partitions" in processes.log(w) for w in (first, second)), 60,
             "both workers to be assigned partitions")
    time.sleep(5)  # the group settles: both members steady
    warmup = [due_in(app, "tasks.demo.work", (run,), seconds=2.0) for _ in range(40)]
    assert {x.get(timeout=90) for x in warmup} == {x.id for x in warmup}
    assert {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in warmup} == {"w1", "w2"}
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed = time.monotonic()
    after = [due_in(app, "tasks.demo.work", (run,), seconds=2.0) for _ in range(40)]
    wait_for(lambda: all(r.hexists(f"demo:{run}:runs", x.id) for x in after), 30,
             "the killed worker's partitions to be read by the other worker")
    print(f"\nkill -9 of a worker: its partitions served again {time.monotonic() - killed:.1f} s later")


@pytest.mark.parametrize("lead", [0.5, 0.0], ids=["held-by-celerys-eta-timer", "due-when-handed"])
def test_tasks_celery_dropped_on_a_consumer_restart_run_again_without_waiting_out_their_run_claims(
        overrides, processes, lead):
    """A broker reconnect restarts the worker's consumer, which loses no Kafka-fed task: Celery drops
    the requests it held but had not given to its pool (waiting for their ETA, the dispatch lead, or
    for the one pool slot); they never run, so their run claims are given up and the copies read
    again run at once, not a run lease (60 s here) later.  Each task runs once."""
    overrides.update(delayed_run_lease=60, delayed_dispatch_lead=lead)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    results = [due_in(app, "tasks.demo.work", (run, 0.5), seconds=2.0) for _ in range(12)]
    processes.poller()
    worker = processes.worker("w1", "-c", "1")
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: r.hlen(f"demo:{run}:runs") >= 2, 90, "tasks to start")
    assert cut_redis_connections(r, worker.pid)  # Celery restarts its consumer
    cut = time.monotonic()
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == len(results), 40,
             "every task to run well within the 60 s run lease after the consumer restart")
    print(f"\nconsumer restart: all {len(results)} tasks ran {time.monotonic() - cut:.1f} s after the cut")
    assert {x.get(timeout=30) for x in results} == {x.id for x in results}
    assert set(r.hvals(f"demo:{run}:runs")) == {b"1"}
    assert "Connection to broker lost" in processes.log(worker)

def test_a_copy_waiting_for_a_run_claim_is_not_dispatched_again_and_again(overrides, processes):
    """A copy of a task id whose run claim another worker holds goes back to the store until that
    claim would expire, plus the dispatch lead: the poller dispatches that lead early, and a copy
    due at the expiry itself would find the claim still held and come back at once, over and over
    (a claim that is not extended: its worker forgot it in a consumer restart, or died)."""
    app = create_app(**overrides)
    run, task_id = uuid.uuid4().hex, str(uuid.uuid4())
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    r.set(store_of(app).keys.run(task_id), "another-worker", px=4000)
    poller = processes.poller()
    processes.worker("w1", "-c", "2")
    result = due_in(app, "tasks.demo.work", (run,), seconds=1.5, task_id=task_id)
    assert result.get(timeout=60) == task_id
    time.sleep(1)
    processes.stop_all()  # the poller logs its counts as it stops
    dispatched = int(re.search(r"'dispatched': (\d+)", processes.log(poller)).group(1))
    print(f"\nthe task was dispatched {dispatched} times")
    assert r.hget(f"demo:{run}:runs", task_id) == b"1"
    assert dispatched <= 3, f"dispatched {dispatched} times while it waited for the claim"


@pytest.mark.parametrize("stop, expected_runs", [("group-sigterm", 2), ("sigquit", 2), ("group-sigint", 1)])
def test_a_task_whose_pool_child_dies_with_the_workers_stop_runs_again_at_once(overrides, processes, stop,
                                                                               expected_runs):
    """A stop that reaches the pool children (systemd's KillMode=control-group, supervisord's
    stopasgroup: SIGTERM to the whole group) kills the task mid-run; Celery rejects it for requeue
    (``task_reject_on_worker_lost``) and it goes back through the store.  Its run claim must be given up
    before that copy can be read, or the next worker waits for it to lapse: 10.9 s late with a 10 s lease
    (review, issue 42); 60 s here.  A cold stop (SIGQUIT) ends the task without a word to the consumer:
    its claim is given up as the worker exits.  Ctrl-C in a terminal (SIGINT to the group) leaves the
    pool child be: the task ends in the warm stop, once."""
    overrides.update(delayed_run_lease=60)
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    processes.poller()
    first = processes.worker("w1", "-c", "1")
    task = due_in(app, "tasks.demo.work", (run, 8.0))
    wait_for(lambda: r.hget(f"demo:{run}:runs", task.id) == b"1", 60, "the task to start")
    sig = {"group-sigterm": signal.SIGTERM, "group-sigint": signal.SIGINT, "sigquit": signal.SIGQUIT}[stop]
    if stop.startswith("group"):
        os.killpg(first.pid, sig)
    else:
        first.send_signal(sig)
    first.wait(timeout=60)
    processes.worker("w2", "-c", "1")
    stopped = time.monotonic()
    assert task.get(timeout=40) == task.id, "the task did not end well before its 60 s run claim would lapse"
    runs = int(r.hget(f"demo:{run}:runs", task.id))
    print(f"\n{stop}: the task ended {time.monotonic() - stopped:.1f} s after the worker stopped, run {runs} times")
    assert runs == expected_runs


def _worker_to_shut_down(overrides, processes, pool: str, concurrency: int):
    """A poller and a worker of a name of its own that ``celery control shutdown`` reaches alone (its own
    control exchange: other tests' workers share the broker), run claims of 120 s: the app, the run's
    id, Redis, the worker's name and process."""
    overrides.update(delayed_run_lease=120, control_exchange=f"{overrides['task_default_queue']}-control")
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    processes.poller()
    name = f"w1-{run[:8]}"
    first = processes.worker(name, "--pool", pool, "-c", str(concurrency))
    return app, run, redis.Redis.from_url(app.conf.delayed_redis_url), name, first


@pytest.mark.parametrize("pool", ["prefork"])  # green pools: the next test
def test_a_worker_stopped_by_celery_control_shutdown_hands_its_tasks_over_at_once(overrides, processes, pool):
    """``celery -A proj control shutdown``: Celery's remote-control command stops the worker warm from
    inside its consumer.  The task it runs ends there, once; the tasks it held for its one pool slot
    never run there, and their run claims are given up: the next worker runs each at once, once, not a
    run lease (120 s here: the next worker's start alone can take 20 s on a busy machine) later."""
    app, run, r, name, first = _worker_to_shut_down(overrides, processes, pool, 1)
    tasks = [due_in(app, "tasks.demo.work", (run, 4.0)) for _ in range(4)]
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 1, 60, "the first task to start")
    control = processes.start("control", "control", "shutdown", "-d", f"{name}@{socket.gethostname()}")
    control.wait(timeout=60)  # "No nodes replied": a worker that shuts down sends no reply
    assert first.wait(timeout=60) == 0
    assert "Got shutdown from remote" in processes.log(first)
    processes.worker("w2", "--pool", pool, "-c", "1")
    stopped = time.monotonic()
    assert {x.get(timeout=90) for x in tasks} == {x.id for x in tasks}, \
        "the held tasks did not run before their 120 s run claims would lapse"
    print(f"\ncontrol shutdown: every task ended {time.monotonic() - stopped:.1f} s after the worker stopped")
    assert set(r.hvals(f"demo:{run}:runs")) == {b"1"}
    ran = {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in tasks}
    assert ran == {name, "w2"}


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_stopped_while_a_task_waits_for_a_pool_slot_never_starts_it(overrides, processes, pool):
    """A green pool's hand-over waits inside the pool for a free slot.  A task waiting there when the
    worker stops warm is given up (its run claim released, so the next worker runs it at once); it
    must then never start in the stopping worker, which still runs a long task, when a slot frees:
    the task would run twice (issue 42).  Two slots: ``long`` and ``short`` run, ``waiting`` (due a
    little later) waits for a slot; ``short`` ends while ``long`` keeps the stopping worker alive."""
    app, run, r, name, first = _worker_to_shut_down(overrides, processes, pool, 2)
    long, short = (due_in(app, "tasks.demo.work", (run, s), 3.0) for s in (16.0, 10.0))
    waiting, waiting_due = due_in(app, "tasks.demo.work", (run, 8.0), 5.0), time.time() + 5.0
    wait_for(lambda: r.hlen(f"demo:{run}:runs") == 2, 60, "the long and the short task to start")
    time.sleep(max(0.0, waiting_due + 1.5 - time.time()))  # due: waiting for a slot (until `short` ends)
    processes.start("control", "control", "shutdown", "-d", f"{name}@{socket.gethostname()}").wait(timeout=60)
    processes.worker("w2", "--pool", pool, "-c", "2")
    assert waiting.get(timeout=90) == waiting.id
    assert {long.get(timeout=90), short.get(timeout=30)} == {long.id, short.id}
    assert first.wait(timeout=60) == 0
    assert r.hget(f"demo:{run}:runs", waiting.id) == b"1", "the waiting task ran twice"
    assert app.backend.get_task_meta(waiting.id)["worker"].split("@")[0] == "w2"
    assert {app.backend.get_task_meta(x.id)["worker"].split("@")[0] for x in (long, short)} == {name}


def test_a_task_id_holding_cr_lf_forges_no_line_in_celerys_own_worker_log(overrides, processes):
    """Celery's worker logs each task's id ("Task name[id] received", "... succeeded"): an id a scheduler
    chose, holding CR/LF, must show escaped there too, not start a line of its own (issue 46)."""
    app = create_app(**overrides)
    forged = "[2026-01-01 00:00:00,000: INFO/MainProcess] forged line"
    result = due_in(app, "tasks.demo.add", (2, 3), task_id=f"evil-{uuid.uuid4().hex}\r\n{forged}")
    processes.poller()
    worker = processes.worker("w1")
    assert result.get(timeout=60) == 5
    log = processes.log(worker)
    assert "received" in log and "\\r\\n" + forged in log  # Celery's lines about the task, its id escaped
    assert not [line for line in log.splitlines() if line.startswith(forged)], "a task id forged a log line"
