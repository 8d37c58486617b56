"""Deploys that rename or remove a task: ``celery delayed check`` names the scheduled tasks the app no
longer registers, and a worker parks such a task in the dead-letter queue with that reason (real
Redis, Kafka, etcd, poller and worker)."""
from __future__ import annotations

import json
import subprocess
import sys

from celery_delayed import store_of
from celery_delayed.store.dlq import DeadLetters
from celery_delayed.store.inspection import UNREADABLE
from celery_delayed.store.layout import member_of
from tasks import create_app

from .support import ROOT, environment, wait_for

GONE = "tasks.renamed.old_name"


def delayed(overrides: dict, *args: str) -> subprocess.CompletedProcess:
    """``celery -A tasks delayed ARGS`` as a deploy pipeline runs it."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "delayed", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**environment(overrides), "COLUMNS": "200"})


def test_check_fails_naming_each_scheduled_task_name_the_app_does_not_register(overrides):
    app = create_app(**overrides)
    for n in range(3):
        app.tasks["tasks.demo.add"].apply_async((n, n), countdown=3600)
    gone = [app.send_task(GONE, countdown=600 + n) for n in range(2)]
    failed = delayed(overrides, "check")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"1 scheduled task name(s) this app does not register: {GONE} (2 scheduled, next due" in failed.stderr
    assert "tasks.demo.add" in failed.stdout and "NO" in failed.stdout
    listed = json.loads(delayed(overrides, "check", "--json").stdout)
    assert [(row["task"], row["count"], row["registered"]) for row in listed] == [
        (GONE, 2, False), ("tasks.demo.add", 3, True)]  # the unregistered first
    status = json.loads(delayed(overrides, "status", "--tasks", "--json").stdout)
    assert status["tasks"] == listed and sum(row["scheduled"] for row in status["partitions"]) == 5
    shown = delayed(overrides, "status", "--tasks").stdout
    assert [line for line in shown.splitlines() if GONE in line and "NO" in line], shown

    ignored = delayed(overrides, "check", "--ignore", GONE)  # another service's workers run it
    assert ignored.returncode == 0, ignored.stdout + ignored.stderr

    store_of(app).cancel_many([result.id for result in gone])
    passed = delayed(overrides, "check")
    assert passed.returncode == 0, passed.stdout + passed.stderr


def test_check_names_a_stored_message_it_cannot_read_rather_than_failing_on_it(overrides):
    app = create_app(**overrides)
    store = store_of(app)
    broken = app.tasks["tasks.demo.add"].apply_async((1, 2), countdown=3600).id
    p, member = store.partition(broken), member_of(broken)
    store.redis.hset(store.keys.msgs(p), member, store.redis.hget(store.keys.msgs(p), member)[:4] + b"garbage")
    failed = delayed(overrides, "check")
    assert failed.returncode == 1 and f"{UNREADABLE} (1 scheduled" in failed.stderr, failed.stdout + failed.stderr
    shown = delayed(overrides, "show", broken)
    assert shown.returncode == 0 and UNREADABLE in shown.stdout, shown.stdout + shown.stderr


def test_a_task_the_worker_does_not_register_is_parked_with_that_reason(overrides, processes):
    app = create_app(**overrides)
    result = app.send_task(GONE, args=(1, 2), countdown=2)
    processes.poller()
    processes.worker()
    letters = DeadLetters(store_of(app))
    wait_for(lambda: letters.get(result.id) is not None, 60, "the unknown task in the dead-letter queue")
    letter = letters.get(result.id)
    assert letter.reason == f"unknown task {GONE!r}" and letter.source == "worker"
    assert sum(row["scheduled"] + row["inflight"] for row in store_of(app).counts()) == 0
