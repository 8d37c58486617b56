"""Fencing when etcd loses its history, and a fenced leader resigning, on real etcd, Redis and Kafka."""
from __future__ import annotations

import time

import pytest

from celery_delayed.poller.leadership import EPOCH_SCALE, Leadership, make_etcd
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore

from .support import ETCD3_ENDPOINTS, TopicReader, envelopes, leaders, wait_for
from .test_poller import leading_one_partition, now_ms


@pytest.mark.parametrize("service", ["etcd", "etcd3"])
def test_etcd_wiped_dispatch_resumes_under_a_new_fencing_epoch(overrides, processes, servers, service):
    """etcd (the single member, or every member of the 3-member cluster) recreated without its data."""
    servers.require_ours(service)
    if service == "etcd3":
        overrides.update(delayed_etcd_endpoints=ETCD3_ENDPOINTS)
    settings = Settings.from_conf(overrides)  # lease TTL 2 s, 4 partitions
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    etcd = make_etcd(settings)
    for i in range(200):  # revisions well above what the empty etcd will reach during this test
        etcd.put(f"/{settings.key_prefix}/filler", str(i))
    poller = processes.poller()
    wait_for(lambda: len(leaders(settings)) == settings.partitions, 30, "the poller to lead")
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="before"))
    assert len(reader.read_until(20, timeout=30)) == 20
    fences = store.fences()
    assert min(fences) > 200 and max(fences) < EPOCH_SCALE, fences  # claimed under epoch 0, high revisions

    led = processes.log(poller).count("leads partitions")
    servers.wipe(service)
    back = time.monotonic()
    # the poller leads again in the empty etcd (and says so), so its old tokens are out of use
    wait_for(lambda: len(leaders(settings)) == settings.partitions
             and processes.log(poller).count("leads partitions") > led, settings.lease_ttl + 20,
             "the poller to lead in the empty etcd")
    store.schedule_many(envelopes(50, queue, now_ms(), prefix="after"))
    wait_for(lambda: reader.read(timeout=0.2) is not None and sum(k.startswith("after") for k in reader.keys) == 50,
             settings.lease_ttl + 20, "the tasks due after the wipe on Kafka")
    took = time.monotonic() - back
    reader.close()
    print(f"\ndispatch resumed {took:.2f} s after etcd came back empty (lease TTL {settings.lease_ttl} s)")
    assert took < settings.lease_ttl + 10
    assert all(fence // EPOCH_SCALE == 1 for fence in store.fences() if fence)  # the new epoch's tokens
    assert "etcd lost its data or was restored from a backup; started fencing epoch 1" in processes.log(poller)
    assert poller.poll() is None


def test_fenced_leader_gives_its_key_up_to_a_standby(overrides):
    settings, store, old, old_token, poller = leading_one_partition(overrides)
    standby = Leadership(settings)
    assert standby.step() == {}  # partition 0 is taken
    make_etcd(settings).put(f"/{settings.key_prefix}/filler", "x")  # etcd's revision is past old_token now
    store.claim(0, old_token + 1, 0)  # a newer leader of the same etcd claimed, as after a missed expiry

    assert poller.tick() == 0  # refused...
    assert poller.stats["fenced"] == 1
    assert store.get("task-0")["state"] == "scheduled"
    assert leaders(settings) == {}  # ...and its leader key is gone, not held until its lease ends
    (new_token,) = standby.step().values()
    assert new_token > old_token + 1
    assert store.claim(0, new_token, 1).items  # the standby dispatches
    standby.release()
    old.release()
