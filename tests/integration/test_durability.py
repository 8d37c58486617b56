"""Durability made explicit, on the real Redis: no evicting store, schedule writes that wait for replicas."""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest
import redis

from celery_delayed.poller.loop import Poller
from celery_delayed.settings import ConfigurationError, Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from celery_delayed.store.durability import preflight, worker_preflight
from celery_delayed.store.outcomes import StoreNotDurable

from .support import envelopes, own_redis, run_briefly
from .test_poller import now_ms


@contextmanager
def maxmemory_policy(url: str, policy: str) -> Iterator[None]:
    """This test stack's Redis with another maxmemory-policy, restored afterwards."""
    admin = redis.Redis.from_url(url)
    before = admin.config_get("maxmemory-policy")["maxmemory-policy"]
    admin.config_set("maxmemory-policy", policy)
    try:
        yield
    finally:
        admin.config_set("maxmemory-policy", before)


@pytest.mark.serial  # the shared Redis evicts meanwhile: every poller and worker started then would refuse it
def test_poller_and_worker_refuse_a_redis_that_evicts(overrides, processes):
    settings = Settings.from_conf(overrides)
    with maxmemory_policy(settings.redis_url, "allkeys-lru"):
        refused = run_briefly(Poller(settings))
        assert isinstance(refused, ConfigurationError)
        assert "may evict scheduled tasks when full (maxmemory-policy Redis: allkeys-lru)" in str(refused)
        with pytest.raises(ConfigurationError, match="delayed_allow_eviction = True"):
            worker_preflight(DelayedStore(settings))
        worker = processes.worker()
        assert worker.wait(timeout=60) != 0  # a real worker stops at start
        assert "may evict scheduled tasks" in processes.log(worker)
        preflight(DelayedStore(Settings.from_conf(overrides, allow_eviction=True)), "poller")  # allowed: starts
    preflight(DelayedStore(settings), "poller")  # noeviction again: starts


def test_a_redis_that_refuses_config_get_is_logged_as_unchecked(overrides, caplog):
    settings = Settings.from_conf(overrides)
    admin = redis.Redis.from_url(settings.redis_url)
    user, password = f"nocfg-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all", "-config"])
    try:
        limited = Settings.from_conf(overrides, redis_url=settings.redis_url.replace("//", f"//{user}:{password}@"))
        with caplog.at_level(logging.WARNING, logger="celery_delayed.store.durability"):
            preflight(DelayedStore(limited), "worker")
    finally:
        admin.acl_deluser(user)
    assert any("could not check the store's maxmemory-policy" in r.getMessage() for r in caplog.records)


def test_schedule_wait_for_no_replica_returns_at_once(overrides):
    store = DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=0,timeout=5"))
    started = time.monotonic()
    assert store.schedule_many(envelopes(10, "q", now_ms() + 60_000)) == 10
    assert time.monotonic() - started < 2


def test_schedule_wait_for_a_missing_replica_fails_after_its_timeout(overrides):
    store = DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=1,timeout=0.3"))
    assert store.redis.info("replication")["connected_slaves"] == 0
    started = time.monotonic()
    with pytest.raises(StoreNotDurable, match=r"not durable within 300 ms .* 0 of 1 replicas acknowledged it"):
        store.schedule_many(envelopes(10, "q", now_ms() + 60_000))
    took = time.monotonic() - started
    assert 0.25 <= took < 5, took
    assert store.get("task-0")["state"] == "scheduled"  # on the primary all the same, as the error says
    with pytest.raises(StoreNotDurable):  # also one task, as apply_async stores it
        store.schedule_many(envelopes(1, "q", now_ms() + 60_000, prefix="one"))


def test_a_dead_letter_waits_as_a_schedule_write_does(overrides):
    """Its message is settled (a Kafka offset committed, a claim acked) once it is parked: a
    failover that lost the letter would leave the task nowhere."""
    letters = DeadLetters(DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=1,timeout=0.3")))
    with pytest.raises(StoreNotDurable, match=r"not durable within 300 ms .* 0 of 1 replicas acknowledged it"):
        letters.add(DeadLetter(task_id="poison", reason="undecodable", source="worker", message=b"x"))
    assert letters.get("poison") is not None  # on the primary all the same
    DeadLetters(DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=0,timeout=5"))).add(
        DeadLetter(task_id="other", reason="undecodable", source="worker", message=b"x"))


def test_the_queue_controls_wait_as_a_schedule_write_does(overrides):
    """A pause, a resume and a rate were plain writes (review of stop 36): with its replica cut off, a
    pause returned at once, the primary was killed, and the promoted replica had no pause, so every
    poller would dispatch the queue.  They now wait for ``delayed_schedule_wait`` as tasks do, and
    say when they are not held."""
    strict = DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=1,timeout=0.3"))
    lax = DelayedStore(Settings.from_conf(overrides, schedule_wait="replicas=0,timeout=5"))
    with pytest.raises(StoreNotDurable, match=r"not durable within 300 ms .* 0 of 1 replicas acknowledged it"):
        strict.pause("bulk")
    assert "bulk" in lax.paused()  # on the primary all the same, as the error says
    for change in (lambda: strict.resume("bulk"), lambda: strict.set_rate("bulk", 5),
                   lambda: strict.set_rate("bulk", None)):
        with pytest.raises(StoreNotDurable, match=r"0 of 1 replicas acknowledged it"):
            change()
    assert lax.pause("bulk") and lax.queue_rates() == {}
    lax.set_rate("bulk", 5)
    assert lax.queue_rates() == {"bulk": 5.0} and lax.resume("bulk")


def test_schedule_wait_for_the_aof_says_which_redis_it_needs(overrides):
    store = DelayedStore(Settings.from_conf(overrides, schedule_wait="aof"))
    version = store.redis.info("server")["redis_version"]
    if tuple(map(int, version.split(".")[:2])) >= (7, 2):
        pytest.skip(f"Redis {version} has WAITAOF: the refusal on older ones cannot be shown here")
    with pytest.raises(ConfigurationError, match=rf"needs WAITAOF, new in Redis 7.2; the store's Redis is {version}"):
        store.schedule_many(envelopes(1, "q", now_ms() + 60_000))
    assert store.get("task-0") is None  # refused before anything was written


def test_a_pipeline_of_scripts_asks_no_script_exists_and_a_script_the_redis_lost_runs_once(overrides, tmp_path):
    """A standalone pipeline of scripts is sent as EVALSHAs alone (no SCRIPT EXISTS round trip before
    each); after the Redis lost its scripts (a restart), those it refused are loaded and sent again, each
    once, with the wait for replicas that followed them (``delayed_schedule_wait``)."""
    with own_redis(tmp_path / "redis") as client:
        port = client.connection_pool.connection_kwargs["port"]
        store = DelayedStore(Settings.from_conf({**overrides, "delayed_redis_url": f"redis://127.0.0.1:{port}/0",
                                                 "delayed_schedule_wait": "replicas=0"}))
        due = now_ms() + 60_000
        assert store.schedule_many(envelopes(50, "q", due, prefix="before")) == 50
        client.script_flush()
        client.config_resetstat()
        assert store.schedule_many(envelopes(3000, "q", due)) == 3000  # a second run of any script would count 0
        stats = client.info("commandstats")
        assert "cmdstat_script|exists" not in stats
        assert stats["cmdstat_wait"]["calls"] >= 2  # each pipeline's, and the one sent again after the scripts
        assert sum(r["scheduled"] for r in store.counts()) == 3050
