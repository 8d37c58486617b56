"""Replace by key (``headers={"delayed_key": ...}``): at most one task per key is scheduled, the replaced
one never runs, through retries, a crash between the store's two steps, and the CLI."""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from celery import Celery, states

from celery_delayed import DelayedPublishError, store_of
from celery_delayed.client import intercept as client
from celery_delayed.envelope import KEY_HEADER, KEY_MODE_HEADER
from tasks import create_app

from .support import wait_for
from .test_cli import celery

pytestmark = pytest.mark.cluster_too


def keyed(key: str, mode: str | None = None) -> dict:
    return {"headers": {KEY_HEADER: key, **({KEY_MODE_HEADER: mode} if mode else {})}}


def runs(app: Celery, run: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in store_of(app).redis.hgetall(f"demo:{run}:runs").items()}


def revoked_because(app: Celery, task_id: str) -> str | None:
    meta = app.backend.get_task_meta(task_id)
    return str(meta["result"]) if meta["status"] == states.REVOKED else None  # TaskRevokedError(reason)


def scheduled_ids(app: Celery, *task_ids: str) -> list[str]:
    return [task_id for task_id in task_ids if store_of(app).get(task_id) is not None]


def test_a_new_task_replaces_the_one_scheduled_under_its_key(overrides):
    app = create_app(**overrides)
    work, key = app.tasks["tasks.demo.work"], f"reminder:{uuid.uuid4().hex}"
    first = work.apply_async(("r",), countdown=600, **keyed(key))
    second = work.apply_async(("r",), countdown=900, **keyed(key))
    other = work.apply_async(("r",), countdown=600, **keyed(key + "-other"))
    assert scheduled_ids(app, first.id, second.id, other.id) == [second.id, other.id]
    assert store_of(app).key_holder(key) == second.id
    assert revoked_because(app, first.id) == "replaced"
    work.apply_async(("r",), countdown=600, task_id=first.id, **keyed(key))  # sent again: still replaced
    assert scheduled_ids(app, first.id, second.id) == [second.id] and store_of(app).key_holder(key) == second.id


def test_keep_mode_keeps_the_first_and_drops_the_new_one(overrides):
    app = create_app(**overrides)
    work, key = app.tasks["tasks.demo.work"], f"throttle:{uuid.uuid4().hex}"
    first = work.apply_async(("r",), countdown=600, **keyed(key, "keep"))
    second = work.apply_async(("r",), countdown=60, **keyed(key, "keep"))
    assert scheduled_ids(app, first.id, second.id) == [first.id]
    assert revoked_because(app, second.id) == "duplicate key"
    store_of(app).cancel(first.id)  # no longer scheduled: the key is free for the next one
    third = work.apply_async(("r",), countdown=60, **keyed(key, "keep"))
    assert scheduled_ids(app, third.id) == [third.id] and store_of(app).key_holder(key) == third.id


def test_keep_mode_racing_senders_leave_one_scheduled(overrides):
    app = create_app(**overrides)
    work = app.tasks["tasks.demo.work"]
    for round_ in range(8):
        key, start = f"race:{uuid.uuid4().hex}", threading.Barrier(6)

        def send() -> str:
            start.wait()
            return work.apply_async(("r",), countdown=600, **keyed(key, "keep")).id

        with ThreadPoolExecutor(6) as pool:
            ids = list(pool.map(lambda _: send(), range(6)))
        kept = scheduled_ids(app, *ids)
        assert len(kept) == 1 and store_of(app).key_holder(key) == kept[0], round_
        assert [revoked_because(app, i) for i in ids if i not in kept] == ["duplicate key"] * 5


def test_a_bad_key_or_mode_is_refused_with_nothing_stored(overrides):
    app = create_app(**overrides)
    work = app.tasks["tasks.demo.work"]
    with pytest.raises(DelayedPublishError, match="delayed_key header must be a string of 1 to 512"):
        work.apply_async(("r",), countdown=60, headers={KEY_HEADER: ""})
    with pytest.raises(DelayedPublishError, match="delayed_key_mode header must be one of replace, keep, got 'x'"):
        work.apply_async(("r",), countdown=60, **keyed("k", "x"))
    with pytest.raises(DelayedPublishError, match="delayed_key_mode header must be one of replace, keep, got False"):
        work.apply_async(("r",), countdown=60, headers={KEY_HEADER: "k", KEY_MODE_HEADER: False})
    assert sum(p["scheduled"] for p in store_of(app).counts()) == 0


def test_only_the_last_runs_even_after_a_crash_between_the_two_steps_and_through_retries(overrides, processes,
                                                                                         monkeypatch):
    app = create_app(**overrides)
    store, work, flaky = store_of(app), app.tasks["tasks.demo.work"], app.tasks["tasks.demo.flaky"]
    run = uuid.uuid4().hex
    # A replacing client killed after it stored its task and took the key, before it cancelled the old one:
    # both are scheduled; the old one must not run.
    old = work.apply_async((run,), countdown=3, **keyed(f"{run}:crash"))
    with monkeypatch.context() as crashing:
        crashing.setattr(client, "cancel_scheduled", lambda *args, **kwargs: None)
        new_id = work.apply_async((run,), countdown=3, **keyed(f"{run}:crash")).id
    assert scheduled_ids(app, old.id, new_id) == [old.id, new_id]
    # A keyed task that fails once keeps its key through its retry; replaced while it waits, it never runs again.
    retried = flaky.apply_async((run, 1, 30.0), countdown=2, **keyed(f"{run}:retry"))
    processes.poller()
    processes.worker("w1")
    wait_for(lambda: (store.get(retried.id) or {}).get("headers", {}).get("retries") == 1, 60,
             "the flaky task's retry to be scheduled")
    assert store.get(retried.id)["headers"][KEY_HEADER] == f"{run}:retry"
    assert store.key_holder(f"{run}:retry") == retried.id
    replacement = flaky.apply_async((run, 0), countdown=1, **keyed(f"{run}:retry"))
    assert app.AsyncResult(new_id).get(timeout=60) == new_id
    assert replacement.get(timeout=60) == 1
    assert revoked_because(app, old.id) == "replaced" and revoked_because(app, retried.id) == "replaced"
    assert runs(app, run) == {new_id: 1, retried.id: 1, replacement.id: 1}
    wait_for(lambda: store.key_holder(f"{run}:retry") is None, 30, "the key released once its task ended")


def test_keep_mode_runs_a_dispatched_task_and_the_next_one_under_its_key(overrides, processes):
    app = create_app(**overrides)
    store, work, run = store_of(app), app.tasks["tasks.demo.work"], uuid.uuid4().hex
    first = work.apply_async((run,), countdown=1, **keyed(f"{run}:k", "keep"))
    processes.poller()
    wait_for(lambda: store.get(first.id) is None, 60, "the first task to be dispatched (no worker yet)")
    second = work.apply_async((run,), countdown=2, **keyed(f"{run}:k", "keep"))
    assert store.key_holder(f"{run}:k") == second.id
    processes.worker("w1")
    assert [first.get(timeout=60), second.get(timeout=60)] == [first.id, second.id]
    assert runs(app, run) == {first.id: 1, second.id: 1}


def test_show_and_cancel_by_key(overrides):
    app = create_app(**overrides)
    key = f"doc:{uuid.uuid4().hex}"
    task = app.tasks["tasks.demo.work"].apply_async(("r",), countdown=600, **keyed(key))
    shown = celery(overrides, "delayed", "show", "--key", key, "--json")
    assert shown.returncode == 0, shown.stderr
    assert f'"task_id": "{task.id}"' in shown.stdout
    cancelled = celery(overrides, "delayed", "cancel", "--key", key)
    assert cancelled.returncode == 0 and f"cancelled {task.id}" in cancelled.stdout, cancelled.stderr
    assert store_of(app).get(task.id) is None and store_of(app).key_holder(key) is None
    missing = celery(overrides, "delayed", "show", "--key", key)
    assert missing.returncode != 0 and f"no task is scheduled under key '{key}'" in missing.stderr
