"""A result backend that fails some reads, as a database backend that blinks does.

``CD_TEST_BLINK=2`` makes the 2nd ``get_task_meta`` of each task id in a
process raise :class:`celery.exceptions.BackendGetMetaError` (a comma list names
several calls); ``CD_TEST_BLINK_DONE=1`` makes the 1st ``mark_as_done`` of each task id
raise :class:`redis.ConnectionError`, as when Redis restarts while a task that ran
stores its result.  Everything else is the real Redis backend of celery-delayed.
Tests select it with ``result_backend = "tests.integration.blinking_backend:
BlinkingBackend+redis://..."``.
"""
from __future__ import annotations

import os
from collections import Counter

import redis
from celery.exceptions import BackendGetMetaError

from celery_delayed.backend import RedisBackend


class BlinkingBackend(RedisBackend):
    _calls: Counter = Counter()
    _done_calls: Counter = Counter()

    def get_task_meta(self, task_id, cache=True):
        self._calls[task_id] += 1
        if str(self._calls[task_id]) in os.environ.get("CD_TEST_BLINK", "").split(","):
            raise BackendGetMetaError(f"the result backend blinked (call {self._calls[task_id]})", task_id=task_id,
                                      state=None)
        return super().get_task_meta(task_id, cache)

    def mark_as_done(self, task_id, result, *args, **kwargs):
        self._done_calls[task_id] += 1
        if str(self._done_calls[task_id]) in os.environ.get("CD_TEST_BLINK_DONE", "").split(","):
            raise redis.ConnectionError(f"the result backend blinked storing the result of {task_id}")
        return super().mark_as_done(task_id, result, *args, **kwargs)
