"""The celery sub-commands as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore

from .support import ROOT, envelopes, environment


def celery(overrides: dict, *args: str, stdin: str = "", **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**environment(overrides), **extra_env}, input=stdin)


def test_bad_setting_stops_the_poller_with_an_error_naming_it(overrides):
    done = celery(overrides, "delayed", "poller", DELAYED_PARTITIONS="zero")
    assert done.returncode != 0
    assert "delayed_partitions must be int, got 'zero'" in done.stderr


def test_secret_in_a_bad_redis_url_is_not_printed(overrides):
    done = celery(overrides, "delayed", "status", DELAYED_REDIS_URL="http://user:s3cret@127.0.0.1:6379/0")
    assert done.returncode != 0
    assert "delayed_redis_url must be a redis://" in done.stderr
    assert "s3cret" not in done.stderr + done.stdout


@pytest.mark.parametrize("env, shown", [
    ({"DELAYED_REDIS_URL": "redis://127.0.0.1:1/0?password=s3cret"},
     "delayed store at redis://127.0.0.1:1/0?password=*** unavailable"),
    ({"DELAYED_REDIS_URL": "redis://:s3cret@127.0.0.1:1/0"}, "delayed store at redis://:***@127.0.0.1:1/0 unavailable"),
    ({"DELAYED_KAFKA_CONFIG": "sasl.password=s3cret"}, "delayed_kafka_config must be Mapping"),
    ({"DELAYED_ETCD_ENDPOINTS": "ftp://root:s3cret@127.0.0.1:2379"},
     "delayed_etcd_endpoints must be [http(s)://]host:port[,...], got 'ftp://root:***@127.0.0.1:2379'"),
])
def test_no_command_prints_a_secret_of_the_settings(overrides, env, shown):
    done = celery(overrides, "delayed", "status", **env)
    assert done.returncode != 0
    assert shown in done.stderr
    assert "s3cret" not in done.stderr + done.stdout


def test_status_counts_scheduled_tasks(overrides):
    settings = Settings.from_conf(overrides, partitions=4)
    DelayedStore(settings).schedule_many(envelopes(7, "q", int(time.time() * 1000) + 60_000))
    done = celery(overrides, "delayed", "status", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == 4 and sum(r["scheduled"] for r in rows) == 7


def test_pause_queues_and_resume_a_queue_from_the_command_line(overrides):
    queue = f"{overrides['task_default_queue']}-bulk"
    done = celery(overrides, "delayed", "pause", queue)
    assert done.returncode == 0 and f"{queue}: paused" in done.stdout, done.stderr
    assert f"{queue}: already paused" in celery(overrides, "delayed", "pause", queue).stdout
    rows = json.loads(celery(overrides, "delayed", "queues", "--json").stdout)
    assert [(row["queue"], row["overdue"]) for row in rows] == [(queue, 0)] and rows[0]["paused_since_ms"]
    assert "paused queues (their tasks stay in the store" in celery(overrides, "delayed", "status").stdout
    assert f"{queue}: resumed" in celery(overrides, "delayed", "resume", queue).stdout
    assert json.loads(celery(overrides, "delayed", "queues", "--json").stdout) == []


def test_a_queues_rate_is_set_at_run_time_over_the_setting_and_reset_to_it(overrides):
    queue = f"{overrides['task_default_queue']}-bulk"
    overrides["delayed_queue_rates"] = {queue: 500}
    assert celery(overrides, "delayed", "rate", queue, "2000").stdout.strip() == f"{queue}: at most 2000 tasks/s"
    rows = json.loads(celery(overrides, "delayed", "queues", "--json").stdout)
    assert [(row["queue"], row["rate"]) for row in rows] == [(queue, 2000.0)]
    assert celery(overrides, "delayed", "rate", queue, "off").stdout.strip() == f"{queue}: no limit"
    assert celery(overrides, "delayed", "rate", queue, "--reset").stdout.strip() == f"{queue}: at most 500 tasks/s"
    done = celery(overrides, "delayed", "rate", queue, "fast")
    assert done.returncode == 2 and "tasks a second, or off; got 'fast'" in done.stderr


@pytest.mark.parametrize("env, shown", [
    ({"DELAYED_KAFKA_SERVER": "127.0.0.1:9092"},
     "unknown setting delayed_kafka_server: did you mean delayed_kafka_servers?"),
    ({"DELAYED_PARTITION": "8"}, "unknown setting delayed_partition: did you mean delayed_partitions?"),
])
def test_a_misspelt_setting_stops_the_poller_naming_the_setting_meant(overrides, env, shown):
    done = celery(overrides, "delayed", "poller", **env)
    assert done.returncode == 1
    assert f"Error: {shown} (delayed_allow_unknown_settings = True accepts it)" in done.stderr.splitlines()


def test_unknown_settings_are_accepted_when_allowed(overrides):
    done = celery(overrides, "delayed", "status", "--json", DELAYED_PARTITION="8", DELAYED_ALLOW_UNKNOWN_SETTINGS="True")
    assert done.returncode == 0, done.stderr


def test_show_of_a_cancelled_task_says_it_was_cancelled(overrides):
    store = DelayedStore(Settings.from_conf(overrides))
    store.schedule_many(envelopes(1, overrides["task_default_queue"], int(time.time() * 1000) + 60_000))
    assert celery(overrides, "delayed", "cancel", "task-0").stdout.strip() == "cancelled task-0"
    done = celery(overrides, "delayed", "show", "task-0")
    assert done.returncode == 1
    assert "Error: task task-0 was cancelled or revoked: it will not run" in done.stderr.splitlines()
    assert "no task with id other-id in the store (never scheduled, or already dispatched)" in celery(
        overrides, "delayed", "show", "other-id").stderr
