"""Recurring schedules at run time, on real servers: the misfire policies after an outage of every poller
(and through a kill -9 while catching up), pause and resume, run-now, overlap, start and end, the paged
list, and ``beat_schedule`` entries' options.

Every schedule here runs every second; the tests' pollers have a grace (:func:`.grace_ms`) of 8 s
(visibility timeout 3 s, lease 2 s, sweep 1 s), so an outage of :data:`OUTAGE` misses several times
beyond it.  Each run is checked by its derived task id (:func:`.occurrence_id`).
"""
from __future__ import annotations

import ast
import itertools
import json
import re
import signal
import subprocess
import sys
import time

from celery_delayed import Schedules, store_of
from celery_delayed.client.schedules import beat_entries
from celery_delayed.recurring.occurrences import occurrence_id
from celery_delayed.recurring.policy import Options, grace_ms
from celery_delayed.settings import Settings
from tasks import create_app

from .support import ROOT, environment, leaders, wait_for
from .test_cli import celery
from .test_recurring import Ticks, now_ms

PERIOD_MS = 1000
#: Seconds every poller is down: longer than the grace and a catch-up window of CATCH_UP seconds.
OUTAGE = 14.0
CATCH_UP = 5


def runtime(overrides: dict) -> dict:
    overrides.update(delayed_visibility_timeout=3)
    assert grace_ms(Settings.from_conf(overrides)) == 8000
    return overrides


def ran(ticks: Ticks, schedule_id: str, after_ms: int = 0) -> list[int]:
    """The nominal times of ``schedule_id`` that ran after ``after_ms``: each once, by its derived id."""
    counts, runs = ticks.counts(), ticks.runs()
    assert {n: c for n, c in counts.items() if c != 1} == {}, "a nominal time ran more than once"
    assert all(runs[n]["id"] == occurrence_id(schedule_id, n) for n in runs), "a run not of a derived id"
    return sorted(n for n in counts if n > after_ms)


def contiguous(times: list[int]) -> bool:
    return all(b - a == PERIOD_MS for a, b in itertools.pairwise(times))


def stats(log: str) -> dict[str, int]:
    """The counts a warm-stopped poller logged (``poller ... stopped: {...}``)."""
    return ast.literal_eval(re.findall(r"stopped: (\{.*\})", log)[-1])


def test_after_an_outage_of_every_poller_each_misfire_policy_runs_what_it_promises(overrides, processes):
    """skip: none of the missed times runs; once: the first missed one runs, for all; all: each time
    of the catch-up window runs, late, and none before it."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules = Schedules(app)
    policies = {"skip": {"misfire": "skip"}, "once": {}, "all": {"misfire": "all", "catch_up": CATCH_UP}}
    ticks = {policy: Ticks(store_of(app).settings, f"{run}-{policy}") for policy in policies}
    for policy, options in policies.items():
        schedules.upsert(policy, app.signature("tasks.demo.tick", args=(f"{run}-{policy}",)), PERIOD_MS / 1000,
                         **options)
    processes.worker()
    pollers = [processes.poller(), processes.poller()]
    wait_for(lambda: all(len(t.counts()) >= 2 for t in ticks.values()), 60, "two runs of each schedule")

    for poller in pollers:
        processes.warm_stop(poller)
    pending = {policy: schedules.get(policy).pending_ms for policy in policies}  # the first missed time
    time.sleep(OUTAGE)
    restarted_ms = now_ms()
    poller = processes.poller()

    def outcomes() -> dict[str, list[int]]:
        return {policy: ran(t, policy, pending[policy] - 1) for policy, t in ticks.items()}

    def promised(got: dict[str, list[int]]) -> bool:
        """Each policy's runs since the outage began, once the late ones are in (a busy Kafka delays some)."""
        skip, once, every = got["skip"], got["once"], got["all"]
        return (len(skip) >= 3 and skip[0] > restarted_ms and contiguous(skip)  # none of the missed
                and len(once) >= 3 and [n for n in once if n <= restarted_ms] == [pending["once"]]
                and contiguous(once[1:]) and once[1] > restarted_ms  # the first missed, once, for all
                and len(every) >= 3 and every[-1] > restarted_ms + 1000 and contiguous(every))  # the window's

    wait_for(lambda: promised(outcomes()), 120, lambda: f"each policy's runs; pending {pending}, restart "
             f"{restarted_ms}, ran {outcomes()}")
    every = outcomes()["all"]
    first = every[0]
    assert restarted_ms - CATCH_UP * 1000 - PERIOD_MS <= first and first > pending["all"]  # older ones missed
    runs = ticks["all"].runs()
    assert runs[first]["started"] - first >= 3000, "all: the window's first time did not run late (caught up)"

    processes.warm_stop(poller)
    counted = stats(processes.log(poller))
    assert counted["occurrences_missed"] >= 3 * (OUTAGE - CATCH_UP) - 3, counted
    assert counted["occurrences_fired"] >= sum(map(len, outcomes().values())), counted


def test_kill_9_of_the_poller_dispatching_a_misfire_catch_up_loses_none_and_runs_none_twice(overrides, processes):
    """Every poller down for a while, then a poller catching up (misfire ``all``) is killed as it hands
    its fourth late occurrence to Kafka; another poller catches up the rest: every time since the
    outage began runs once (the killed one after the visibility timeout, within the window)."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules = Schedules(app)
    ticks = Ticks(store_of(app).settings, run)
    first = schedules.upsert("catch", app.signature("tasks.demo.tick", args=(run,)), PERIOD_MS / 1000,
                             misfire="all", catch_up=600).pending_ms
    processes.worker()
    time.sleep(10)  # no poller yet: an outage from the first time on
    log = processes.logdir / "killer-catch-up.log"
    killer = subprocess.Popen([sys.executable, "-m", "tests.integration.killer_poller", "before_produce", "3"],
                              cwd=ROOT, env=environment(overrides), stdout=log.open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    processes.procs.append((killer, log))
    assert killer.wait(timeout=60) == -signal.SIGKILL, log.read_text()
    killed_ms = now_ms()
    assert "killing myself" in log.read_text()

    processes.poller()

    def caught_up() -> bool:
        times = ran(ticks, "catch")
        return bool(times) and times[0] == first and contiguous(times) and times[-1] > killed_ms + 3000

    wait_for(caught_up, 120, lambda: f"every time since {first} to run once; ran {ran(ticks, 'catch')}")


def test_a_paused_schedule_does_not_run_and_resumes_by_its_misfire_policy(overrides, processes):
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules = Schedules(app)
    ticks = {p: Ticks(store_of(app).settings, f"{run}-{p}") for p in ("skip", "once")}
    for policy in ticks:
        schedules.upsert(policy, app.signature("tasks.demo.tick", args=(f"{run}-{policy}",)), PERIOD_MS / 1000,
                         misfire=policy)
    processes.worker()
    processes.poller()
    wait_for(lambda: all(len(t.counts()) >= 2 for t in ticks.values()), 60, "two runs of each schedule")

    paused = {policy: schedules.pause(policy) for policy in ticks}
    assert all(d.paused for d in paused.values()) and schedules.pause("skip") == paused["skip"]
    assert schedules.pause("unknown") is None and schedules.resume("unknown") is None
    # the first time each missed: the pause cancelled it (one in flight then runs, and this is the next)
    missed = {policy: d.pending_ms for policy, d in paused.items()}
    time.sleep(OUTAGE - 4)
    assert all(ran(t, p, missed[p] - 1) == [] for p, t in ticks.items()), "a paused schedule ran"
    resumed_ms = now_ms()
    assert not any(schedules.resume(policy).paused for policy in ticks)

    def outcomes() -> dict[str, list[int]]:
        return {policy: ran(t, policy, missed[policy] - 1) for policy, t in ticks.items()}

    def promised(got: dict[str, list[int]]) -> bool:
        """skip: nothing of the pause; once: its first missed time, then on; once the late ones are in."""
        skip, once = got["skip"], got["once"]
        return (len(skip) >= 2 and skip[0] > resumed_ms and contiguous(skip)
                and len(once) >= 3 and [n for n in once if n <= resumed_ms] == [missed["once"]]
                and contiguous(once[1:]) and once[1] > resumed_ms)

    wait_for(lambda: promised(outcomes()), 120, lambda: f"each policy's runs after the resume at {resumed_ms} "
             f"(first missed {missed}): {outcomes()}")


def test_run_now_runs_once_more_with_its_own_id_and_leaves_the_chain_alone(overrides, processes):
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules = Schedules(app)
    held = schedules.upsert("hourly", app.signature("tasks.demo.tick", args=(run, "now")), 3600)
    processes.worker()
    processes.poller()
    task_id = schedules.run_now("hourly")
    assert schedules.run_now("unknown") is None
    ticks = Ticks(store_of(app).settings, run)
    wait_for(lambda: ticks.counts(), 90, "the run-now run")
    ((nominal, count),) = ticks.counts().items()
    assert count == 1 and ticks.runs()[nominal]["id"] == task_id == occurrence_id("hourly", nominal, run_now=True)
    assert task_id != occurrence_id("hourly", nominal)
    assert schedules.get("hourly") == held  # the chain's pending occurrence, untouched
    assert store_of(app).get(held.pending_id)["state"] == "scheduled"


def test_overlap_false_skips_an_occurrence_while_the_previous_one_runs(overrides, processes):
    """Every second, a task of 2.5 s: with ``overlap=False`` one runs at a time, the others are skipped
    (counted); by default they overlap."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules = Schedules(app)
    for name, overlap in (("alone", False), ("together", True)):
        schedules.upsert(name, app.signature("tasks.demo.overlap", args=(f"{run}-{name}", 2.5)), PERIOD_MS / 1000,
                         overlap=overlap)
    processes.worker("w1", "-c", "6")
    poller = processes.poller()
    r = Ticks(store_of(app).settings, run).redis
    wait_for(lambda: r.hlen(f"demo:{run}-alone:runs") >= 3, 60, "three runs of the schedule that does not overlap")
    assert r.zscore(f"demo:{run}-alone:overlap", "most") == 1
    assert r.zscore(f"demo:{run}-together:overlap", "most") >= 2
    processes.warm_stop(poller)
    assert stats(processes.log(poller))["occurrences_overlapped"] >= 2


def test_start_and_end_bound_a_schedule_and_jitter_delays_each_occurrence_by_its_derived_time(overrides, processes):
    run = overrides["delayed_key_prefix"]
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    processes.worker()
    processes.poller()
    wait_for(lambda: len(leaders(store.settings)) == store.settings.partitions, 60, "the poller to lead")
    start = (now_ms() // 1000 + 4) * 1000
    held = schedules.upsert("bounded", app.signature("tasks.demo.tick", args=(run,)), PERIOD_MS / 1000,
                            start=start / 1000, end=start / 1000 + 3, jitter=0.5)
    assert held.pending_ms == start
    assert store.get(held.pending_id)["due_ms"] == Options(jitter_ms=500).due_ms("bounded", start)
    ticks = Ticks(store.settings, run)
    wait_for(lambda: schedules.get("bounded").pending_ms is None, 30, "the chain to end")
    wait_for(lambda: len(ticks.counts()) == 4, 60, "the four runs")
    assert ran(ticks, "bounded") == [start, start + 1000, start + 2000, start + 3000]


def test_list_pages_through_the_schedules_of_a_prefix(overrides):
    app = create_app(**overrides)
    schedules = Schedules(app)
    for i in range(7):
        schedules.upsert(f"page:{i}", app.signature("tasks.demo.add", args=(1, 2)), 3600)
    schedules.upsert("other[*]", app.signature("tasks.demo.add", args=(1, 2)), 3600)
    found, cursor, pages = [], "", 0
    while True:
        page, cursor = schedules.list("page:", cursor, count=2)
        found += [d.schedule_id for d in page]
        pages += 1
        if not cursor:
            break
    assert sorted(found) == [f"page:{i}" for i in range(7)] and pages > 1
    assert [d.schedule_id for d in schedules.list("other[*")[0]] == ["other[*]"]  # a glob character is literal


def test_beat_schedule_entries_take_options_as_keys_or_in_options(overrides):
    app = create_app(**overrides, beat_schedule={
        "keys": {"task": "tasks.demo.add", "schedule": 60, "args": (1, 2), "misfire": "skip", "jitter": 2},
        "in_options": {"task": "tasks.demo.add", "schedule": 60, "args": (1, 2),
                       "options": {"misfire": "all", "catch_up": 600, "queue": "q"}},
        "bad": {"task": "tasks.demo.add", "schedule": 60, "args": (1, 2), "misfire": "sometimes"},
        "bad_overlap": {"task": "tasks.demo.add", "schedule": 60, "args": (1, 2), "overlap": "no"},
    })
    entries = beat_entries(app)
    assert entries["beat:keys"][2] == Options(misfire="skip", jitter_ms=2000)
    assert entries["beat:in_options"][2] == Options(misfire="all", catch_up_ms=600_000)
    assert "beat:bad" not in entries and "beat:bad_overlap" not in entries


def test_the_schedules_commands_list_show_pause_resume_run_now_and_remove(overrides):
    """``celery -A tasks delayed schedules ...`` as a user runs them; an unknown id or a bad cursor is one
    line; a schedule id's control characters reach the terminal inert."""
    app = create_app(**overrides)
    schedules = Schedules(app)
    for i in range(3):
        schedules.upsert(f"cli:{i}", app.signature("tasks.demo.add", args=(1, 2)), 3600, misfire="skip")
    schedules.upsert("odd\x1b[31m", app.signature("tasks.demo.add", args=(1, 2)), 60)

    page = json.loads(celery(overrides, "delayed", "schedules", "list", "--prefix", "cli:", "--json").stdout)
    assert sorted(i["schedule_id"] for i in page["items"]) == ["cli:0", "cli:1", "cli:2"] and page["cursor"] == ""
    listed = celery(overrides, "delayed", "schedules", "list").stdout
    assert "cli:1  tasks.demo.add  every 3600 s  next " in listed and "misfire=skip" in listed
    assert "\x1b" not in listed and "odd" in listed
    assert "paused: False" in celery(overrides, "delayed", "schedules", "show", "cli:1").stdout

    for command, said in (("pause", "paused"), ("resume", "resumed"), ("run-now", "runs now as task"),
                          ("remove", "removed")):
        done = celery(overrides, "delayed", "schedules", command, "cli:1")
        assert done.returncode == 0 and f"cli:1: {said}" in done.stdout, done.stderr
    assert schedules.get("cli:1") is None

    for command in ("show", "pause", "resume", "run-now", "remove"):
        failed = celery(overrides, "delayed", "schedules", command, "cli:1")
        assert failed.returncode == 1 and failed.stderr.strip() == "Error: no recurring schedule 'cli:1'", failed
    bad = celery(overrides, "delayed", "schedules", "list", "--after", "x")
    assert bad.returncode == 1 and bad.stderr.strip() == "Error: not a cursor of a list of recurring schedules: 'x'"
