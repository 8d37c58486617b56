"""Queues at fire time (issue 29): a paused queue's tasks stay in the store until it is resumed,
whatever happens to the pollers meanwhile, while every other queue goes on."""
from __future__ import annotations

import os
import signal
import time

import pytest

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore

from .support import TopicReader, envelopes, leaders, wait_for
from .test_poller import now_ms

pytestmark = pytest.mark.cluster_too


def test_a_paused_queue_gives_no_task_and_no_due_time_to_a_claim_until_it_is_resumed(overrides):
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    assert store.pause("bulk") and not store.pause("bulk")  # paused once, since the first time
    store.schedule_many(envelopes(50, "bulk", now - 60_000, prefix="bulk"))
    store.schedule_many(envelopes(2, "other", now - 1000, prefix="other"))
    store.schedule_many(envelopes(1, "other", now + 60_000, prefix="later"))

    claim = store.claim(0, token=1, limit=100, paused=store.paused())
    assert sorted(item[0] for item in claim.items) == ["other-0", "other-1"]
    assert claim.next_due_ms == now + 60_000  # not bulk's overdue tasks: the poller may sleep till then
    rows = {row["queue"]: row for row in store.queues()}
    assert rows["bulk"]["overdue"] == 50 and rows["bulk"]["paused_since_ms"] is not None
    assert rows["other"] == {"queue": "other", "overdue": 0, "next_due_ms": now + 60_000, "paused_since_ms": None}

    assert store.resume("bulk") and not store.resume("bulk")
    claim = store.claim(0, token=1, limit=100, paused=store.paused())
    assert sorted(item[0] for item in claim.items) == sorted(f"bulk-{i}" for i in range(50))
    with pytest.raises(ValueError, match="a queue to pause must be a name of 1 to 255 bytes"):
        store.pause("")


def test_a_task_due_soonest_in_its_queue_wakes_the_pollers_even_behind_a_paused_queues_overdue_tasks(overrides):
    """A poller sleeps until its partitions' next due time, paused queues left out, so a task due sooner
    than everything in its own queue must wake it, even when a paused queue's task is due sooner still."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    store.pause("bulk")
    store.schedule_many(envelopes(5, "bulk", now - 60_000, prefix="bulk"))
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.wake)
    wait_for(lambda: pubsub.get_message(timeout=0.1) is None, 5, "the subscription")
    store.schedule_many(envelopes(1, "other", now + 2000, prefix="other"))
    message = wait_for(lambda: pubsub.get_message(timeout=0.5), 5, "the wake-up")
    assert int(message["data"]) == now + 2000
    pubsub.close()


@pytest.mark.timeout(240)
def test_a_paused_queue_stays_in_the_store_through_a_poller_kill_and_a_restart_then_goes_once(overrides, processes):
    """Two pollers lead the partitions; a queue is paused; one poller is killed (-9) and its standby takes
    over, then that one is stopped and a new one leads: the paused queue's due tasks stay in the store all
    along (0 records on its topic) while another queue's go; resumed, each is on its topic once."""
    overrides.update(delayed_partitions=4)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue, bulk = overrides["task_default_queue"], f"{overrides['task_default_queue']}-bulk"
    held, other = TopicReader(settings, settings.topic(bulk)), TopicReader(settings, settings.topic(queue))
    assert store.pause(bulk)
    first, second = processes.poller(), processes.poller("poller2")
    wait_for(lambda: set(leaders(settings).values()) == {first.pid, second.pid}, 30, "both pollers to lead")
    store.schedule_many(envelopes(300, bulk, now_ms(), prefix="bulk"))
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="before"))
    assert len(other.read_until(20, timeout=30)) == 20

    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: set(leaders(settings).values()) == {second.pid} and len(leaders(settings)) == 4,
             settings.lease_ttl + 10, "the standby to take the killed poller's partitions")
    processes.warm_stop(second)
    third = processes.poller("poller3")
    wait_for(lambda: set(leaders(settings).values()) == {third.pid} and len(leaders(settings)) == 4,
             settings.lease_ttl + 10, "a new poller to lead every partition")
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="after"))
    assert len(other.read_until(40, timeout=30)) == 40
    time.sleep(2)
    held.read(timeout=1)
    assert not held.keys, f"{len(held.keys)} tasks of the paused queue reached its topic"
    assert {row["queue"]: row["overdue"] for row in store.queues()}[bulk] == 300

    assert store.resume(bulk)
    keys = held.read_until(300, timeout=60)
    held.read(timeout=1)  # a copy sent twice would be there by now
    assert len(keys) == 300 and set(keys.values()) == {1}, (len(keys), max(keys.values(), default=0))
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 30, "the store to be empty")
    held.close()
    other.close()
