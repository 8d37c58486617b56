"""Start-up checks that keep scheduled tasks from being lost in the store's Redis, run by the
poller and the workers (the writes that wait for replicas or the AOF are the store's own:
:class:`.delayed.DurableWrites`):

- The layout (partitions, bucket width, format) must be the one the store was
  written with (:meth:`DelayedStore.check_layout`).
- Redis must not evict keys: under ``maxmemory`` with any policy but
  ``noeviction`` it silently drops scheduled tasks to make room, where
  ``noeviction`` refuses the write and ``apply_async`` raises instead.
  ``delayed_allow_eviction = True`` accepts the risk.
"""
from __future__ import annotations

from typing import Any, cast

import redis

from celery_delayed import inert
from celery_delayed.settings import ConfigurationError
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.outcomes import STORE_ERRORS

logger = inert.logger(__name__)


def preflight(store: DelayedStore, role: str) -> None:
    """Check the store before a ``role`` (poller, worker) starts; raise ConfigurationError when it must not.

    An unreachable store raises :class:`StoreUnavailable`.
    """
    if store.check_layout() and role == "poller":
        logger.warning("nothing was ever scheduled under delayed_key_prefix %r in this Redis (its layout is new): "
                       "if your clients use another prefix, this poller dispatches none of their tasks",
                       store.settings.key_prefix)
    check_eviction(store)


def worker_preflight(store: DelayedStore) -> None:
    """:func:`preflight` for a worker, which may start while the store is down (its layout is then
    checked on first use)."""
    try:
        preflight(store, "worker")
    except STORE_ERRORS as exc:
        logger.warning("could not check the delayed store at start (%s): its layout is checked on first use, its "
                       "maxmemory-policy is not", exc)


def check_eviction(store: DelayedStore) -> None:
    """Refuse a store whose Redis (every primary of a cluster) may evict keys, unless allowed."""
    policies = eviction_policies(store.redis)
    if policies is None:
        logger.warning("could not check the store's maxmemory-policy (CONFIG GET is disabled or renamed): make "
                       "sure it is noeviction, or scheduled tasks may be dropped when Redis is full")
        return
    evicting = {node: policy for node, policy in policies.items() if policy != "noeviction"}
    if not evicting:
        return
    shown = ", ".join(f"{node or 'Redis'}: {policy}" for node, policy in sorted(evicting.items()))
    if store.settings.allow_eviction:
        logger.warning("the store's Redis may evict keys (maxmemory-policy %s): scheduled tasks can be lost when "
                       "it is full (allowed by delayed_allow_eviction)", shown)
        return
    raise ConfigurationError(f"the delayed store's Redis may evict scheduled tasks when full (maxmemory-policy "
                             f"{shown}): set maxmemory-policy noeviction, or delayed_allow_eviction = True to "
                             "accept the loss")


def eviction_policies(client: redis.Redis | redis.RedisCluster) -> dict[str, str] | None:
    """``maxmemory-policy`` per node (``""`` for a standalone Redis); None when CONFIG GET is refused."""
    try:
        # cast: redis-py types CONFIG GET's reply as one node's, with None values, but several nodes reply each
        # their own, and a setting Redis has is never None
        if isinstance(client, redis.RedisCluster):
            replies = cast("dict[str, Any]", client.config_get("maxmemory-policy",
                                                               target_nodes=redis.RedisCluster.PRIMARIES))
            if "maxmemory-policy" not in replies:  # more than one node: a reply per node
                return {node: reply["maxmemory-policy"] for node, reply in replies.items()}
            return {"": replies["maxmemory-policy"]}
        return {"": cast(str, client.config_get("maxmemory-policy")["maxmemory-policy"])}
    except (redis.ResponseError, KeyError):  # unknown (renamed) command, NOPERM by an ACL
        return None
