"""A result backend that fails some reads, as a database backend that blinks does.

``CD_TEST_BLINK=2`` makes the 2nd ``mget`` of a process (the worker's check of
the task states of a batch it read) raise :class:`redis.ConnectionError` (a comma
list names several calls); ``CD_TEST_BLINK_DONE=1`` makes the 1st ``mark_as_done`` of each task id
raise :class:`redis.ConnectionError`, as when Redis restarts while a task that ran
stores its result, and ``CD_TEST_BLINK_FAILURE=1`` its 1st ``mark_as_failure`` (then
Celery's pool child gives up and the worker's main process records the failure; the
main process's own calls never blink).  ``CD_TEST_BLINK_RETRY=1`` fails the 1st write of
a RETRY state of each task id below Celery's backend retry loop (``_store_result``), so
``result_backend_always_retry`` retries it.  ``CD_TEST_SLOW_META=S`` makes every read of
task states in the worker's main process (``mget``, ``get_task_meta``) take ``S`` seconds
more, as a result backend that hangs does; each such read prints "slow meta read".
Everything else is the real Redis backend of celery-delayed.
Tests select it with ``result_backend = "tests.integration.blinking_backend:
BlinkingBackend+redis://..."``.
"""
from __future__ import annotations

import os
import time
from collections import Counter

import redis
from billiard.process import current_process
from celery import states

from celery_delayed.backend import RedisBackend


class BlinkingBackend(RedisBackend):
    _mget_calls: Counter = Counter()
    _done_calls: Counter = Counter()
    _failure_calls: Counter = Counter()
    _retry_calls: Counter = Counter()

    def get_task_meta(self, task_id, cache=True):
        _slow()
        return super().get_task_meta(task_id, cache)

    def mget(self, keys):
        _slow()
        self._mget_calls["mget"] += 1
        if str(self._mget_calls["mget"]) in os.environ.get("CD_TEST_BLINK", "").split(","):
            raise redis.ConnectionError(f"the result backend blinked (mget call {self._mget_calls['mget']})")
        return super().mget(keys)

    def mark_as_done(self, task_id, result, *args, **kwargs):
        _blink(self._done_calls, task_id, "CD_TEST_BLINK_DONE")
        return super().mark_as_done(task_id, result, *args, **kwargs)

    def mark_as_failure(self, task_id, exc, *args, **kwargs):
        _blink(self._failure_calls, task_id, "CD_TEST_BLINK_FAILURE")
        return super().mark_as_failure(task_id, exc, *args, **kwargs)

    def _store_result(self, task_id, result, state, *args, **kwargs):
        if state == states.RETRY:
            _blink(self._retry_calls, task_id, "CD_TEST_BLINK_RETRY")
        return super()._store_result(task_id, result, state, *args, **kwargs)


def _blink(calls: Counter, task_id: str, variable: str) -> None:
    """Raise ConnectionError on the calls for ``task_id`` that ``variable`` names (1st, 2nd...)."""
    if current_process().name == "MainProcess":
        return
    calls[task_id] += 1
    if str(calls[task_id]) in os.environ.get(variable, "").split(","):
        raise redis.ConnectionError(f"the result backend blinked ({variable}, call {calls[task_id]} of {task_id})")


def _slow() -> None:
    """Take ``CD_TEST_SLOW_META`` seconds, in the worker's main process."""
    seconds = float(os.environ.get("CD_TEST_SLOW_META") or 0)
    if seconds and current_process().name == "MainProcess":
        print("slow meta read", flush=True)
        time.sleep(seconds)
