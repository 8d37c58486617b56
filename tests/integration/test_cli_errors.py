"""Every ``delayed`` command as a user runs it, against a store Redis that refuses commands (full,
a read-only replica, an ACL without writes) and with bad arguments: one line naming the problem,
never a traceback.  The refusing Redis servers are the test's own: the shared ones are never put
in such a state."""
from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Iterator

import pytest
import redis

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters

from .support import envelopes, own_redis, wait_for
from .test_cli import celery

#: Commands that only read the store (an ACL without writes lets them run)...
READS = [["status"], ["status", "--tasks"], ["upcoming"], ["show", "task-1"], ["queues"], ["check"],
         ["dlq", "list"], ["dlq", "show", "dead-0"], ["drain", "--to-broker", "--force", "--dry-run"]]
#: ...and those that write it.
WRITES = [["cancel", "task-0"], ["cancel", "--queue", "q", "-y"], ["reschedule", "task-1", "--shift", "1m"],
          ["reschedule", "--queue", "q", "--shift", "1m", "-y"], ["pause", "q"], ["resume", "q"],
          ["rate", "q", "5"], ["rate", "q", "--reset"], ["dlq", "requeue", "dead-0"], ["dlq", "requeue", "--all"],
          ["dlq", "purge", "dead-0"], ["dlq", "purge", "--all", "-y"]]
#: What the one line says of each refusing store.
SAYS = {"full": "is full (maxmemory, noeviction) and refuses writes: OOM command not allowed",
        "replica": "is a read-only replica and refuses writes: READONLY",
        "acl": "refuses the command to this user (ACL): NOPERM"}


def url_of(client: redis.Redis) -> str:
    return f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"


@pytest.fixture(params=sorted(SAYS))
def refusing(request, overrides: dict, tmp_path) -> Iterator[tuple[str, dict]]:
    """A store Redis of the test's own holding three tasks (queue q) and a dead letter, that refuses
    writes as ``request.param`` says; its kind and the test's settings pointing at it."""
    with ExitStack() as servers:
        primary = servers.enter_context(own_redis(tmp_path / "primary"))
        settings = {**overrides, "delayed_redis_url": url_of(primary)}
        store = DelayedStore(Settings.from_conf(settings))
        store.schedule_many(envelopes(3, "q", int(time.time() * 1000) + 600_000))
        task_id, _, message = next(envelopes(1, "q", 0, prefix="dead"))
        DeadLetters(store).add(DeadLetter(task_id=task_id, reason="test", source="worker", message=message))
        if request.param == "full":  # its data takes more than its maxmemory: noeviction refuses every write
            primary.config_set("maxmemory", primary.info("memory")["used_memory"] // 2)
        elif request.param == "replica":
            replica = servers.enter_context(own_redis(tmp_path / "replica", "--replicaof", "127.0.0.1",
                                                      str(primary.connection_pool.connection_kwargs["port"]),
                                                      "--replica-read-only", "yes"))
            wait_for(lambda: replica.info("replication")["master_link_status"] == "up"
                     and replica.dbsize() == primary.dbsize(), 30, "the replica in sync")
            settings["delayed_redis_url"] = url_of(replica)
        else:  # reads, scripts and the layout check's SET, but no other write
            primary.acl_setuser("default", enabled=True, nopass=True, commands=["-@write", "+set"])
        yield request.param, settings


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The one line a failed command printed on stderr (click's ``Error: ...``), its exit code 1."""
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    return lines[0]


def run_all(settings: dict, commands: list[list[str]]) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda args: (args, celery(settings, "delayed", *args)), commands))


def test_every_command_says_in_one_line_that_the_store_refuses_it(refusing):
    kind, settings = refusing
    for args, done in run_all(settings, READS + WRITES):
        if kind == "acl" and args in READS:  # reads go on
            assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        else:
            assert f"delayed store at {settings['delayed_redis_url']} {SAYS[kind]}" in one_line_error(done), args


@pytest.mark.parametrize("refusing", ["full"], indirect=True)
def test_a_poller_started_on_a_full_store_says_why_in_a_log_line_and_waits_for_it(refusing, processes):
    settings = refusing[1]
    poller = processes.poller(overrides=settings)
    wait_for(lambda: "cannot check the delayed store (delayed store at" in processes.log(poller), 60,
             "the poller's log line")
    assert SAYS["full"] in processes.log(poller) and poller.poll() is None
    assert "Traceback" not in processes.log(poller)


@pytest.mark.parametrize("args, says", [
    (["show", "x" * 20_000], "no task with id xxx"),
    (["show", "tâche-☃-\x01-$(id)"], "no task with id tâche-☃"),
    (["cancel", "--key", "k" * 1000], "no task is scheduled under key 'kkk"),
    (["reschedule", "task-x", "--eta", "yesterday"], "not a time: 'yesterday'"),
    (["reschedule", "task-x", "--eta", "2026-13-45T25:61"], "not a time: '2026-13-45T25:61'"),
    (["reschedule", "task-x", "--eta", "9" * 30], "due time must be between 1970 and 2106"),
    (["reschedule", "task-x", "--eta", "9" * 5000], "not a time: '999"),
    (["reschedule", "task-x", "--eta", "9999-12-31T23:59"], "due time must be between 1970 and 2106"),
    (["reschedule", "task-x", "--shift", "1e400"], "not a duration: '1e400'"),
    (["cancel", "--due-before", "now+soon", "--dry-run"], "not a duration: '+soon'"),
    (["rate", "q", "inf"], "a rate must be tasks a second > 0 and <= 1000000000, or 0 (no limit), got inf"),
    (["rate", "q", "nan"], "a rate must be tasks a second > 0 and <= 1000000000, or 0 (no limit), got nan"),
    (["rate", "q", "--", "-1"], "got -1.0"),
    (["rate", "q", "1e300"], "got 1e+300"),
    (["rate", "q", "fast"], "a rate must be tasks a second, or off; got 'fast'"),
    (["pause", "q" * 300], "a queue to pause must be a name of 1 to"),
    (["upcoming", "--after", "\x7f" * 10], "not a cursor of upcoming()"),
    (["upcoming", "--limit", "99999999999999999999"], "99999999999999999999 is not in the range"),
    (["dlq", "list", "--limit", "-1"], "-1 is not in the range x>=1"),
    (["dlq", "show", "\x1b[31mred"], "no dead letter with task id"),
    (["topics", "--grow", "no such queue!", "--partitions", "2"], "cannot be a Kafka topic"),
])
def test_a_bad_argument_is_one_line_naming_it(overrides, args, says):
    done = celery(overrides, "delayed", *args)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert done.returncode in (1, 2) and len(errors) == 1 and says in errors[0], done.stderr


@pytest.mark.parametrize("name, value, says", [
    ("visibility_timeout", "inf", "between 1 and 316224000, got 'inf'"),
    ("partitions", "0", "between 1 and 16384, got 0"),
    ("max_sleep", "nan", "> 0 and <= 3600, got 'nan'"),
])
def test_a_poller_refuses_a_number_it_cannot_use_in_one_line(overrides, name, value, says):
    done = celery(overrides, "delayed", "poller", **{f"DELAYED_{name.upper()}": value})
    assert one_line_error(done) == f"Error: delayed_{name} must be {says}"


@pytest.mark.parametrize("env, says", [
    ({"DELAYED_VISIBILITY_TIMEOUT": "inf"}, "delayed_visibility_timeout must be between 1 and 316224000, got 'inf'"),
    ({"DELAYED_KAFKA_SERVER": "127.0.0.1:9092"}, "unknown setting delayed_kafka_server: did you mean "
     "delayed_kafka_servers? (delayed_allow_unknown_settings = True accepts it)"),
])
def test_a_worker_refuses_a_bad_or_misspelt_setting_in_one_line(processes, env, says):
    """Before Celery's banner, its pool or any traceback: the worker's whole output is the one line."""
    worker = processes.worker(env=env)
    assert worker.wait(timeout=120) == 1
    assert processes.log(worker).splitlines() == [f"celery-delayed cannot start this worker: {says}"]


@pytest.mark.parametrize("args", [["web", "--port", "{port}"], ["poller", "--metrics-port", "{port}"]])
def test_a_port_in_use_is_one_line(overrides, args):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = celery(overrides, "delayed", *(arg.format(port=port) for arg in args))
    assert one_line_error(done) == f"Error: cannot serve on 127.0.0.1:{port}: Address already in use"


def test_a_key_of_ours_that_something_else_wrote_is_one_line(overrides):
    """A key of the store of another type (written by hand or by another program: WRONGTYPE): the
    command that reads it says so in one line, not Redis's traceback."""
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    for p in range(settings.partitions):
        store.redis.set(store.keys.recurring(p), "oops")
    done = celery(overrides, "delayed", "schedules", "list")
    assert one_line_error(done).startswith("Error: the delayed store refused a command: WRONGTYPE"), done.stderr

