"""The poller under failure, with real pollers as OS processes and real etcd, Redis and Kafka."""
from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from celery_delayed.envelope import Envelope
from celery_delayed.poller.leadership import Leadership, make_etcd
from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetters
from tasks import create_app

from .support import ROOT, TopicReader, environment, envelopes, leaders, wait_for


def now_ms() -> int:
    return int(time.time() * 1000)


def small_topic(settings: Settings, queue: str) -> str:
    """The queue's topic, created with a broker limit of 1000 bytes per message (``max.message.bytes``)."""
    topic = settings.topic(queue)
    admin = AdminClient(settings.kafka())
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "1000"})])[topic].result()
    return topic


def too_big(task_id: str, queue: str) -> bytes:
    """A stored message that the producer sends and a :func:`small_topic` refuses."""
    return Envelope(task_id=task_id, queue=queue, headers={"task": "tasks.demo.add", "id": task_id},
                    body=base64.b64encode(os.urandom(3000)), content_type="application/json",
                    content_encoding="utf-8").encode()


def test_kill_9_of_a_poller_mid_dispatch_loses_no_task(overrides, processes):
    n = 100_000
    overrides.update(delayed_partitions=8, delayed_visibility_timeout=3)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    assert store.schedule_many(envelopes(n, queue, now_ms())) == n

    first, second = processes.poller(), processes.poller()
    wait_for(lambda: set(leaders(settings).values()) == {first.pid, second.pid}, 30,
             "both pollers to lead partitions")
    wait_for(lambda: reader.read(timeout=0.05) is not None and len(reader.keys) >= n // 5, 60,
             "a fifth of the tasks on Kafka")
    os.kill(first.pid, signal.SIGKILL)
    killed = time.monotonic()
    killed_at = len(reader.keys)
    wait_for(lambda: set(leaders(settings).values()) == {second.pid} and len(leaders(settings)) == 8,
             settings.lease_ttl + 10, "the standby to take the dead poller's partitions")
    takeover = time.monotonic() - killed

    keys = reader.read_until(n, timeout=120)
    reader.close()
    lost, duplicates = n - len(keys), sum(keys.values()) - len(keys)
    print(f"\nkill -9 after {killed_at} of {n} delivered: lost={lost} duplicates={duplicates}, "
          f"standby led all partitions {takeover:.2f} s later (TTL {settings.lease_ttl} s)")
    assert killed_at < n, "the poller was killed after dispatch had ended: the test proved nothing"
    assert lost == 0
    assert takeover < settings.lease_ttl + 1.5  # TTL + 1 s, with half a second of slack for this machine
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 30,
             "the store to be empty")


def signalled_at_first_produce(overrides: dict, processes, n: int, visibility_s: int, signal_name: str
                               ) -> tuple[Settings, DelayedStore, TopicReader, subprocess.Popen, Path]:
    """``n`` tasks due in one partition, a reader of their topic, and a poller sending itself ``signal_name``
    at its first produce (:mod:`.killer_poller`): settings, store, reader, the poller and its log."""
    overrides.update(delayed_partitions=1, delayed_visibility_timeout=visibility_s)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    assert store.schedule_many(envelopes(n, queue, now_ms())) == n
    log = processes.logdir / f"{signal_name}.log"
    poller = subprocess.Popen([sys.executable, "-m", "tests.integration.killer_poller", "before_produce", "0", "any",
                               signal_name], cwd=ROOT, env=environment(overrides), stdout=log.open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    processes.procs.append((poller, log))
    return settings, store, reader, poller, log


def test_the_next_leader_dispatches_what_a_killed_one_claimed_without_waiting_for_the_visibility_timeout(
        overrides, processes):
    """A poller killed between its claim and Kafka (its first produce): the copies it claimed are in flight
    under a visibility timeout of ten minutes; the poller that leads next sends them within its takeover."""
    n = 50
    settings, store, reader, killer, log = signalled_at_first_produce(overrides, processes, n, 600, "SIGKILL")
    assert killer.wait(timeout=60) == -signal.SIGKILL, log.read_text()
    assert "killing myself" in log.read_text() and store.counts()[0]["inflight"] == n

    processes.poller()
    keys = reader.read_until(n, timeout=settings.lease_ttl + 20)
    reader.close()
    assert len(keys) == n, f"{n - len(keys)} of the killed poller's claimed tasks not sent within its takeover"
    wait_for(lambda: store.counts()[0]["inflight"] + store.counts()[0]["scheduled"] == 0, 30, "the store to be empty")


def test_a_leader_paused_past_its_claim_s_deadline_sends_none_of_its_copies_when_it_goes_on(overrides, processes):
    """A leader stopped (SIGSTOP: a paused VM, a debugger) between its claim and Kafka, past its lease and its
    claim's visibility timeout: the next leader sends the copies.  Continued, the old one sent every copy it
    had claimed again, however late: a task whose run record (``delayed_done_ttl``) had lapsed meanwhile ran
    twice.  A copy whose claim expired is another claim's now: it sends none."""
    n = 50
    settings, store, reader, stopped, log = signalled_at_first_produce(overrides, processes, n, 3, "SIGSTOP")
    wait_for(lambda: "killing myself" in log.read_text(), 60, "the leader to stop itself before its first produce")
    processes.poller()
    assert len(reader.read_until(n, timeout=settings.lease_ttl + 20)) == n
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 30, "the store to be empty")
    time.sleep(settings.visibility_timeout)  # its claim expired (the next leader may take its copies back sooner)
    os.kill(stopped.pid, signal.SIGCONT)
    wait_for(lambda: "lost its etcd lease" in log.read_text(), 30, "the old leader to go on")
    time.sleep(3)
    while reader.read(timeout=1.0):
        pass
    reader.close()
    assert sum(reader.keys.values()) == n, f"{sum(reader.keys.values()) - n} copies sent again by the old leader"


def leading_one_partition(overrides: dict) -> tuple[Settings, DelayedStore, Leadership, int, Poller]:
    """One partition holding a due task, led by an in-process poller (not running): settings, store,
    the leader, its token and its poller."""
    settings = Settings.from_conf(overrides, partitions=1)
    store = DelayedStore(settings)
    store.schedule_many(envelopes(1, overrides["task_default_queue"], now_ms() - 1000))
    leader = Leadership(settings)
    (token,) = leader.step().values()
    return settings, store, leader, token, Poller(settings, store=store, leadership=leader)


def test_ex_leader_whose_lease_was_revoked_cannot_claim(overrides):
    settings, store, old, old_token, poller = leading_one_partition(overrides)
    make_etcd(settings).revoke_lease(old._lease.id)  # as if it was paused past its TTL
    new = Leadership(settings)
    (new_token,) = new.step().values()
    assert new_token > old_token
    store.claim(0, new_token, 0)  # the new leader's first claim records its token

    assert old.owned() == {0: old_token}  # the paused leader has not noticed yet...
    assert poller.tick() == 0  # ...but its claim is refused
    assert poller.stats["fenced"] == 1
    assert store.get("task-0")["state"] == "scheduled"
    assert old.owned() == {}
    assert old.step() == {}  # and etcd no longer gives it the partition
    new.release()
    old.release()


def test_sigterm_hands_partitions_over_without_waiting_for_the_ttl(overrides, processes):
    overrides.update(delayed_lease_ttl=15)
    settings = Settings.from_conf(overrides)
    first = processes.poller()
    wait_for(lambda: set(leaders(settings).values()) == {first.pid}, 30, "the first poller to lead")
    second = processes.poller()
    wait_for(lambda: set(leaders(settings).values()) == {first.pid, second.pid}, 30,
             "the partitions to be shared")

    started = time.monotonic()
    first.send_signal(signal.SIGTERM)
    wait_for(lambda: leaders(settings) and set(leaders(settings).values()) == {second.pid}
             and len(leaders(settings)) == settings.partitions, 10, "the standby to take every partition")
    took = time.monotonic() - started
    print(f"\nhandover after SIGTERM took {took:.2f} s (lease TTL {settings.lease_ttl} s)")
    assert took < settings.lease_ttl / 2
    assert first.wait(timeout=15) == 0

    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    DelayedStore(settings).schedule_many(envelopes(50, queue, now_ms() + 500))
    assert len(reader.read_until(50, timeout=30)) == 50
    reader.close()


def test_no_dispatch_while_etcd_is_down_then_recovery(overrides, processes, servers):
    servers.require_ours("etcd")
    settings = Settings.from_conf(overrides)  # lease TTL 2 s
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    poller = processes.poller()
    wait_for(lambda: len(leaders(settings)) == settings.partitions, 30, "the poller to lead")

    servers.stop("etcd")
    stopped = time.monotonic()
    store.schedule_many(envelopes(200, queue, now_ms() + 3000))
    while time.monotonic() - stopped < 8:  # past the due time and past the TTL
        reader.read(timeout=0.2)
    assert len(reader.keys) == 0, "a poller that cannot reach etcd dispatched tasks"
    assert sum(r["scheduled"] for r in store.counts()) == 200
    assert poller.poll() is None

    servers.start("etcd")
    assert len(reader.read_until(200, timeout=60)) == 200
    reader.close()


def test_kafka_outage_loses_nothing_and_dispatch_resumes(overrides, processes, servers):
    servers.require_ours("kafka")
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    poller = processes.poller()
    wait_for(lambda: len(leaders(settings)) == settings.partitions, 30, "the poller to lead")

    servers.stop("kafka")
    store.schedule_many(envelopes(1000, queue, now_ms() + 500))
    time.sleep(4)  # due while Kafka is down
    assert sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 1000
    servers.start("kafka")

    reader = TopicReader(settings, settings.topic(queue))
    keys = reader.read_until(1000, timeout=90)
    reader.close()
    assert len(keys) == 1000
    assert poller.poll() is None
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 30,
             "the store to be empty")


def test_undecodable_stored_message_goes_to_the_dead_letter_queue(overrides, processes):
    overrides.update(delayed_partitions=1)  # the poller's too: the store's layout is checked
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    store.schedule_many([("poison", now_ms(), b"\x80not an envelope")])  # stored as given: bytes are not checked
    store.schedule_many(envelopes(10, queue, now_ms()))
    processes.poller()
    assert len(reader.read_until(10, timeout=30)) == 10  # the loop went on past the poison
    reader.close()
    letters = DeadLetters(store)
    letter = wait_for(lambda: letters.get("poison"), 10, "the poison message in the dead-letter queue")
    assert letter.source == "poller" and "undecodable" in letter.reason
    assert letter.message == b"\x80not an envelope"
    assert store.get("task-0") is None and store.message("poison") is None


def test_overdue_backlog_drains_at_the_configured_rate(overrides, processes):
    overrides.update(delayed_max_dispatch_rate=500)
    settings = Settings.from_conf(overrides)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    DelayedStore(settings).schedule_many(envelopes(2000, queue, now_ms() - 60_000))  # an outage's backlog
    processes.poller()
    reader.read_until(1, timeout=30)
    started = time.monotonic()
    assert len(reader.read_until(2000, timeout=60)) == 2000
    took = time.monotonic() - started
    print(f"\n2000 overdue tasks at max 500/s drained in {took:.1f} s")
    assert took >= 2.5  # 1999 more at <= 500/s, after at most a one-second burst


def test_poller_metrics_endpoint(overrides, processes):
    import urllib.request

    port = 19400 + os.getpid() % 500
    settings = Settings.from_conf(overrides)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    DelayedStore(settings).schedule_many(envelopes(20, queue, now_ms()))
    DelayedStore(settings).schedule_many(envelopes(5, queue, now_ms() + 3_600_000, prefix="later"))
    processes.start("poller", "delayed", "poller", "--metrics-port", str(port))
    reader.read_until(20, timeout=30)
    reader.close()

    def scrape():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        return text if "celery_delayed_dispatched_total 20.0" in text else None

    text = wait_for(scrape, 20, "the metrics endpoint to count 20 dispatched tasks")
    assert "celery_delayed_dispatch_lag_seconds_count 20.0" in text
    assert sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("celery_delayed_scheduled{")) == 5
    assert 'celery_delayed_leading{partition="0"} 1.0' in text
    assert "celery_delayed_superseded_total 0.0" in text and "celery_delayed_fence_rejections_total 0.0" in text


def test_message_kafka_refuses_goes_to_the_dead_letter_queue(overrides, processes):
    overrides.update(delayed_partitions=1)  # the poller's too: the store's layout is checked
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    topic = small_topic(settings, queue)
    big = too_big("big", queue)
    store.schedule_many([("big", now_ms(), big), *envelopes(5, queue, now_ms())])
    reader = TopicReader(settings, topic)
    processes.poller()
    assert len(reader.read_until(5, timeout=30)) == 5
    reader.close()
    letter = wait_for(lambda: DeadLetters(store).get("big"), 30, "the refused message in the dead-letter queue")
    assert "Kafka refused the message" in letter.reason and letter.message == big
    wait_for(lambda: store.get("big") is None, 10, "the refused message to leave the store")


def test_a_poison_pill_is_dead_lettered_with_a_failure_result_and_the_poller_lives_on(overrides, processes):
    overrides.update(delayed_partitions=1)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    poison = f"poison-{uuid.uuid4()}"  # results are not isolated per test: a fresh id has none
    # (the queue after the headers: the poller's route reading must parse the meta to find it)
    deep = (b"\x01" + f'{{"id":"{poison}","h":'.encode() + b"[" * 100_000 + b"]" * 100_000
            + f',"q":"{queue}"}}\n{{}}'.encode())
    store.schedule_many([(poison, now_ms(), deep), *envelopes(10, queue, now_ms())])
    poller = processes.poller()
    assert len(reader.read_until(10, timeout=30)) == 10
    reader.close()
    letter = wait_for(lambda: DeadLetters(store).get(poison), 10, "the poison pill in the dead-letter queue")
    assert letter.source == "poller" and "undecodable" in letter.reason and letter.message == deep
    result = create_app(**overrides).AsyncResult(poison)
    result.get(timeout=10, propagate=False)  # a waiter wakes up...
    assert result.state == "FAILURE"  # ...with the reason
    assert type(result.result).__name__ == "DeadLettered" and "undecodable stored message" in str(result.result)
    assert poller.poll() is None, "the poller died:\n" + processes.log(poller)[-3000:]
    assert store.get(poison) is None


def test_a_task_kafka_refuses_fails_its_result_instead_of_hanging(overrides, processes):
    app = create_app(**overrides)
    small_topic(Settings.from_conf(overrides), overrides["task_default_queue"])
    refused = app.tasks["tasks.demo.add"].apply_async((base64.b64encode(os.urandom(3000)).decode(), "x"),
                                                       countdown=1.5)
    processes.poller()
    with pytest.raises(Exception, match="dead-lettered by the poller: Kafka refused the message"):
        refused.get(timeout=60)
    assert refused.state == "FAILURE"


def test_a_store_gone_away_mid_dispatch_is_retried_a_second_apart_not_in_a_busy_loop(overrides, processes, tmp_path):
    """Redis killed while the poller leads partitions with tasks due: every claim fails at once
    (connection refused).  The poller tries again about once a second, saying so, rather than in a
    loop as fast as the refusals come (a log line and a core's worth of CPU each time: 124 lines in
    a second, the review saw)."""
    from .support import own_redis
    with own_redis(tmp_path / "redis") as client:
        port = client.connection_pool.connection_kwargs["port"]
        overrides["delayed_redis_url"] = f"redis://127.0.0.1:{port}/0"
        store = DelayedStore(Settings.from_conf(overrides))
        start = int(time.time() * 1000) + 2_000
        for second in range(30):  # tasks due every 10 ms for 30 s: the poller claims all the time
            store.schedule_many((f"{task_id}-{second}", start + second * 1000 + int(task_id.split("-")[1]) * 10,
                                 data) for task_id, _, data in envelopes(100, overrides["task_default_queue"], 0))
        poller = processes.poller()
        wait_for(lambda: "leads partitions" in processes.log(poller), 30, "the poller to lead")
        time.sleep(max(0.0, start / 1000 + 2 - time.time()))  # dispatching
        client.shutdown(nosave=True)  # mid-claims: the paused queues were read less than a second ago
    time.sleep(5)
    failures = processes.log(poller).count("claim of partition")
    assert poller.poll() is None and 1 <= failures <= 20, f"{failures} failed claims logged in 5 s"
