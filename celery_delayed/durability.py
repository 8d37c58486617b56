"""What keeps scheduled tasks from being lost in the store's Redis.

Writes that wait (:class:`DurableWrites`): with ``delayed_schedule_wait``, a
schedule write returns once replicas (``WAIT``) or the AOF (``WAITAOF``) hold it.

Start-up checks, run by the poller and the workers:

- The layout (partitions, bucket width, format) must be the one the store was
  written with (:meth:`DelayedStore.check_layout`).
- Redis must not evict keys: under ``maxmemory`` with any policy but
  ``noeviction`` it silently drops scheduled tasks to make room, where
  ``noeviction`` refuses the write and ``apply_async`` raises instead.
  ``delayed_allow_eviction = True`` accepts the risk.
"""
from __future__ import annotations

import logging

import redis

from typing import TYPE_CHECKING, Any

from .outcomes import STORE_ERRORS, StoreNotDurable
from .settings import ConfigurationError

if TYPE_CHECKING:  # the store uses DurableWrites
    from .store import DelayedStore

logger = logging.getLogger(__name__)


class DurableWrites:
    """The ``delayed_schedule_wait`` policy of one store's writes that must not be lost: tasks
    scheduled, and dead letters (their message settled once parked)."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        self.policy = store.settings.wait_policy
        self._waitaof_checked = False

    def end(self, pipe: redis.client.Pipeline, probes: list[str]) -> None:
        """End a pipeline of writes (schedule, dead letter) with its wait: on the pipeline's own
        connection, as ``WAIT`` and ``WAITAOF`` count that connection's writes.  A cluster
        pipeline's connections are not ours: it is waited for after it ran (:meth:`confirm`), on
        the node of each of ``probes``, a short-lived key in the slot of each group of keys written
        (:meth:`.Keys.wait_probe`, :attr:`.Keys.dlq_wait`)."""
        if self.policy is None:
            return
        if isinstance(self.store.redis, redis.RedisCluster):
            pipe.delayed_probes = probes
        else:
            self._wait(pipe)

    def confirm(self, pipe: redis.client.Pipeline, replies: list) -> list:
        """The replies of a schedule pipeline that ran, without its wait's; raises
        :class:`StoreNotDurable` when the writes are not held as the policy asks."""
        if self.policy is None:
            return replies
        if isinstance(self.store.redis, redis.RedisCluster):
            self._wait_on_nodes(pipe.delayed_probes)
            return replies
        self._check(replies.pop())
        return replies

    def _wait_on_nodes(self, probes: list[str]) -> None:
        """``WAIT``/``WAITAOF`` on every primary that holds one of ``probes``, after the writes.

        Both count the writes of their own connection, and a cluster pipeline's connections are not
        ours to use; but a primary's replication stream is ordered, so a write sent after the
        pipeline's answer, on a connection of our own, is replicated after them: a ``SET`` of the
        short-lived probe key, then the wait.  A primary that moved meanwhile answers ``MOVED``
        (a store error): the write is then not confirmed, and writing again is safe.
        """
        by_node = {}
        for probe in probes:
            node = self.store.redis.get_node_from_key(probe)
            by_node.setdefault(node.name, (node, probe))
        for node, probe in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            pipe.execute_command("SET", probe, 1, "PX", 60_000)
            self._wait(pipe)
            self._check(self.store._unchecked(pipe.execute)[-1])

    def _wait(self, pipe: redis.client.Pipeline) -> None:
        if self.policy.aof:
            self._require_waitaof()
            pipe.execute_command("WAITAOF", 1, self.policy.replicas, self.policy.timeout_ms)
        else:
            pipe.execute_command("WAIT", self.policy.replicas, self.policy.timeout_ms)

    def _require_waitaof(self) -> None:
        """``WAITAOF`` came with Redis 7.2: say so once, rather than fail on every write."""
        if self._waitaof_checked:
            return
        version = self.store._call_redis(self.store.redis.info, "server")["redis_version"]
        if tuple(map(int, version.split(".")[:2])) < (7, 2):
            raise ConfigurationError(f"delayed_schedule_wait={self.store.settings.schedule_wait!r} needs WAITAOF, "
                                     f"new in Redis 7.2; the store's Redis is {version} (use replicas=N with WAIT "
                                     "instead)")
        self._waitaof_checked = True

    def _check(self, acked: Any) -> None:
        """Raise StoreNotDurable unless ``acked`` (a WAIT or WAITAOF reply) meets the policy."""
        local, replicas = acked if self.policy.aof else (1, acked)
        if not local or replicas < self.policy.replicas:
            raise StoreNotDurable(
                f"store write not durable within {self.policy.timeout_ms} ms (delayed_schedule_wait="
                f"{self.store.settings.schedule_wait!r}): {replicas} of {self.policy.replicas} replicas acknowledged "
                f"it{'' if local else ', not fsynced to the AOF'}; what it wrote is on the primary and may be lost if "
                "it fails now (writing it again is safe: scheduled tasks and dead letters keep one copy)")


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
        if isinstance(client, redis.RedisCluster):
            replies = client.config_get("maxmemory-policy", target_nodes=redis.RedisCluster.PRIMARIES)
            if "maxmemory-policy" not in replies:  # more than one node: a reply per node
                return {node: reply["maxmemory-policy"] for node, reply in replies.items()}
            return {"": replies["maxmemory-policy"]}
        return {"": client.config_get("maxmemory-policy")["maxmemory-policy"]}
    except (redis.ResponseError, KeyError):  # unknown (renamed) command, NOPERM by an ACL
        return None
