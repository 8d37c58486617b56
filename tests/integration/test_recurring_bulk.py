"""Recurring schedules at scale, on real servers: a poller advances a claim's occurrences in bulk, a
poller's start leaves healthy schedules alone, and a put killed after its compare-and-set is completed.

The round trips are counted by the commands a Redis of the test's own served (``INFO commandstats``):
no other client talks to it.
"""
from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import textwrap

from celery_delayed import Schedules, store_of
from celery_delayed.poller.loop import PUTS_EVERY
from celery_delayed.recurring.definitions import BEAT, Definitions
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.layout import member_of, parse_stored
from tasks import create_app

from .support import ROOT, environment, own_redis, wait_for

SCHEDULES = 200


def calls(client, command: str) -> int:
    """How many times the Redis of ``client`` ran ``command`` since its stats were reset."""
    return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def upserted(overrides: dict, count: int, every_s: float) -> Schedules:
    """``count`` schedules of ``tasks.demo.tick`` every ``every_s`` (anchored at 0: all due at once)."""
    app = create_app(**overrides)
    schedules = Schedules(app)
    for i in range(count):
        schedules.upsert(f"bulk:{i}", app.signature("tasks.demo.tick", args=(overrides["delayed_key_prefix"],)),
                         every_s)
    return schedules


def test_a_poller_advances_the_occurrences_of_a_claim_in_bulk(overrides, processes, tmp_path):
    """200 schedules due at the same instants: the poller advances each claim's occurrences in a few round
    trips (their definitions read at once, their successors and compare-and-sets pipelined, no ``SCRIPT
    EXISTS`` before a pipeline), not several per occurrence; every chain moves on, each occurrence once."""
    with own_redis(tmp_path / "redis") as client:
        overrides["delayed_redis_url"] = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
        schedules = upserted(overrides, SCHEDULES, 3)
        first = {d.schedule_id: d.pending_ms for d in schedules.all()}
        client.config_resetstat()
        processes.poller()
        wait_for(lambda: all((d.pending_ms or 0) >= first[d.schedule_id] + 6000 for d in schedules.all()), 60,
                 "every chain to move on twice")
        reads, script_exists = client.info("stats")["total_reads_processed"], calls(client, "script|exists")
    assert len(first) == SCHEDULES
    assert reads < 2 * SCHEDULES, f"{reads} round trips to advance {2 * SCHEDULES} occurrences (and claim them)"
    assert script_exists == 0, f"{script_exists} SCRIPT EXISTS sent before pipelines"


def test_a_poller_start_writes_no_healthy_schedule_again(overrides, tmp_path):
    """A start (its ``beat_schedule`` sync) over healthy schedules runs no script: it writes none of their
    pending occurrences again (which would supersede a copy another poller has in flight)."""
    with own_redis(tmp_path / "redis") as client:
        overrides["delayed_redis_url"] = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
        upserted(overrides, 50, 3600)
        client.config_resetstat()
        Definitions(DelayedStore(Settings.from_conf(overrides))).sync({}, BEAT)
        scripts = calls(client, "evalsha") + calls(client, "eval")
    assert scripts == 0, f"{scripts} scripts run by a start over 50 healthy schedules"


KILLED_PUT = textwrap.dedent("""
    import os, signal, sys
    from celery_delayed import Schedules
    from celery_delayed.recurring.definitions import Definitions
    from tasks import create_app

    def dying(self, definitions):  # the put's compare-and-set is done: die before its occurrence is written
        os.kill(os.getpid(), signal.SIGKILL)

    Definitions._write_pending = dying
    app = create_app()
    Schedules(app).upsert("killed", app.signature("tasks.demo.tick", args=(sys.argv[1],)), 3600)
""")


def test_a_put_killed_after_its_compare_and_set_is_completed_by_the_next_poller_start(overrides, processes):
    run = overrides["delayed_key_prefix"]
    store = store_of(create_app(**overrides))
    killed = subprocess.run([sys.executable, "-c", KILLED_PUT, run], cwd=ROOT, env=environment(overrides),
                            capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    definitions = Definitions(store)
    held = definitions.get("killed")
    assert held is not None and held.pending_id is not None
    assert store.get(held.pending_id) is None  # the put died between its compare-and-set and its write

    processes.poller()
    wait_for(lambda: store.get(held.pending_id) is not None, 30, "the poller's start to write the occurrence")
    assert store.get(held.pending_id)["state"] == "scheduled"
    assert store.redis.hlen(store.keys.recurring_putting(store.partition("killed"))) == 0


def test_a_put_killed_after_its_compare_and_set_is_completed_by_a_running_poller(overrides, processes):
    """A put whose client dies (or whose write fails) between its compare-and-set and its occurrence, while
    the pollers run: the old version's occurrence is stale, the new one never written, so the schedule ran
    no more until a poller started.  A running poller completes a put whose mark two looks find unchanged."""
    run = overrides["delayed_key_prefix"]
    store = store_of(create_app(**overrides))
    poller = processes.poller()
    wait_for(lambda: "started" in processes.log(poller), 30, "the poller to start (its start completes puts too)")
    killed = subprocess.run([sys.executable, "-c", KILLED_PUT, run], cwd=ROOT, env=environment(overrides),
                            capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    held = Definitions(store).get("killed")
    assert held is not None and store.get(held.pending_id) is None
    wait_for(lambda: store.get(held.pending_id) is not None, 2 * PUTS_EVERY + 10, "the poller to complete the put")
    assert store.redis.hlen(store.keys.recurring_putting(store.partition("killed"))) == 0


def test_a_definition_of_the_first_format_is_read_and_advanced_then_stored_packed(overrides, processes):
    """A definition written before the packed format (one JSON object, the template in base64) still
    reads the same, and a poller advances its chain (``lua/recurring_put.lua`` reads both): the chain's
    next write stores it packed."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    schedule_id = f"{run}:first"  # derived task ids of its own: the result backend is shared
    held = schedules.upsert(schedule_id, app.signature("tasks.demo.tick", args=(run,)), 1)
    key = store.keys.recurring(store.partition(schedule_id))
    store.redis.hset(key, schedule_id, json.dumps({
        "rule": held.rule, "template": base64.b64encode(held.template).decode(), "origin": held.origin,
        "version": held.version, "pending_ms": held.pending_ms}))
    assert schedules.get(schedule_id) == held

    processes.poller()
    wait_for(lambda: schedules.get(schedule_id).pending_ms >= held.pending_ms + 2000, 30, "the chain to move on")
    assert not store.redis.hget(key, schedule_id).startswith(b"{")


def test_an_occurrence_dispatched_again_after_its_advance_is_no_overlap_of_itself(overrides):
    """A poller killed (or stopped past its lease) after advancing an occurrence of an ``overlap=False``
    schedule, before Kafka had it: the copy, claimed again (the new leader's handover, or the visibility
    timeout, both within the grace), goes.  The definition's last run is that very occurrence, which no
    worker started: taken for a run still going, the copy was dropped unsent and the occurrence lost."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    schedule_id = f"{run}:alone"
    held = schedules.upsert(schedule_id, app.signature("tasks.demo.tick", args=(run,)), 60, overlap=False)
    stored = store.redis.hget(store.keys.msgs(store.partition(held.pending_id)), member_of(held.pending_id))
    _, _, message = parse_stored(stored)
    definitions = Definitions(store)
    first = definitions.advance_many([message], held.pending_ms)[0]  # the killed poller's
    again = definitions.advance_many([message], held.pending_ms + 2000)[0]  # its successor's, 2 s on
    assert first.goes and first.fired
    assert again.goes and not again.overlapped and not again.fired, again
