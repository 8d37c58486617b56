"""The result backend keeps the first terminal result of a task id (real Redis)."""
from __future__ import annotations

import uuid

import pytest
from celery import states

from celery_delayed.backend import RedisBackend
from tasks import create_app


@pytest.fixture
def backend(services) -> RedisBackend:
    app = create_app()
    assert isinstance(app.backend, RedisBackend), "the demo config should use celery-delayed's backend"
    return app.backend


def test_first_success_is_final(backend):
    task_id = str(uuid.uuid4())
    backend.mark_as_started(task_id)
    backend.mark_as_done(task_id, 1)
    backend.mark_as_failure(task_id, RuntimeError("late duplicate"))
    backend.mark_as_started(task_id)
    backend.mark_as_done(task_id, 2)
    meta = backend.get_task_meta(task_id, cache=False)
    assert (meta["status"], meta["result"]) == (states.SUCCESS, 1)


def test_first_failure_is_final_until_forgotten(backend):
    task_id = str(uuid.uuid4())
    backend.mark_as_failure(task_id, RuntimeError("first"))
    backend.mark_as_done(task_id, 3)
    assert backend.get_task_meta(task_id, cache=False)["status"] == states.FAILURE
    backend.forget(task_id)  # what dlq requeue does before a rerun
    backend.mark_as_done(task_id, 3)
    assert backend.get_task_meta(task_id, cache=False)["result"] == 3


def test_progress_states_still_update(backend):
    task_id = str(uuid.uuid4())
    backend.mark_as_started(task_id)
    backend.mark_as_retry(task_id, RuntimeError("again"))
    assert backend.get_task_meta(task_id, cache=False)["status"] == states.RETRY
