"""What only a Redis Cluster can get wrong: where keys live, scripts a node lost, wake-ups across nodes.

The general store tests also run on the cluster (``cluster_too`` modules); these
look at the cluster itself, through direct connections to its nodes.
"""
from __future__ import annotations

import time
import uuid
from collections import defaultdict

import pytest
import redis

from celery_delayed import store_of
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from celery_delayed.store.outcomes import StoreNotDurable
from tasks import create_app

from .support import envelopes, wait_for, wait_for_wake_up


pytestmark = pytest.mark.parametrize("store_redis", ["cluster"], indirect=True)


@pytest.fixture
def store(overrides) -> DelayedStore:
    return DelayedStore(Settings.from_conf(overrides, partitions=16))


def nodes(store: DelayedStore) -> dict[int, redis.Redis]:
    """A plain client of each primary, by port: what a node holds, asked of that node alone."""
    return {node.port: redis.Redis(node.host, node.port) for node in store.redis.get_primaries()}


def test_a_partitions_keys_live_on_one_node_and_partitions_use_every_node(store):
    store.schedule_many(envelopes(400, "q", store.now_ms() - 1000))
    for p in range(16):
        store.claim(p, token=1, limit=5)  # adds the inflight, fence, stamp, claim and handover keys
    where: dict[int, set[int]] = defaultdict(set)
    names: dict[int, set[str]] = defaultdict(set)
    for port, client in nodes(store).items():
        for key in client.scan_iter(match=f"{store.settings.key_prefix}:{{*", count=1000):  # not the layout key
            p = int(key.decode().split("{")[1].split("}")[0])
            where[p].add(port)
            names[p].add(key.decode().split("}:", 1)[1].split(":")[0])
    assert sorted(where) == list(range(16))
    assert all(len(ports) == 1 for ports in where.values()), dict(where)
    assert all(kinds == {"t", "buckets", "lanes", "msg", "inflight", "fence", "stamp", "claim", "handover"}
               for kinds in names.values()), dict(names)
    assert {port for ports in where.values() for port in ports} == set(nodes(store))


@pytest.mark.serial  # flushes the shared cluster's scripts: another test's pipeline would meet NOSCRIPT
def test_scripts_a_node_lost_are_loaded_again_and_each_runs_once(store):
    """A restarted or failed-over node has no scripts: the pipelined calls it refused are sent again, alone."""
    due = store.now_ms() + 60_000
    assert store.schedule_many(envelopes(50, "q", due, prefix="before")) == 50
    for client in nodes(store).values():
        client.script_flush()
    assert store.schedule_many(envelopes(3000, "q", due)) == 3000  # a second run of any script would count 0
    assert sum(r["scheduled"] for r in store.counts()) == 3050
    for client in nodes(store).values():
        client.script_flush()
    removed = store.cancel_many(f"before-{i}" for i in range(50))
    assert all(isinstance(envelope, bytes) for envelope in removed.values()) and len(removed) == 50


def test_a_wake_up_published_on_one_node_reaches_a_subscriber_on_another(store):
    store.schedule_many(envelopes(2, "q", store.now_ms() + 60_000))
    home = store.redis.get_node_from_key(store.keys.buckets(store.partition("task-1")))
    other = next(node for node in store.redis.get_primaries() if node.name != home.name)
    pubsub = store.redis.pubsub(node=other, ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.wake)
    soon = store.now_ms() + 5000
    store.reschedule("task-1", soon)  # PUBLISH inside the script, on the partition's node
    wait_for_wake_up(pubsub, soon)
    pubsub.close()


def test_tasks_scheduled_on_the_cluster_are_dispatched_and_run_once(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    run = uuid.uuid4().hex
    results = [app.tasks["tasks.demo.work"].apply_async((run,), countdown=2) for _ in range(24)]
    assert {store.get(r.id)["partition"] for r in results} == set(range(overrides["delayed_partitions"]))
    processes.poller()
    processes.worker("w1")
    ids = {r.id for r in results}
    wait_for(lambda: set(store.redis.hkeys(f"demo:{run}:runs")) >= {i.encode() for i in ids}, 90,
             "every task to run")
    time.sleep(2)  # a duplicate would show up by now
    runs = {k.decode(): int(v) for k, v in store.redis.hgetall(f"demo:{run}:runs").items()}
    assert runs == dict.fromkeys(ids, 1)
    assert sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0


def test_schedule_wait_waits_for_each_written_primarys_replica(overrides):
    """``delayed_schedule_wait`` on a cluster: every primary has one replica, so replicas=1 is met on all
    of them and replicas=2 on none (a wait that went to a node without those writes would pass at once)."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=16, schedule_wait="replicas=1,timeout=2"))
    assert store.schedule_many(envelopes(300, "q", store.now_ms() + 60_000)) == 300
    strict = DelayedStore(Settings.from_conf(overrides, partitions=16, schedule_wait="replicas=2,timeout=0.3"))
    started = time.monotonic()
    with pytest.raises(StoreNotDurable, match=r"not durable within 300 ms .* 1 of 2 replicas acknowledged it"):
        strict.schedule_many(envelopes(10, "q", store.now_ms() + 60_000, prefix="strict"))
    assert time.monotonic() - started >= 0.3
    # the tasks are on the primaries, as the error says, and scheduling them again keeps one copy
    assert sum(r["scheduled"] for r in store.counts()) == 310
    DeadLetters(store).add(DeadLetter(task_id="poison", reason="undecodable", source="worker", message=b"x"))
    with pytest.raises(StoreNotDurable, match=r"1 of 2 replicas acknowledged it"):  # waited on the {dlq} node
        DeadLetters(strict).add(DeadLetter(task_id="poison", reason="undecodable", source="worker", message=b"x"))
    assert store.pause("q") and store.resume("q")  # on the primary holding the controls, with its replica
    with pytest.raises(StoreNotDurable, match=r"1 of 2 replicas acknowledged it"):
        strict.pause("q")
