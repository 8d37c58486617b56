"""A result backend that fails some reads, as a database backend that blinks does.

``CD_TEST_BLINK=2`` makes the 2nd ``get_task_meta`` of each task id in a
process raise :class:`celery.exceptions.BackendGetMetaError` (a comma list names
several calls); everything else is the real Redis backend of celery-delayed.
Tests select it with ``result_backend = "tests.integration.blinking_backend:
BlinkingBackend+redis://..."``.
"""
from __future__ import annotations

import os
from collections import Counter

from celery.exceptions import BackendGetMetaError

from celery_delayed.backend import RedisBackend


class BlinkingBackend(RedisBackend):
    _calls: Counter = Counter()

    def get_task_meta(self, task_id, cache=True):
        self._calls[task_id] += 1
        if str(self._calls[task_id]) in os.environ.get("CD_TEST_BLINK", "").split(","):
            raise BackendGetMetaError(f"the result backend blinked (call {self._calls[task_id]})", task_id=task_id,
                                      state=None)
        return super().get_task_meta(task_id, cache)
