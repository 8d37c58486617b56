"""The store's Redis client: one standalone Redis, or a Redis Cluster, behind one API.

With ``delayed_redis_cluster`` the store talks to a Redis Cluster through
redis-py's ``RedisCluster``.  Every multi-key script works there because a
partition's keys share a ``{p}`` hash tag (one slot, one node).  Two things
redis-py does not do on a cluster are done here:

- a Lua script in a pipeline: ``ClusterPipeline`` refuses ``EVALSHA`` (a node
  that never loaded the script would answer NOSCRIPT in mid-batch), and a
  standalone ``Pipeline`` asks ``SCRIPT EXISTS`` before every batch (one more
  round trip each).  :class:`Script` queues ``EVALSHA`` in both, and
  :func:`execute` loads a missing script (on every primary) and sends again
  just the commands that got NOSCRIPT (a restarted or failed-over node has an
  empty script cache), with the waits for replicas queued after them;
- errors: a cluster that is down or cannot be reached raises errors outside
  redis-py's ``ConnectionError``; :data:`UNREACHABLE` lists them all, and
  :func:`refusal` tells a Redis that answers but refuses the command (full,
  a replica, an ACL) from a command that is wrong.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Iterable, Sequence

import redis
from redis.client import Pipeline
from redis.cluster import ClusterPipeline
from redis.commands.core import Script as RedisScript
from redis.exceptions import (ClusterError, NoPermissionError, NoScriptError, OutOfMemoryError, ReadOnlyError,
    RedisClusterException)

from celery_delayed.settings import Settings

#: What a store that cannot be reached raises, standalone or cluster (a cluster
#: that is down, has slots without a node, or whose nodes all refuse connections).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException)

#: Error codes by which a Redis that answers refuses a command whatever the command, and what each says of it.
#: (NOAUTH, WRONGPASS, LOADING, MASTERDOWN and CLUSTERDOWN are in :data:`UNREACHABLE` already.)
REFUSALS = {
    "OOM": "is full (maxmemory, noeviction) and refuses writes",
    "READONLY": "is a read-only replica and refuses writes",
    "NOPERM": "refuses the command to this user (ACL)",
    "MISCONF": "refuses writes: it cannot save its snapshot",
    "NOREPLICAS": "refuses writes: it has fewer replicas than min-replicas-to-write",
    "BUSY": "is busy running a script",
}
#: The codes of :data:`REFUSALS` whose errors redis-py raises as classes of its own (their words without the code).
_MAPPED = {OutOfMemoryError: "OOM", ReadOnlyError: "READONLY", NoPermissionError: "NOPERM"}
#: How Redis 7.0 words an ACL refusal inside a script (as an ERR, which redis-py leaves out).
_SCRIPT_NOPERM = "The user executing the script can't run this command"

#: Connections a process keeps to a standalone store at most, and how long (s) a caller waits for one
#: when all are busy (then ``ConnectionError``, a store error): a green or threads worker of -c 200
#: whose tasks retry at once shares them, where redis-py's default pool refuses the 101st at once.
POOL_SIZE, POOL_WAIT = 100, 20.0
#: The commands that wait for a pipeline's writes to reach replicas or disk.
WAITS = ("WAIT", "WAITAOF")
#: Script source by SHA-1, to load a script again on a node that lost it.
_SOURCES: dict[str, str] = {}


def refusal(exc: redis.ResponseError) -> str | None:
    """What ``exc`` says of the Redis that raised it when it is one of :data:`REFUSALS`
    (its meaning, then the code and Redis' words), else None: the command itself is wrong."""
    words = str(exc).rpartition("caused error: ")[2]  # a pipeline prefixes the command that failed
    code = next((code for kind, code in _MAPPED.items() if isinstance(exc, kind)),
                "NOPERM" if words.startswith(_SCRIPT_NOPERM) else words.partition(" ")[0])
    if code not in REFUSALS:
        return None
    return f"{REFUSALS[code]}: {code} {words.removeprefix(code).strip()}"


def connect(settings: Settings) -> redis.Redis | redis.RedisCluster:
    """A client of the store's Redis: a ``RedisCluster`` when ``delayed_redis_cluster`` is set.

    A ``RedisCluster`` reads the cluster's slot map here, so an unreachable
    cluster raises one of :data:`UNREACHABLE` now rather than at the first command.
    """
    if settings.redis_cluster:
        return redis.RedisCluster.from_url(settings.redis_url, health_check_interval=30)
    pool = redis.BlockingConnectionPool.from_url(settings.redis_url, health_check_interval=30,
                                                 max_connections=POOL_SIZE, timeout=POOL_WAIT)
    return redis.Redis(connection_pool=pool)


class Script(RedisScript):
    """A Lua script called by SHA, also inside a cluster pipeline (see :func:`execute`)."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, source: str) -> None:
        super().__init__(client, source)
        _SOURCES[self.sha] = source

    def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None,
                 client: Any = None) -> Any:
        """Run the script, or queue it when ``client`` is a pipeline."""
        if isinstance(client, (ClusterPipeline, Pipeline)):  # routed by the first key, like any keyed command
            keys = list(keys or [])
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *(args or []))
        return super().__call__(keys, args, client)


def execute(client: redis.Redis | redis.RedisCluster, pipe: Any) -> list:
    """Run ``pipe`` (a pipeline of ``client``) and return its replies; raise its first error.

    Commands answered NOSCRIPT did not run: their scripts are loaded (on a
    cluster, on every primary: ``SCRIPT LOAD`` goes to all of them) and those
    commands alone are sent again, so no script runs twice; a ``WAIT`` or
    ``WAITAOF`` queued after one is sent again after them, so that it counts
    their writes too.
    """
    queued = ([command.args for command in pipe._execution_strategy.command_queue]  # redis-py >= 6.2; no public way
              if isinstance(pipe, ClusterPipeline) else [args for args, _ in pipe.command_stack])
    replies = pipe.execute(raise_on_error=False)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for sha in {queued[i][1] for i in missing}:
            client.script_load(_SOURCES[sha])
        again = missing + [i for i in range(missing[0], len(queued)) if str(queued[i][0]).upper() in WAITS]
        for i in again:
            pipe.execute_command(*queued[i])
        for i, reply in zip(again, pipe.execute(raise_on_error=False)):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
