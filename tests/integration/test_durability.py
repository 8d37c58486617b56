"""Durability made explicit, on the real Redis: no evicting store."""
from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest
import redis

from celery_delayed.durability import preflight, worker_preflight
from celery_delayed.poller import Poller
from celery_delayed.settings import ConfigurationError
from celery_delayed.store import DelayedStore

from .support import run_briefly
from .test_poller import settings_for


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


def test_poller_and_worker_refuse_a_redis_that_evicts(overrides, processes):
    settings = settings_for(overrides)
    with maxmemory_policy(settings.redis_url, "allkeys-lru"):
        refused = run_briefly(Poller(settings))
        assert isinstance(refused, ConfigurationError)
        assert "may evict scheduled tasks when full (maxmemory-policy Redis: allkeys-lru)" in str(refused)
        with pytest.raises(ConfigurationError, match="delayed_allow_eviction = True"):
            worker_preflight(DelayedStore(settings))
        worker = processes.worker()
        assert worker.wait(timeout=60) != 0  # a real worker stops at start
        assert "may evict scheduled tasks" in processes.log(worker)
        preflight(DelayedStore(settings_for(overrides, allow_eviction=True)), "poller")  # allowed: starts
    preflight(DelayedStore(settings), "poller")  # noeviction again: starts


def test_a_redis_that_refuses_config_get_is_logged_as_unchecked(overrides, caplog):
    settings = settings_for(overrides)
    admin = redis.Redis.from_url(settings.redis_url)
    user, password = f"nocfg-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all", "-config"])
    try:
        limited = settings_for(overrides, redis_url=settings.redis_url.replace("//", f"//{user}:{password}@"))
        with caplog.at_level(logging.WARNING, logger="celery_delayed.durability"):
            preflight(DelayedStore(limited), "worker")
    finally:
        admin.acl_deluser(user)
    assert any("could not check the store's maxmemory-policy" in r.getMessage() for r in caplog.records)
