"""The celery sub-commands as a user runs them."""
from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import tornado.ioloop
import tornado.web
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_delayed import store_of
from celery_delayed.inert import inert
from celery_delayed.ops.cli import delayed
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from tasks import create_app

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
    rows = json.loads(done.stdout)["partitions"]
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


#: Values a scheduler wrote (ids, names, queues, reasons) that a terminal would act on if written raw:
#: a title change, a screen clear, a hyperlink, a bell, a carriage return, a bidi override.
HOSTILE_ID = "\x1b]0;pwned\x07\x1b[2J\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\\r\u202e"
HOSTILE_TASK = "[bold red]styled[/bold red]\x1b[2J"
HOSTILE_QUEUE = "[link=http://evil.example/]mkq[/link]"
HOSTILE_REASON = "boom\r\x1b]0;owned\x07[link=http://evil.example/]x[/link]"


#: What rich itself writes to a terminal: colours and styles, and its progress line's cursor moves.
RICH_OWN = re.compile(r"\r?\x1b\[(?:[0-9;]*[mAK]|\?25[lh])")


def in_terminal(overrides: dict, *args: str) -> str:
    """A celery command's output as a terminal gets it (stdout and stderr a pseudo-terminal, colours on)."""
    leader, follower = pty.openpty()
    env = {**environment(overrides), "TERM": "xterm-256color", "COLUMNS": "1000"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", *args], cwd=ROOT, env=env,
                               stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the command ended and closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    process.wait(60)
    return b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal ends lines with CR LF


def test_hostile_values_from_the_store_reach_the_terminal_as_text(overrides):
    """No ESC, BEL, CR or bidi override a scheduler wrote reaches the operator's terminal, nor rich
    markup it would act on: each shows escaped, as repr shows it (rich's own colours aside)."""
    app = create_app(**overrides)
    store = store_of(app)
    store.schedule_many(envelopes(1, HOSTILE_QUEUE, int(time.time() * 1000) + 60_000, prefix=HOSTILE_ID,
                                  task=HOSTILE_TASK))
    store.pause(HOSTILE_QUEUE)
    task_id = f"{HOSTILE_ID}-0"
    DeadLetters(store).add(DeadLetter(task_id=task_id, reason=HOSTILE_REASON, source="worker",
                                      traceback=f"Traceback:\n  {HOSTILE_REASON}"))
    seen = {}
    for command in (("upcoming",), ("show", task_id), ("status", "--tasks"), ("queues",), ("check",),
                    ("dlq", "list"), ("dlq", "show", task_id)):
        output = seen[command[:2]] = in_terminal(overrides, "delayed", *command)
        data = RICH_OWN.sub("", output)
        assert not set(data) & set("\x1b\x07\r\u202e"), (command, output)
    shown_id, shown_task, shown_reason = inert(task_id), inert(HOSTILE_TASK), inert(HOSTILE_REASON)
    assert shown_id in seen["upcoming",] and shown_task in seen["upcoming",]
    assert shown_id in seen["show", task_id] and HOSTILE_QUEUE in seen["show", task_id]
    assert HOSTILE_QUEUE in seen["status", "--tasks"] and shown_task in seen["status", "--tasks"]
    assert HOSTILE_QUEUE in seen["queues",] and shown_task in seen["check",]
    assert shown_reason in seen["dlq", "list"] and f"  {shown_reason}" in seen["dlq", "show"]


def web_command(overrides: dict, monkeypatch, *args: str, **env: str) -> tuple[list[str], object]:
    """``delayed web ARGS`` run in this process with nothing bound: the addresses it would listen on, and
    its click result (output, exit code)."""
    bound: list[str] = []
    monkeypatch.setattr(tornado.web.Application, "listen", lambda self, port, address: bound.append(address))
    monkeypatch.setattr(tornado.ioloop.IOLoop, "current", staticmethod(lambda: SimpleNamespace(start=lambda: None)))
    result = CliRunner().invoke(delayed, ["web", *args], obj=CLIContext(create_app(**overrides), True, None),
                                env=env)
    return bound, result


def test_an_empty_or_short_token_is_an_error_not_no_auth(overrides, monkeypatch):
    for args, env, error in [(("--token", ""), {}, "--token must be at least 16 characters"),
                             ((), {"CELERY_DELAYED_WEB_TOKEN": ""}, "CELERY_DELAYED_WEB_TOKEN is empty"),
                             (("--token", "short"), {}, "--token must be at least 16 characters")]:
        bound, result = web_command(overrides, monkeypatch, *args, **env)
        assert (bound, result.exit_code) == ([], 1) and error in result.output, (args, env, result.output)
    bound, result = web_command(overrides, monkeypatch, "--token", "a-token-long-enough")
    assert bound == ["127.0.0.1"]
    assert result.output.splitlines() == ["celery-delayed web on http://127.0.0.1:5566/ (token)"]
    bound, result = web_command(overrides, monkeypatch, CELERY_DELAYED_WEB_BASIC_AUTH="ops:s3cret",
                                CELERY_DELAYED_WEB_TOKEN="a-token-long-enough")
    assert result.output.splitlines() == ["celery-delayed web on http://127.0.0.1:5566/ (basic auth and token)"]


def test_serving_beyond_loopback_needs_credentials_or_the_flag_named_for_its_risk(overrides, monkeypatch):
    bound, result = web_command(overrides, monkeypatch, "--address", "0.0.0.0")
    assert (bound, result.exit_code) == ([], 1) and "0.0.0.0 is beyond this machine" in result.output
    bound, result = web_command(overrides, monkeypatch, "--address", "0.0.0.0", "--insecure-serve-without-auth")
    assert bound == ["0.0.0.0"] and "warning: served beyond this machine without credentials" in result.output
    bound, result = web_command(overrides, monkeypatch, "--address", "0.0.0.0", "--token", "a-token-long-enough")
    assert bound == ["0.0.0.0"] and "warning" not in result.output
    bound, result = web_command(overrides, monkeypatch, "--address", "127.0.0.2")
    assert bound == ["127.0.0.2"]  # loopback, as 127.0.0.1
    assert result.output.splitlines() == ["celery-delayed web on http://127.0.0.2:5566/ (no auth)"]


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
