"""The store's scripts on a Redis Cluster slot being migrated (issue 41, item 9).

While a slot is MIGRATING, its node runs a script on the slot's keys only while it holds
every key the script declares, and a command inside the script on a key the node does not
hold (moved on, or deleted by the script itself) fails the script midway, its earlier writes
kept.  A script must then change nothing or leave every task where a claim finds it.

Each test starts a cluster of its own (3 primaries, no replica, in ``tmp_path``): migrating
a slot of the shared cluster would disturb the tests using that slot at the same time (every
test's partition 0 is the slot of ``{0}``).  Keys stay on the source node: the slot is left
MIGRATING for a few calls, then made STABLE again.
"""
from __future__ import annotations

import dataclasses
import subprocess
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import redis

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.layout import member_of
from celery_delayed.store.outcomes import Change, StoreUnavailable
from tasks.processes import free_port, wait_for

from .support import answers, envelopes

HOUR = 3_600_000


@pytest.fixture
def cluster(tmp_path) -> Iterator[str]:
    """A Redis Cluster of 3 primaries of this test's own, on free ports; its URL.  Killed by PID after."""
    ports, servers = [free_port() for _ in range(3)], []
    try:
        for port in ports:
            (tmp_path / str(port)).mkdir()
            servers.append(subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--cluster-port", str(free_port()),
                 "--cluster-enabled", "yes", "--dir", str(tmp_path / str(port)), "--save", "",
                 "--logfile", str(tmp_path / f"{port}.log")]))
        clients = [redis.Redis(port=port) for port in ports]
        wait_for(lambda: all(answers(client) for client in clients), 30, "the nodes to answer")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_for(lambda: all(client.cluster("info")["cluster_state"] == "ok" for client in clients), 30,
                 "cluster_state:ok on every node")
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for server in servers:
            server.kill()
            server.wait()


@pytest.fixture
def store(cluster) -> DelayedStore:
    """A store of one partition (its keys: the slot of ``{0}``), every key its scripts declare present:
    while the slot migrates, a script declaring a key its node lacks is refused before it runs."""
    store = DelayedStore(Settings.from_mapping({"redis_url": cluster, "redis_cluster": True, "partitions": 1,
                                                "key_prefix": "m", "visibility_timeout": 1}))
    far = store.now_ms() + 9 * HOUR
    store.schedule("unqueued", far, b"not an envelope")  # lane "": the partition's own bucket index
    store.schedule_many(envelopes(1, "q", far + HOUR, prefix="retried"), attempt=1)  # the attempt HASH
    store.redis.zadd(store.keys.failing(0), {member_of("retried-0"): far})  # the failing ZSET, as a nack leaves it
    store.schedule_many(envelopes(1, "q", store.now_ms() - 1000, prefix="flying"))
    assert [item[0] for item in store.claim(0, token=1, limit=10).items] == ["flying-0"]  # inflight
    return store


@contextmanager
def migrating(store: DelayedStore) -> Iterator[Callable[[str], None]]:
    """The slot of partition 0 MIGRATING from its node to another (IMPORTING there), its keys left on
    the source but those given to the function yielded, which moves a key to the target (MIGRATE);
    after, those come back and the slot is STABLE again on both nodes."""
    slot = store.redis.keyslot(store.keys.msgs(0))
    source = store.redis.get_node_from_key(store.keys.msgs(0))
    target = next(node for node in store.redis.get_primaries() if node.name != source.name)
    src, dst = redis.Redis(source.host, source.port), redis.Redis(target.host, target.port)
    moved = []

    def move(key: str) -> None:
        src.execute_command("MIGRATE", target.host, target.port, key, 0, 5000)
        moved.append(key)

    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.execute_command("CLUSTER", "MYID"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.execute_command("CLUSTER", "MYID"))
        yield move
    finally:
        src.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        for key in moved:  # back from the target, its slot still open, to the node owning the slot again
            dst.execute_command("MIGRATE", source.host, source.port, key, 0, 5000)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


def claimed(store: DelayedStore) -> list[str]:
    return sorted(item[0] for item in store.claim(0, token=1, limit=100).items)


def test_a_task_rescheduled_out_of_a_bucket_it_was_alone_in_is_dispatched_at_its_new_time(store):
    """Taking the task out emptied (deleted) its bucket, which the script then read again: it
    failed with the task in no bucket, never dispatched (review of issue 41, item 9)."""
    now = store.now_ms()
    store.schedule_many([*envelopes(1, "q", now + HOUR, prefix="alone"), *envelopes(1, "q", now - 1000)])
    with migrating(store):
        assert store.reschedule_many([("alone-0", now - 1000)]) == {"alone-0": Change.DONE}  # to "task-0"'s bucket
    assert claimed(store) == ["alone-0", "task-0"]


def test_a_task_cancelled_out_of_a_bucket_it_was_alone_in_is_gone(store):
    """A cancel also writes what it removed under a key of its request (``lua/cancel.lua``: a lost reply
    is answered from it), a key the migrating node does not hold: Redis may refuse the script before it
    runs.  Refused, it is refused whole, the task untouched, and goes through once the slot is stable;
    run, it leaves the task in no bucket behind."""
    store.schedule_many(envelopes(1, "q", store.now_ms() + HOUR, prefix="alone"))
    with migrating(store):
        try:
            cancelled = store.cancel("alone-0")
        except StoreUnavailable:
            cancelled = None
    if cancelled is None:
        assert store.get("alone-0")["state"] == "scheduled"  # nothing half-done
        cancelled = store.cancel("alone-0")
    assert cancelled is Change.DONE
    assert store.get("alone-0") is None and store.counts()[0]["scheduled"] == 2  # "unqueued", "retried"


def test_a_retry_moving_tasks_out_of_two_buckets_leaves_none_in_its_old_bucket(store):
    """The moves emptied the first old bucket, read again before the second was left: the
    third task stayed in its old bucket too, to be sent at its old time."""
    now = store.now_ms()
    store.schedule_many([*envelopes(2, "q", now + HOUR, prefix="x"), *envelopes(2, "q", now + 3 * HOUR, prefix="z"),
                         *envelopes(1, "q", now + 2 * HOUR)])
    retries = [(task_id, now + 2 * HOUR, data)
               for task_id, _, data in [*envelopes(2, "q", 0, prefix="x"), *envelopes(1, "q", 0, prefix="z")]]
    with migrating(store):
        assert store.schedule_many(retries, attempt=1) == 3
    bucket = store.redis.zrange(store.keys.bucket(0, (now + 3 * HOUR) // 10_000 * 10, "q"), 0, -1)
    assert bucket == [b"z-1"]


def test_a_claim_whose_lapsed_claims_emptied_inflight_leaves_them_to_a_later_claim(store):
    """The lapsed claim went back to a bucket and left inflight, emptying it; the claim took it out
    of the bucket again, then could not add it to inflight (a key no longer on the node): the
    task was in neither.  It now enters inflight first, and so stays in its bucket."""
    time.sleep(1.2)  # past the claim of "flying-0"
    keep_buckets(store, store.now_ms())
    with migrating(store), pytest.raises(redis.ResponseError, match="non local key"):
        store.claim(0, token=1, limit=100)
    assert "flying-0" in claimed(store)


def test_a_claim_emptying_a_bucket_returns_its_tasks(store):
    """Taking a bucket's last tasks deleted it, which the claim then read again: it failed, its
    tasks in flight but not sent until that claim lapsed."""
    longer = DelayedStore(dataclasses.replace(store.settings, visibility_timeout=3600))
    store.schedule_many(envelopes(1, "q", store.now_ms() - 1000, prefix="held"))
    assert "held-0" in claimed(longer)  # in flight for an hour: the claim below finds no lapsed claim
    store.schedule_many(envelopes(1, "q", store.now_ms() - 1000))
    with migrating(store):
        assert claimed(store) == ["task-0"]


def test_a_nack_that_emptied_inflight_returns_its_tasks_without_failing(store):
    """Returning the first task emptied inflight, which the script then read again for the second."""
    now = store.now_ms()
    keep_buckets(store, now + HOUR)
    (flying, stamp), = store.lapsed_claims(0, now + HOUR)
    with migrating(store):
        assert store.nack(0, [(flying, stamp), ("unclaimed", stamp)], delay_ms=HOUR) == 1
    assert store.get(flying)["state"] == "scheduled" and store.get(flying)["due_ms"] >= now + HOUR


def test_a_nack_cut_short_by_a_lane_index_moved_on_leaves_its_task_in_flight_alone(store):
    """A migration moves a slot's keys one by one: a lane's bucket index may be gone from the node
    while its buckets are still there.  The task went into its bucket, then the index failed: it was
    in flight and also in a bucket, to be claimed twice."""
    now = store.now_ms()
    keep_buckets(store, now + HOUR)
    (flying, stamp), = store.lapsed_claims(0, now + HOUR)
    with migrating(store) as move:
        move(store.keys.buckets(0, "q"))
        with pytest.raises(redis.ResponseError, match="non local key"):
            store.nack(0, [(flying, stamp)], delay_ms=HOUR)
    assert store.get(flying)["state"] == "inflight"
    buckets = {store.keys.bucket(0, (now + HOUR + i * 10_000) // 10_000 * 10, "q") for i in range(4)}
    assert [key for key in buckets if store.redis.zscore(key, flying) is not None] == []


def keep_buckets(store: DelayedStore, start_ms: int) -> None:
    """A task in each bucket of the 30 s from ``start_ms``: a script putting a task in the bucket of a
    time within them (a lapsed claim's, a nack's) finds its key on the node."""
    store.schedule_many((f"keeper-{i}", start_ms + i * 10_000, data)
                        for i, (_, _, data) in enumerate(envelopes(4, "q", 0)))
