"""celery_delayed.testing, used as a Celery user would: a small project whose own suite runs on
Celery's pytest fixtures, in a pytest of its own, on the real servers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import redis

from celery_delayed import store_of
from celery_delayed.sandbox import installed

from config import celeryconfig
from tasks import create_app

from .conftest import SERVERS

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
import pytest

pytest_plugins = ("celery.contrib.pytest", "celery_delayed.testing")


@pytest.fixture(scope="session")
def celery_config():
    return {config!r}
"""

TESTS = '''
import time

from celery_delayed import store_of


def test_a_countdown_task_waits_in_the_store_then_runs_from_kafka(delayed_app, delayed_worker):
    @delayed_app.task
    def mul(x, y):
        return x * y

    delayed_worker.reload()
    sent = time.time()
    result = mul.apply_async((4, 4), countdown=2)
    assert store_of(delayed_app).get(result.id)["state"] == "scheduled"
    assert result.get(timeout=60) == 16
    assert time.time() - sent >= 2 - 0.05  # not before its due time
    assert store_of(delayed_app).get(result.id) is None


def test_each_test_has_a_store_of_its_own(delayed_app):
    prefix = store_of(delayed_app).settings.key_prefix
    with open("prefixes.txt", "a") as out:
        out.write(prefix + "\\n")
    delayed_app.send_task("anything", countdown=3600)
    assert sum(row["scheduled"] for row in store_of(delayed_app).counts()) == 1
'''


def test_a_project_on_celerys_fixtures_schedules_and_runs_through_the_plugin(tmp_path, services):
    config = {"broker_url": celeryconfig.broker_url, "result_backend": celeryconfig.result_backend,
              "task_acks_late": True, "task_reject_on_worker_lost": True, "result_backend_always_retry": True,
              "task_default_queue": f"plugin-{uuid.uuid4().hex[:8]}", "delayed_partitions": 2, "delayed_lease_ttl": 2,
              **{f"delayed_{name}": value for name, value in SERVERS.items()}}
    (tmp_path / "conftest.py").write_text(CONFTEST.format(config=config))
    (tmp_path / "test_project.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_project_again.py").write_text(textwrap.dedent(TESTS))  # a second module, same tests
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "."],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout
    prefixes = (tmp_path / "prefixes.txt").read_text().split()
    assert len(prefixes) == len(set(prefixes)) == 2
    client = redis.Redis.from_url(SERVERS["redis_url"])
    assert [k for p in prefixes for k in client.scan_iter(match=f"{p}:*")] == []  # removed after each test


def test_installed_gives_an_app_of_a_factory_its_own_store_and_removes_it(services):
    app = create_app(**{f"delayed_{name}": value for name, value in SERVERS.items()})
    with installed(app) as app:
        result = app.send_task("tasks.demo.add", (1, 2), countdown=3600)
        store = store_of(app)
        assert store.settings.key_prefix.startswith("test-") and store.get(result.id)["state"] == "scheduled"
    assert list(store.redis.scan_iter(match=f"{store.settings.key_prefix}:*")) == []
