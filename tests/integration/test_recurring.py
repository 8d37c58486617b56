"""Recurring schedules on real servers: ``beat_schedule`` run by pollers (no beat process), dynamic
schedules, and pollers killed (``kill -9``) while dispatching an occurrence.

The demo task ``tasks.demo.tick`` counts its runs per nominal time; every check is that each nominal
time ran once, and that the chain of occurrences went on.
"""
from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time

import pytest
import redis

from celery_delayed import Schedules, store_of
from celery_delayed.envelope import Envelope
from celery_delayed.recurring.definitions import Definitions
from celery_delayed.recurring.occurrences import occurrence
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from tasks import create_app

from .support import ROOT, environment, leaders, wait_for

PERIOD_MS = 2000
#: The schedule id of the tests' ``beat_schedule`` entry.
BEAT_ID = "beat:tick"


def beat(run: str) -> dict:
    """A ``beat_schedule`` of one entry: ``tasks.demo.tick(run)`` every 2 seconds."""
    return {"tick": {"task": "tasks.demo.tick", "schedule": PERIOD_MS / 1000, "args": [run]}}


class Ticks:
    """The runs ``tasks.demo.tick`` recorded for ``run``."""

    def __init__(self, settings: Settings, run: str) -> None:
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.run = run

    def counts(self) -> dict[int, int]:
        """Nominal time -> how many times it ran."""
        return {int(k): int(v) for k, v in self.redis.hgetall(f"demo:{self.run}:ticks").items()}

    def runs(self) -> dict[int, dict]:
        """Nominal time -> its (first) run: label, version, task id, start ms."""
        return {int(k): json.loads(v) for k, v in self.redis.hgetall(f"demo:{self.run}:tick").items()}

    def after(self, ms: int) -> list[int]:
        return sorted(n for n in self.counts() if n > ms)

    def check_chain(self) -> list[int]:
        """Each nominal time ran once, on the rule's grid; a time was skipped only after a run that was
        itself late (misfire: the next time after the late dispatch); returns the nominal times."""
        counts, runs = self.counts(), self.runs()
        assert {n: c for n, c in counts.items() if c != 1} == {}, "a nominal time ran more than once"
        times = sorted(counts)
        assert all(n % PERIOD_MS == 0 for n in times)
        for a, b in itertools.pairwise(times):
            if b - a > PERIOD_MS:  # a's dispatch came at or after the time skipped, so a ran no earlier
                assert runs[a]["started"] >= a + PERIOD_MS - 100, f"{b - a} ms between runs {a} and {b}"
        return times


def now_ms() -> int:
    return int(time.time() * 1000)


def test_beat_schedule_runs_on_two_pollers_each_time_once_across_a_kill_9_of_the_leading_one(overrides, processes):
    run = overrides["delayed_key_prefix"]
    overrides.update(beat_schedule=beat(run), delayed_visibility_timeout=3)
    settings = Settings.from_conf(overrides)
    ticks = Ticks(settings, run)
    processes.worker()
    pollers = {p.pid: p for p in (processes.poller(), processes.poller())}
    wait_for(lambda: set(leaders(settings).values()) == set(pollers), 30, "both pollers to lead partitions")
    wait_for(lambda: len(ticks.counts()) >= 3, 30, "three runs of the beat_schedule entry")

    definitions = Definitions(DelayedStore(settings))
    pending = definitions.get(BEAT_ID)
    assert pending is not None and pending.version == 1  # two pollers synced it, one version
    victim = leaders(settings)[definitions.store.partition(pending.pending_id)]  # leads the pending occurrence
    pollers[victim].send_signal(signal.SIGKILL)
    killed_ms = now_ms()
    wait_for(lambda: len(ticks.after(killed_ms)) >= 4, 60, "four runs after the kill")

    times = ticks.check_chain()
    assert pending.pending_ms in times, "the occurrence pending in the killed poller's partition was lost"
    assert len(times) >= 7


def test_beat_schedule_entries_are_synced_at_poller_start_and_removed_when_no_longer_configured(overrides, processes):
    run = overrides["delayed_key_prefix"]
    settings = Settings.from_conf(overrides)
    definitions = Definitions(DelayedStore(settings))
    ticks = Ticks(settings, run)
    processes.worker()
    first = processes.poller(overrides={**overrides, "beat_schedule": beat(run)})
    wait_for(lambda: len(ticks.counts()) >= 2, 30, "two runs of the beat_schedule entry")
    processes.warm_stop(first)

    started = processes.poller()  # the entry is no longer configured
    wait_for(lambda: definitions.get(BEAT_ID) is None, 30, "the entry to be removed")
    stopped_ms = now_ms()
    time.sleep(3 * PERIOD_MS / 1000)
    assert ticks.after(stopped_ms + 1000) == []  # what was in flight at the removal may still have run
    assert started.poll() is None
    ticks.check_chain()


def test_a_dynamic_schedule_is_created_changed_and_removed(overrides, processes):
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules = Schedules(app)
    ticks = Ticks(Settings.from_conf(overrides), run)
    processes.worker()
    processes.poller()

    first = schedules.upsert("dyn", app.signature("tasks.demo.tick", args=(run, "v1")), PERIOD_MS / 1000)
    assert schedules.upsert("dyn", app.signature("tasks.demo.tick", args=(run, "v1")), PERIOD_MS / 1000) == first
    wait_for(lambda: len(ticks.counts()) >= 2, 30, "two runs of v1")

    changed = schedules.upsert("dyn", app.signature("tasks.demo.tick", args=(run, "v2")), PERIOD_MS / 1000)
    assert changed.version == first.version + 1
    wait_for(lambda: [r for r in ticks.runs().values() if r["label"] == "v2"][1:], 30, "two runs of v2")
    runs = ticks.runs()
    v1 = [n for n, r in runs.items() if r["label"] == "v1"]
    v2 = [n for n, r in runs.items() if r["label"] == "v2"]
    assert max(v1) < min(v2), "v1 ran after v2 had started: two chains"
    assert {runs[n]["version"] for n in v2} == {changed.version}

    assert schedules.remove("dyn")
    removed_ms = now_ms()
    assert schedules.get("dyn") is None
    time.sleep(3 * PERIOD_MS / 1000)
    assert ticks.after(removed_ms + 1000) == []
    ticks.check_chain()


def test_a_stale_occurrence_is_dropped_at_dispatch_not_run(overrides, processes):
    """The copy of an old version's occurrence that a change could not cancel (in flight, or left by a
    crash between the change and its cancel) is dropped by the poller, and writes no successor."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    if (to_the_hour := 3600 - time.time() % 3600) < 60:  # the new version's own first run must not come in the test
        time.sleep(to_the_hour + 1)
    old = schedules.upsert("stale", app.signature("tasks.demo.tick", args=(run, "old")), 3600)
    new = schedules.upsert("stale", app.signature("tasks.demo.tick", args=(run, "new")), 3600)
    due = now_ms()
    task_id, message = occurrence(Envelope.decode(old.template), "stale", old.version, due - due % 3600_000,
                                  store.settings.compress_min_bytes)
    store.schedule(task_id, due, message)  # due now, an hour's rule: its successor would be an hour away
    processes.worker()
    processes.poller()

    wait_for(lambda: store.get(task_id) is None, 30, "the stale occurrence to leave the store")
    time.sleep(3)  # a worker would have run it by now
    assert Ticks(store.settings, run).counts() == {}
    assert schedules.get("stale") == new  # its pending occurrence unchanged: no successor was written
    assert store.get(new.pending_id)["state"] == "scheduled"


@pytest.mark.parametrize("point, overlap", [("before_produce", True), ("before_ack", True), ("before_produce", False)])
def test_kill_9_of_a_poller_while_dispatching_an_occurrence_loses_none_and_runs_none_twice(overrides, processes,
                                                                                           point, overlap):
    """The poller dies right after writing the occurrence's successor (``before_produce``), or once
    Kafka has the occurrence but before the store forgot it (``before_ack``); the next poller to lead takes
    the occurrence back at once (not after the visibility timeout, ten minutes here), dispatches it again
    and writes the same successor.  A schedule that must not overlap too: the occurrence its definition
    names as its last run is this very one, which no worker started (it is not overlapping itself)."""
    run = overrides["delayed_key_prefix"]
    overrides.update(beat_schedule=beat(run), delayed_visibility_timeout=600)
    overrides["beat_schedule"]["tick"]["overlap"] = overlap
    settings = Settings.from_conf(overrides)
    ticks = Ticks(settings, run)
    processes.worker()
    log = processes.logdir / f"killer-{point}.log"
    killer = subprocess.Popen([sys.executable, "-m", "tests.integration.killer_poller", point], cwd=ROOT,
                              env=environment(overrides), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    processes.procs.append((killer, log))
    assert killer.wait(timeout=60) == -signal.SIGKILL, log.read_text()
    assert "killing myself" in log.read_text()
    killed = Definitions(DelayedStore(settings)).get(BEAT_ID)
    assert killed is not None

    processes.poller()
    killed_ms = now_ms()
    wait_for(lambda: len(ticks.after(killed_ms)) >= 3, 60, "three runs after the kill")
    # (not overlapping, the next occurrence is skipped while the one taken back is on its way: off the grid)
    times = ticks.check_chain() if overlap else sorted(ticks.counts())
    first = times[0]
    assert killed.pending_ms == first + PERIOD_MS  # the successor was written before the kill...
    assert ticks.counts()[first] == 1  # ...and the occurrence being dispatched ran, once
    assert set(ticks.counts().values()) == {1}
