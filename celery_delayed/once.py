"""Once per task_id: a task whose id already finished is not run again, and two
copies of one task_id never run at the same time.

Kafka and the poller deliver at least once, so a task can arrive twice.  Before
a worker hands a task to Celery it checks the result backend for a terminal
state, then takes a *run claim* (``<prefix>:run:<task_id>``, SET NX with a
lease), unless the id was revoked (:func:`.revoke.remember_revoked`).  The
worker extends the claims of its running tasks while they run and releases each
when Celery settles the task; a claim left by a killed worker expires after the
lease.  A copy that finds the claim taken is put back in the store, due when the
claim would expire, so it is never dropped.
"""
from __future__ import annotations

import logging
import threading
import time

import redis
from celery import states
from celery.backends.base import DisabledBackend

from .redis_client import UNREACHABLE, Script, execute
from .revoke import revoke_key
from .store import DelayedStore

logger = logging.getLogger(__name__)


#: :meth:`RunClaims.acquire`'s answer for a revoked task id.
REVOKED = -1


class RunClaims:
    """Run claims held by one worker process (``owner``), leased for ``lease_s`` seconds.

    A keeper thread extends every held claim each third of a lease until it is
    released.  It belongs to the process, not to a Kafka consumer, so a
    consumer restart (a broker reconnect) cannot leave a running task's claim
    to lapse while the task still runs.
    """

    def __init__(self, store: DelayedStore, owner: str, lease_s: float) -> None:
        self.redis = store.redis
        self.prefix = store.settings.key_prefix
        self.owner = owner
        self.lease_ms = int(lease_s * 1000)
        self._acquire = Script(self.redis, store.lua_source("acquire"))
        self._release = Script(self.redis, store.lua_source("release"))
        self._extend = Script(self.redis, store.lua_source("extend"))
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._keeper = threading.Thread(target=self._keep, name="delayed-claims", daemon=True)
        self._keeper.start()

    def key(self, task_id: str) -> str:
        return f"{self.prefix}:run:{{{task_id}}}"

    def acquire(self, task_id: str) -> int:
        """Claim ``task_id``: 0 on success, :data:`REVOKED` when the task was revoked,
        else the ms until the current claim expires."""
        wait_ms = self._acquire(keys=[self.key(task_id), revoke_key(self.prefix, task_id)],
                                args=[self.owner, self.lease_ms])
        if wait_ms == 0:
            with self._lock:
                self._held.add(task_id)
        return wait_ms

    def release(self, task_id: str) -> None:
        """Give a claim up; if Redis cannot be told, the claim simply expires after its lease."""
        with self._lock:
            self._held.discard(task_id)
        try:
            self._release(keys=[self.key(task_id)], args=[self.owner])
        except (redis.RedisError, *UNREACHABLE) as exc:
            logger.warning("run claim of %s not released (%s); it expires after its lease", task_id, exc)

    def _keep(self) -> None:
        while True:
            time.sleep(self.lease_ms / 3000)
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                for task_id in held:
                    self._extend(keys=[self.key(task_id)], args=[self.owner, self.lease_ms], client=pipe)
                execute(self.redis, pipe)
            except (redis.RedisError, *UNREACHABLE) as exc:  # try again next round, well within the lease
                logger.warning("could not extend %d run claims: %s", len(held), exc)


def finished(backend, task_id: str) -> bool:
    """Whether the result backend holds a terminal state (success, failure, revoked) for the id."""
    if isinstance(backend, DisabledBackend):
        return False
    return backend.get_task_meta(task_id).get("status") in states.READY_STATES
