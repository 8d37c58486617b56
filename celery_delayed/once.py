"""Once per task_id: a task whose id already finished is not run again, and two
copies of one task_id never run at the same time.

Kafka and the poller deliver at least once, so a task can arrive twice.  Before
a worker hands a task to Celery it checks the result backend for a terminal
state, then takes a *run claim* (``<prefix>:run:<task_id>``, SET NX with a
lease).  The worker extends the claims of its running tasks while they run and
releases each when Celery settles the task; a claim left by a killed worker
expires after the lease.  A copy that finds the claim taken is put back in the
store, due when the claim would expire, so it is never dropped.
"""
from __future__ import annotations

from celery import states
from celery.backends.base import DisabledBackend

from .store import DelayedStore


class RunClaims:
    """Run claims of one worker (``owner``), leased for ``lease_s`` seconds."""

    def __init__(self, store: DelayedStore, owner: str, lease_s: float) -> None:
        self.redis = store.redis
        self.prefix = store.settings.key_prefix
        self.owner = owner
        self.lease_ms = int(lease_s * 1000)
        self._release = self.redis.register_script(store.lua_source("release"))
        self._extend = self.redis.register_script(store.lua_source("extend"))

    def key(self, task_id: str) -> str:
        return f"{self.prefix}:run:{task_id}"

    def acquire(self, task_id: str) -> int:
        """Claim ``task_id``; 0 on success, else ms until the current claim expires."""
        if self.redis.set(self.key(task_id), self.owner, nx=True, px=self.lease_ms):
            return 0
        return max(1, self.redis.pttl(self.key(task_id)))

    def release(self, task_id: str) -> None:
        self._release(keys=[self.key(task_id)], args=[self.owner])

    def extend(self, task_ids: list[str]) -> None:
        """Keep the claims of tasks still running alive for another lease."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            self._extend(keys=[self.key(task_id)], args=[self.owner, self.lease_ms], client=pipe)
        pipe.execute()


def finished(backend, task_id: str) -> bool:
    """Whether the result backend holds a terminal state (success, failure, revoked) for the id."""
    if isinstance(backend, DisabledBackend):
        return False
    return backend.get_task_meta(task_id).get("status") in states.READY_STATES
