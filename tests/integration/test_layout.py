"""The store's recorded layout: a process with another partition count is refused before it changes anything."""
from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest
import redis

from celery_delayed import store_of
from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore, LayoutMismatch
from celery_delayed.store.durability import preflight

from tasks import create_app

from .support import envelopes, run_briefly
from .test_cli import celery
from .test_poller import now_ms

pytestmark = pytest.mark.cluster_too


def scheduled_with_four_partitions(overrides: dict) -> DelayedStore:
    store = DelayedStore(Settings.from_conf(overrides, partitions=4))
    assert store.schedule_many(envelopes(20, overrides["task_default_queue"], now_ms() + 60_000)) == 20
    return store


def test_store_with_another_partition_count_is_refused_and_changes_nothing(overrides):
    store = scheduled_with_four_partitions(overrides)
    layout = store.redis.get(store.keys.layout)
    other = DelayedStore(Settings.from_conf(overrides, partitions=2))
    for attempt in (lambda: other.schedule_many(envelopes(5, "q", now_ms(), prefix="new")),
                    lambda: other.cancel("task-0"), other.counts, lambda: other.reschedule("task-1", now_ms())):
        with pytest.raises(LayoutMismatch, match=r"laid out with delayed_partitions=4 \(this process: 2\)"):
            attempt()
    refused = run_briefly(Poller(Settings.from_conf(overrides, partitions=2)))  # refused before leading anything
    assert isinstance(refused, LayoutMismatch) and "drain the store" in str(refused)
    assert str(refused).endswith("(docs/operations.md: Changing the store layout)")  # where that section is
    assert sum(r["scheduled"] for r in store.counts()) == 20
    assert store.get("task-0")["state"] == "scheduled" and store.get("new-0") is None
    assert store.redis.get(store.keys.layout) == layout == b"partitions=4 bucket_seconds=10 format=2"


def test_cli_with_another_partition_count_prints_one_line(overrides):
    scheduled_with_four_partitions(overrides)
    for command in (["status"], ["poller"], ["cancel", "task-0"]):
        done = celery(overrides, "delayed", *command, DELAYED_PARTITIONS="2")
        assert done.returncode != 0, command
        assert "Traceback" not in done.stderr
        (line,) = [line for line in done.stderr.splitlines() if line.strip()]
        assert line.startswith("Error: the delayed store") and "delayed_partitions=4 (this process: 2)" in line
    assert celery(overrides, "delayed", "status", "--json").returncode == 0  # the right setting still works


def test_poller_on_a_prefix_nothing_was_scheduled_under_says_so(overrides, caplog):
    store = DelayedStore(Settings.from_conf(overrides))
    with caplog.at_level(logging.WARNING, logger="celery_delayed.store.durability"):
        preflight(store, "poller")
        preflight(DelayedStore(store.settings), "poller")  # the layout exists now: no second warning
    assert [r.getMessage() for r in caplog.records if "nothing was ever scheduled" in r.getMessage()] == [
        f"nothing was ever scheduled under delayed_key_prefix {store.settings.key_prefix!r} in this Redis (its "
        "layout is new): if your clients use another prefix, this poller dispatches none of their tasks"]


def restore(client: redis.Redis, prefix: str, keys: dict) -> None:
    """Write keys saved as ``{name after the prefix: {type, value}}`` (bytes in base64) under ``prefix``."""
    b = base64.b64decode
    for name, saved in keys.items():
        key, value = prefix + name, saved["value"]
        if saved["type"] == "string":
            client.set(key, b(value))
        elif saved["type"] == "hash":
            client.hset(key, mapping={b(field): b(v) for field, v in value.items()})
        elif saved["type"] == "zset":
            client.zadd(key, {b(member): score for member, score in value})
        else:
            client.sadd(key, *(b(member) for member in value))


def test_a_process_of_the_format_before_lanes_is_refused_by_a_store_of_lanes(overrides, monkeypatch):
    """A poller of format 1 would never dispatch a task of a named lane: once the store is format 2, a
    process of format 1 is refused, naming the format, and the layout stays."""
    store = DelayedStore(Settings.from_conf(overrides))
    store.schedule_many(envelopes(3, "q", now_ms()))
    monkeypatch.setattr("celery_delayed.store.delayed.LAYOUT_FORMAT", 1)
    with pytest.raises(LayoutMismatch, match=r"format=2 \(this process: 1\)"):
        DelayedStore(Settings.from_conf(overrides)).counts()
    assert store.redis.get(store.keys.layout).endswith(b" format=2")


@pytest.mark.cluster_too
def test_a_store_of_format_1_is_read_as_it_is_and_each_of_its_tasks_runs_beside_new_ones(overrides, processes):
    """A store written by 0.1.0 (layout format 1, before lanes and the layout by hop; its keys as Redis
    held them, through apply_async, a replace-by-key, a task id that is not a UUID and apply_many) is
    read as it is, its layout recorded as format 2 on first use, and every task in it runs, with tasks
    stored since in their queue's lane."""
    saved = json.loads((Path(__file__).parent / "data" / "store-0.1.0.json").read_text())
    overrides["task_default_queue"] = saved["queue"]  # the queue its tasks were sent to; topics stay this test's
    app = create_app(**overrides)
    store = store_of(app)
    restore(store.redis, overrides["delayed_key_prefix"], saved["keys"])
    assert store.redis.get(store.keys.layout).endswith(b" format=1")
    expected = {**{f"00000000-0000-4000-8000-00000000000{i}": 2 * i for i in range(4)},
                "keyed-task": 20, "not-a-uuid-id": 22, **{f"bulk-{i}": 40 + 2 * i for i in range(3)}}
    assert sum(c["scheduled"] for c in store.counts()) == len(expected)
    assert store.redis.get(store.keys.layout).endswith(b" format=2")
    new = app.tasks["tasks.demo.add"].apply_async((50, 50), countdown=3600)
    p = store.partition(new.id)
    assert store.redis.zscore(store.keys.lanes(p), saved["queue"]) == store.get(new.id)["due_ms"]
    expected[new.id] = 100
    assert {task_id: (t["task"], t["queue"], t["state"]) for task_id in expected if (t := store.get(task_id))} == {
        task_id: ("tasks.demo.add", saved["queue"], "scheduled") for task_id in expected}
    assert store.key_holder("fixture-key") == "keyed-task"
    for task_id in expected:  # the ids are the saved store's: a result of an earlier run must not answer
        app.AsyncResult(task_id).forget()
    store.reschedule_many([(task_id, store.now_ms()) for task_id in expected])
    processes.poller()
    processes.worker("w1")
    assert {task_id: app.AsyncResult(task_id).get(timeout=90) for task_id in expected} == expected
    assert sum(c["scheduled"] for c in store.counts()) == 0

