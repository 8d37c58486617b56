"""``celery delayed drain --to-broker``: the way back from celery-delayed to Celery's broker (real Redis
broker and store, a real poller in etcd, a plain Celery worker without celery-delayed)."""
from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

import redis
from confluent_kafka import Producer
from kombu import Exchange, Queue

from bench import compare_app
from celery_delayed import apply_many, store_of
from celery_delayed.envelope import Envelope
from celery_delayed.ops.drain import running_pollers
from celery_delayed.worker.broker import publish_args
from celery_delayed.store.inspection import UNREADABLE
from celery_delayed.store.layout import member_of
from celery_delayed.worker.once import DRAINED
from tasks import create_app

from .support import ROOT, SilentServer, environment, wait_for

DELAYED = {"COMPARE_SYSTEM": "celery-delayed"}


def drain(overrides: dict, *args: str, read: bool = True) -> subprocess.Popen:
    """``celery -A bench.compare_app delayed drain --to-broker --yes`` on the test's store; its output
    read by ``communicate`` (``read``), else dropped."""
    return subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.compare_app", "delayed", "drain",
                             "--to-broker", "--yes", *args], cwd=ROOT, env={**environment(overrides), **DELAYED},
                            stdout=subprocess.PIPE if read else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            text=True)


def schedule(app, run: str, dues_s: list[float]) -> list[str]:
    """``compare.noop`` tasks due at ``dues_s`` (epoch s, whole ms), stored by apply_many; their ids."""
    signatures = [app.signature("compare.noop", args=(run, round(due * 1000)),
                                eta=datetime.fromtimestamp(round(due * 1000) / 1000, timezone.utc))
                  for due in dues_s]
    return [result.id for result in apply_many(signatures, app=app)]


def claimed_by_a_dead_poller(store, dues_ms: list[int]) -> list[tuple[str, int, bytes]]:
    """Claim, as a poller would, the tasks due by now (they must be due at ``dues_ms``) and return them
    (id, due ms, message): they stay in flight, as the claim of a poller killed before it told the
    store that Kafka had them."""
    wait_for(lambda: store.now_ms() >= max(dues_ms), 30, "the tasks to be due")
    fences = [int(store.redis.get(store.keys.fence(p)) or 0) for p in range(store.settings.partitions)]
    return [item for p in range(store.settings.partitions) for item in store.claim(p, fences[p], limit=100).items]


def to_kafka(app, claimed: list[tuple[str, int, bytes]]) -> None:
    """Deliver claimed tasks to the Kafka topic of their queue, as their poller did before it died."""
    settings = app.amqp.delayed_settings
    producer = Producer(settings.kafka())
    for task_id, _, message in claimed:
        producer.produce(settings.topic(app.conf.task_default_queue), key=task_id, value=message)
    assert producer.flush(30) == 0


def broker_messages(broker: redis.Redis, queue: str) -> list[dict]:
    """The messages waiting in ``queue`` of Celery's Redis broker (kombu's JSON frames)."""
    return [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]


def test_a_drain_sends_every_task_to_a_plain_celery_worker_which_runs_each_once_at_its_eta(overrides, processes):
    """10,000 tasks stored by celery-delayed, drained to the broker, run by a worker of an app without
    celery-delayed: each once, none before its ETA, and the store is left empty."""
    app = compare_app.create_app("celery-delayed", **overrides)
    run, n = uuid.uuid4().hex, 10_000
    start = time.time() + 40
    ids = schedule(app, run, [start + 10 * i / n for i in range(n)])
    processes.app = "bench.compare_app"
    plain = processes.start("plain-worker", "worker", "-l", "INFO", "-Q", overrides["task_default_queue"], "-c", "2",
                            "--without-heartbeat", "--without-mingle", "--without-gossip",
                            env={"COMPARE_SYSTEM": "native"})
    wait_for(lambda: "ready." in processes.log(plain), 60, "the plain worker")
    drained = drain(overrides)
    out = drained.communicate(timeout=300)[0]
    assert drained.returncode == 0, out
    assert f"sent {n}," in out, out
    print(f"drained {n} tasks {start - time.time():.1f} s before the first was due")
    records = redis.Redis.from_url(compare_app.RECORDS)
    wait_for(lambda: records.hlen(f"compare:{run}:runs") == n, 180, lambda: f"{records.hlen(f'compare:{run}:runs')} "
             f"of {n} tasks run by the plain worker")
    time.sleep(2)  # a second run would come at once
    runs, lags, _ = compare_app.read_run(records, run)
    assert set(runs) == set(ids) and set(runs.values()) == {1}, "a task ran twice"
    assert min(lags) >= -50, f"a task ran {-min(lags)} ms before its ETA"
    assert sum(row["scheduled"] + row["inflight"] for row in store_of(app).counts()) == 0


def test_a_drain_is_refused_while_a_poller_runs_and_killed_at_any_point_loses_nothing(overrides, processes):
    """A drain refuses to run beside a poller; then, killed -9 part-way and run again, every task reaches
    the broker, at most the one being sent twice, as Celery itself would have sent it (same headers,
    body and properties, the ETA its due time); a task whose poller died while dispatching it is
    drained too."""
    overrides = {**overrides, "delayed_visibility_timeout": 1}
    app = compare_app.create_app("celery-delayed", **overrides)
    store = store_of(app)
    queue, run, n = overrides["task_default_queue"], uuid.uuid4().hex, 3_000
    broker = redis.Redis.from_url(app.conf.broker_url)
    ids = schedule(app, run, [time.time() + 3600 + i for i in range(n)])

    poller = processes.poller(overrides=overrides)
    wait_for(lambda: running_pollers(store), 60, "the poller to register in etcd")
    refused = drain(overrides)
    out = refused.communicate(timeout=120)[0]
    assert refused.returncode != 0 and "poller(s) running" in out, out
    assert broker.llen(queue) == 0, "a refused drain sent tasks"
    processes.warm_stop(poller)
    wait_for(lambda: not running_pollers(store), 30, "the stopped poller's etcd key to go")
    # claimed by a poller that died before Kafka had them: in flight, their claim lapsing in 1 s
    claimed = schedule(app, run, [time.time() + 1.8] * 5)
    time.sleep(2)
    fences = [int(store.redis.get(store.keys.fence(p)) or 0) for p in range(store.settings.partitions)]
    assert sum(len(store.claim(p, fences[p], limit=100).items) for p in range(store.settings.partitions)) == 5
    time.sleep(1.1)

    first = drain(overrides, read=False)
    wait_for(lambda: broker.llen(queue) >= n // 3, 120, "a third of the tasks on the broker")
    first.send_signal(signal.SIGKILL)
    first.wait()
    sent_before = broker.llen(queue)
    assert sent_before < n + 5, "the drain ended before it could be killed"
    again = drain(overrides)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out

    messages = broker_messages(broker, queue)
    sent = [m["headers"]["id"] for m in messages]
    assert set(sent) == set(ids + claimed), f"{len(set(ids + claimed) - set(sent))} tasks never reached the broker"
    twice = len(sent) - len(set(sent))
    print(f"killed -9 after {sent_before} sent; sent twice: {twice}")
    assert twice <= 1
    assert sum(row["scheduled"] + row["inflight"] for row in store.counts()) == 0

    # the message Celery sends for the same task, the same ETA, without celery-delayed
    drained = next(m for m in messages if m["headers"]["id"] == ids[0])
    due_ms = json.loads(base64.b64decode(drained["body"]))[0][1]
    plain = compare_app.create_app("native", **overrides)
    plain.signature("compare.noop", args=(run, due_ms), task_id=ids[0], queue=f"{queue}-ref",
                    eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc)).apply_async()
    reference = broker_messages(broker, f"{queue}-ref")[0]
    assert isinstance(drained["headers"].pop(DRAINED), int)  # an installed worker runs it once (see below)
    assert drained["headers"] == reference["headers"]
    assert drained["body"] == reference["body"]
    assert (drained["content-type"], drained["content-encoding"]) == (reference["content-type"],
                                                                      reference["content-encoding"])
    # per message (delivery_tag), per sending app (reply_to: the app's oid, which Celery leaves unused when
    # there is no result to wait for) or per queue (delivery_info: the reference went to another one)
    per_sender = ("delivery_tag", "reply_to", "delivery_info")
    properties = {k: v for k, v in drained["properties"].items() if k not in per_sender}
    assert properties == {k: v for k, v in reference["properties"].items() if k not in per_sender}
    assert drained["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}  # as Celery sends it:
    assert reference["properties"]["delivery_info"] == {"exchange": "", "routing_key": f"{queue}-ref"}
    broker.delete(queue, f"{queue}-ref")


def test_a_task_sent_to_a_queue_object_lands_in_its_queue_and_an_unreadable_message_is_left_and_named(overrides):
    """A task sent with ``queue=Queue(..., Exchange(topic))`` reaches its queue on a broker that has no
    binding for that exchange (as on a fresh broker), with Celery's ``expiration``; a stored message that
    cannot be decoded stops nothing: it is left in the store, and the drain names it."""
    app = compare_app.create_app("celery-delayed", **overrides)
    store, run = store_of(app), uuid.uuid4().hex
    broker = redis.Redis.from_url(app.conf.broker_url)
    queue = f"{overrides['task_default_queue']}-topic"
    topic = Queue(queue, Exchange(f"{queue}-x", type="topic"), routing_key="campaign.mail")
    due_ms = int((time.time() + 3600) * 1000)
    sent = app.signature("compare.noop", args=(run, due_ms)).apply_async(
        queue=topic, eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc), expires=7200)
    broken = schedule(app, run, [time.time() + 3600])[0]
    p, member = store.partition(broken), member_of(broken)
    stored = store.redis.hget(store.keys.msgs(p), member)
    head = stored[:len(stored) - len(store.message(broken))]  # its bucket start and lane kept
    store.redis.hset(store.keys.msgs(p), member, head + b"garbage")

    out = drain(overrides).communicate(timeout=120)[0]
    assert "sent 1," in out and "left 1" in out and broken in out, out
    messages = broker_messages(broker, queue)
    assert [m["headers"]["id"] for m in messages] == [sent.id], "the task did not reach its queue"
    assert 7100 * 1000 < int(messages[0]["properties"]["expiration"]) <= 7200 * 1000
    assert store.get(broken)["task"] == UNREADABLE and store.get(sent.id) is None
    broker.delete(queue)


def test_a_drain_sends_no_task_that_already_ran_from_kafka_and_settles_it(overrides, processes):
    """Tasks a poller delivered to Kafka but never acked (it died after the delivery): a worker ran
    the Kafka copies, so the drain that returns their lapsed claims to the schedule does not send
    them to the broker again (an installed worker reading it would run each a second time): it
    says they already ran and removes them from the store."""
    overrides = {**overrides, "delayed_visibility_timeout": 1}
    app = compare_app.create_app("celery-delayed", **overrides)
    store, run = store_of(app), uuid.uuid4().hex
    processes.app = "bench.compare_app"
    worker = processes.worker("w1", env=DELAYED)  # installed: reads Kafka and the broker queue
    wait_for(lambda: "ready." in processes.log(worker), 60, "the worker")
    due = time.time() + 1.5
    ids = schedule(app, run, [due] * 5)
    claimed = claimed_by_a_dead_poller(store, [round(due * 1000)])
    assert sorted(task_id for task_id, _, _ in claimed) == sorted(ids)
    to_kafka(app, claimed)
    records = redis.Redis.from_url(compare_app.RECORDS)
    wait_for(lambda: records.hlen(f"compare:{run}:runs") == 5, 60, "the worker to run the Kafka copies")
    time.sleep(1.1)  # the dead poller's claims lapse

    drained = drain(overrides)
    out = drained.communicate(timeout=120)[0]
    assert drained.returncode == 0, out
    time.sleep(5)  # a second run, from the broker, would come at once
    runs = compare_app.read_run(records, run)[0]
    assert runs == {task_id: 1 for task_id in ids}, f"ran twice: {[t for t, n in runs.items() if n > 1]}; {out}"
    assert "sent 0," in out and "already run 5," in out, out
    assert sum(row["scheduled"] + row["inflight"] for row in store.counts()) == 0


def test_an_installed_worker_runs_a_drained_broker_copy_only_if_its_task_neither_ended_nor_runs(
        overrides, processes):
    """A drained message that reaches the broker anyway (the drain checked just before a Kafka copy
    started): an installed worker does not run it while the Kafka copy runs, nor after it ended; a
    drained task that never ran runs once, and an ordinary broker task as ever."""
    overrides.update(delayed_run_lease=5)
    app = create_app(**overrides)
    store, run = store_of(app), uuid.uuid4().hex
    records = redis.Redis.from_url(app.conf.delayed_redis_url)
    runs = lambda task_id: int(records.hget(f"demo:{run}:runs", task_id) or 0)  # noqa: E731
    taken = {}
    for name, seconds in (("slow", 4.0), ("ended", 0.0), ("fresh", 0.0)):
        result = app.tasks["tasks.demo.work"].apply_async((run, seconds), countdown=3600)
        taken[name] = (result, Envelope.decode(store.message(result.id)))
        store.cancel(result.id)
    processes.worker("w1", "-c", "4")
    to_kafka(app, [(taken[name][0].id, 0, taken[name][1].encode()) for name in ("slow", "ended")])
    wait_for(lambda: runs(taken["slow"][0].id) and taken["ended"][0].ready(), 60, "the Kafka copies to run")

    with app.producer_or_acquire() as producer:  # what a drain sends
        for name in ("slow", "ended", "fresh"):
            now_ms = int(time.time() * 1000)
            producer.publish(**publish_args(app, taken[name][1], now_ms, now_ms))
    ordinary = app.tasks["tasks.demo.work"].apply_async((run,))
    assert taken["fresh"][0].get(timeout=60) and ordinary.get(timeout=60)
    assert taken["slow"][0].get(timeout=60)
    time.sleep(7)  # the slow task's claim lease and more: a waiting copy is checked again by then
    assert {name: runs(result.id) for name, (result, _) in taken.items()} == {"slow": 1, "ended": 1, "fresh": 1}
    assert runs(ordinary.id) == 1


def test_a_drain_to_a_broker_that_never_answers_ends_saying_so_and_changes_nothing(overrides):
    """A broker that accepts connections but never answers: the drain ends within bounded time with
    one line naming the broker (its password masked) and what is wrong, the store as it was."""
    overrides = {**overrides, "delayed_visibility_timeout": 1}
    app = compare_app.create_app("celery-delayed", **overrides)
    store, run = store_of(app), uuid.uuid4().hex
    schedule(app, run, [time.time() + 3600] * 3)
    due = time.time() + 1.5
    schedule(app, run, [due] * 2)
    assert len(claimed_by_a_dead_poller(store, [round(due * 1000)])) == 2
    time.sleep(1.1)  # their claims lapse: a drain would schedule them again
    before = store.counts()
    with SilentServer(limit_s=150) as silent:
        url = f"redis://:secret@127.0.0.1:{silent.port}/1"
        hung = drain({**overrides, "broker_url": url})
        try:
            out = hung.communicate(timeout=90)[0]
        finally:
            hung.kill()
    lines = out.strip().splitlines()
    assert hung.returncode != 0 and len(lines) == 1, out
    assert f"redis://:**@127.0.0.1:{silent.port}/1" in out and "does not answer" in out and "secret" not in out, out
    assert store.counts() == before
