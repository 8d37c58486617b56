"""The store's recorded layout: a process with another partition count is refused before it changes anything."""
from __future__ import annotations

import logging

import pytest

from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore, LayoutMismatch
from celery_delayed.store.durability import preflight

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
    assert sum(r["scheduled"] for r in store.counts()) == 20
    assert store.get("task-0")["state"] == "scheduled" and store.get("new-0") is None
    assert store.redis.get(store.keys.layout) == layout == b"partitions=4 bucket_seconds=10 format=1"


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
