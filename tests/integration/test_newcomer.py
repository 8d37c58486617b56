"""A newcomer's mistakes (issue 45), as the user sees them: each is named, in the poller's log and in
``delayed status``, with what to do; none is silent.  "etcd stopped" and "a wrong Kafka address" point
the settings at a loopback port where nothing listens: the shared servers are never touched."""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

from celery_delayed.poller import loop
from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.inspection import totals

from .support import envelopes, wait_for
from .test_cli import celery


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def schedule_one_due_now(overrides: dict) -> str:
    """One task of the test's queue, due now, in the store; its queue."""
    queue = overrides["task_default_queue"]
    DelayedStore(Settings.from_conf(overrides)).schedule_many(envelopes(1, queue, int(time.time() * 1000)))
    return queue


def test_a_wrong_kafka_address_is_named_in_the_log_status_and_the_stop_summary(overrides, processes):
    wrong = f"127.0.0.1:{unused_port()}"
    overrides["delayed_kafka_servers"] = wrong
    queue = schedule_one_due_now(overrides)
    poller = processes.poller()
    named = (f"cannot create topic {overrides['delayed_topic_prefix']}{queue} on Kafka at {wrong} "
             "(delayed_kafka_servers)")
    wait_for(lambda: named in processes.log(poller), 60, "the poller's warning naming the Kafka address")
    status = celery(overrides, "delayed", "status")
    assert f"Kafka at {wrong} (delayed_kafka_servers) cannot be reached (" in status.stdout, status.stderr
    # its task is failing, not hidden by the nacks that keep it due again a second on (issue 45, row 3)
    assert "1 task(s) failing: their delivery to Kafka failed" in status.stdout, status.stdout
    every = totals(json.loads(celery(overrides, "delayed", "status", "--json").stdout)["partitions"])
    assert every["failing"] == 1 and every["oldest_overdue_s"] > 0, every
    processes.warm_stop(poller)
    log = processes.log(poller)
    assert "|FAIL|rdkafka#" not in log  # librdkafka's raw lines: through logging now
    assert int(re.search(r"'delivery_failed': (\d+)", log)[1]) >= 1, log[-2000:]


def test_an_etcd_that_cannot_be_reached_is_named_once_and_in_status(overrides, processes):
    wrong = f"http://127.0.0.1:{unused_port()}"
    overrides["delayed_etcd_endpoints"] = wrong
    poller = processes.poller()
    named = f"cannot prove leadership through etcd at {wrong} (delayed_etcd_endpoints)"
    wait_for(lambda: named in processes.log(poller), 60, "the poller's warning naming the etcd address")
    status = celery(overrides, "delayed", "status")  # meanwhile the poller steps on, twice a second
    assert f"etcd at {wrong} (delayed_etcd_endpoints) cannot be reached (" in status.stdout, status.stderr
    fleet = json.loads(celery(overrides, "delayed", "status", "--json").stdout)["fleet"]
    assert fleet["etcd_error"].startswith(f"etcd at {wrong} (delayed_etcd_endpoints) cannot be reached (")
    assert fleet["pollers"] is None and fleet["leaderless"] is None
    assert processes.log(poller).count(named) == 1


def test_status_shows_the_pollers_and_the_partitions_each_leads(overrides, processes):
    processes.poller()
    wait_for(lambda: "leads partitions 0-3" in celery(overrides, "delayed", "status").stdout, 60,
             "status naming the poller leading every partition")
    fleet = json.loads(celery(overrides, "delayed", "status", "--json").stdout)["fleet"]  # the same, for machines
    assert [poller["partitions"] for poller in fleet["pollers"]] == [[0, 1, 2, 3]], fleet
    assert fleet["leaderless"] == [] and fleet["etcd_error"] is None
    kafka = fleet["kafka"]
    assert kafka["address"] == f"Kafka at {Settings.from_conf(overrides).kafka_servers} (delayed_kafka_servers)"
    assert kafka["warnings"] == [] and kafka["topics"] is not None and kafka["idle_workers"] >= 0
    processes.stop_all()
    done = celery(overrides, "delayed", "status")
    assert "no poller alive: nothing is dispatched; start one with `celery -A proj delayed poller`" in done.stdout
    fleet = json.loads(celery(overrides, "delayed", "status", "--json").stdout)["fleet"]
    assert fleet["pollers"] == [] and fleet["leaderless"] == [0, 1, 2, 3]


def test_a_queue_no_worker_reads_is_named_by_the_poller_and_status(overrides, monkeypatch, caplog):
    monkeypatch.setattr(loop, "READERS_EVERY", 0.5, raising=False)  # raising: a test that fails on what it asserts
    queue = schedule_one_due_now(overrides)
    settings = Settings.from_conf(overrides)
    poller = Poller(settings)
    runner = threading.Thread(target=poller.run)
    warning = (f"queue {queue}: 1 task(s) wait on Kafka topic {settings.topic(queue)} and no worker of group "
               f"{settings.consumer_group} reads it: start a worker of the queue (celery worker -Q {queue}) on an "
               "app that calls celery_delayed.install(app); a worker without it never reads Kafka")
    with caplog.at_level(logging.INFO, logger="celery_delayed"):
        runner.start()
        try:
            wait_for(lambda: warning in caplog.messages, 60, "the poller's warning of the unread queue")
            time.sleep(2 * loop.READERS_EVERY)
        finally:
            poller.stop()
            runner.join(30)
    assert caplog.messages.count(warning) == 1  # once per change, not every look
    assert warning in celery(overrides, "delayed", "status").stdout.splitlines()
    assert warning in json.loads(celery(overrides, "delayed", "status", "--json").stdout)["fleet"]["kafka"]["warnings"]

