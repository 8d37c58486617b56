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
from kombu import Exchange, Queue

from bench import compare_app
from celery_delayed import apply_many, store_of
from celery_delayed.ops.drain import running_pollers
from celery_delayed.store.inspection import UNREADABLE
from celery_delayed.store.layout import member_of

from .support import ROOT, environment, wait_for

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
