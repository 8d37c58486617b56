"""A Redis result backend where the first terminal result of a task id is final.

Celery's own Redis backend skips a write after SUCCESS with a read-then-write,
which two copies of a task racing can both pass.  Here one Lua script checks
and writes atomically, and also keeps FAILURE and REVOKED.  Enable it with::

    result_backend = "celery_delayed.backend:RedisBackend+redis://127.0.0.1:6379/2"

Results must use the JSON serializer (Celery's default) for the check; with
another ``result_serializer`` it behaves as Celery's backend does.
"""
from __future__ import annotations

from celery.backends.redis import RedisBackend as CeleryRedisBackend
from kombu.utils.objects import cached_property

from celery_delayed.store.redis_client import Script
from celery_delayed.store.scripts import source


class RedisBackend(CeleryRedisBackend):
    """Celery's Redis backend with atomic first-terminal-result-wins writes."""

    @cached_property
    def _store_once(self) -> Script:
        # the one script it needs: a green worker builds a backend per task (Celery's app.backend is
        # thread-local, and a green worker's threads are greenlets), so registering all cost every task
        return Script(self.client, source("store_result"))

    def _set(self, key, value, expires=None):
        if self.serializer != "json":
            return super()._set(key, value, expires)
        expires = self.expires if expires is None else expires
        self._store_once(keys=[key], args=[value, int(expires or 0)])
