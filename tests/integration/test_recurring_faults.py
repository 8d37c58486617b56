"""Recurring schedules against what an operator or a fault may leave, on real servers: a definition
corrupted in Redis, ``beat_schedule`` entries that cannot run, a resume killed half-way, a bad cursor.
Each stops only what it concerns, in one line: never a poller."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from celery_delayed import Schedules, store_of
from celery_delayed.client.schedules import beat_entries
from celery_delayed.envelope import Envelope
from celery_delayed.recurring.occurrences import NOMINAL_HEADER, occurrence
from celery_delayed.recurring.definitions import Definitions
from celery_delayed.store.dlq import DeadLetters
from tasks import create_app

from .support import ROOT, environment, wait_for
from .test_cli import celery
from .test_recurring import Ticks
from .test_recurring_runtime import PERIOD_MS, runtime


def test_a_corrupt_definition_parks_its_occurrence_and_no_poller_stops(overrides, processes):
    """Definitions corrupted before the poller starts (truncated JSON; a due time that is no number),
    one while it runs (a JSON list): the poller starts and lives on, each one's occurrence is
    dead-lettered naming it, the other schedule runs on, the list leaves them out, and remove deletes
    them."""
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules, store = Schedules(app), store_of(app)
    for name in ("early", "typed", "late", "fine"):
        schedules.upsert(name, app.signature("tasks.demo.tick", args=(f"{run}-{name}",)), PERIOD_MS / 1000)

    def corrupt(name: str, value: str | bytes) -> None:
        store.redis.hset(store.keys.recurring(store.partition(name)), name, value)

    def parked(name: str) -> list[str]:
        return [letter.task_id for letter in DeadLetters(store).list()
                if f"recurring schedule '{name}' is unreadable" in letter.reason]

    corrupt("early", '{"rule":{"every_ms":1000')
    head, _, template = store.redis.hget(store.keys.recurring(store.partition("typed")), "typed").partition(b"\n")
    version, _, *rest = json.loads(head)  # the stored definition's first line: [version, pending_ms, ...]
    corrupt("typed", json.dumps([version, "soon", *rest]).encode() + b"\n" + template)
    ticks = Ticks(store.settings, f"{run}-fine")
    processes.worker()
    poller = processes.poller()
    wait_for(lambda: parked("early") and parked("typed") and len(ticks.counts()) >= 2, 60,
             lambda: f"early and typed parked, two runs of fine; poller log:\n{processes.log(poller)[-3000:]}")
    corrupt("late", "[1, 2]")
    wait_for(lambda: parked("late"), 30, lambda: f"late parked; poller log:\n{processes.log(poller)[-3000:]}")
    runs = len(ticks.counts())
    wait_for(lambda: len(ticks.counts()) >= runs + 2, 30, "fine to run on")
    processes.check_alive()
    assert len(parked("early")) == 1 and len(parked("late")) == 1  # the chain stopped at its occurrence

    listed = celery(overrides, "delayed", "schedules", "list")
    assert listed.returncode == 0 and listed.stdout.startswith("fine  tasks.demo.tick"), listed
    assert "recurring schedule 'early' is unreadable in the store (JSONDecodeError" in listed.stderr
    shown = celery(overrides, "delayed", "schedules", "show", "late")
    assert shown.returncode == 1 and shown.stderr.startswith("Error: recurring schedule 'late' is unreadable"), shown
    for name in ("early", "typed", "late"):
        assert celery(overrides, "delayed", "schedules", "remove", name).returncode == 0
    assert [d.schedule_id for d in schedules.all()] == ["fine"]


def test_a_corrupt_occurrence_is_dead_lettered_and_no_poller_stops(overrides, processes):
    """An occurrence whose stored message names its schedule and version but holds a nominal time that is
    no number (written over the one the schedule wrote): parked, not a poller's crash (a TypeError)."""
    app = create_app(**runtime(overrides))
    schedules, store = Schedules(app), store_of(app)
    held = schedules.upsert("hourly", app.signature("tasks.demo.add", args=(1, 2)), 3600)
    task_id, message = occurrence(Envelope.decode(held.template), "hourly", held.version, held.pending_ms, 10**9)
    forged = Envelope.decode(message)
    forged.headers[NOMINAL_HEADER] = "soon"
    store.schedule(task_id, store.now_ms(), forged.encode(), attempt=held.version + 1)
    poller = processes.poller()
    letter = wait_for(lambda: DeadLetters(store).get(task_id), 30,
                      lambda: f"the occurrence parked; poller log:\n{processes.log(poller)[-3000:]}")
    assert letter.reason.startswith("its recurring schedule cannot advance: TypeError"), letter.reason
    processes.check_alive()


def test_a_definitions_key_of_another_type_does_not_keep_the_poller_from_dispatching(overrides, processes):
    """A partition's definitions key written over by a string (WRONGTYPE): the poller's start tried
    the beat_schedule sync again every second, for ever, and dispatched nothing at all."""
    app = create_app(**runtime(overrides))
    store = store_of(app)
    store.redis.set(store.keys.recurring(1), "not a hash")
    result = app.tasks["tasks.demo.add"].apply_async((1, 2), countdown=3)
    assert store.get(result.id) is not None  # in the store: a poller must dispatch it
    processes.worker()
    poller = processes.poller()
    assert result.get(timeout=60) == 3, processes.log(poller)[-3000:]
    assert "WRONGTYPE" in processes.log(poller) and "dispatching without it" in processes.log(poller)


def test_beat_schedule_entries_that_cannot_run_are_left_out_and_the_poller_starts(overrides, processes):
    """An entry whose end has passed (a poller restarted after it), one starting after 2106, one of a
    jitter beyond it, one whose args are no list: each logged in one line; the poller starts and runs
    the good entry, and the ended one's stored chain is removed."""
    run = overrides["delayed_key_prefix"]
    entry = {"task": "tasks.demo.tick", "schedule": PERIOD_MS / 1000, "args": (run,)}
    app = create_app(**runtime(overrides), beat_schedule={"ended": entry})
    schedules = Schedules(app)
    schedules.definitions.sync(beat_entries(app))  # as a poller started while it ran did
    assert schedules.get("beat:ended") is not None
    beat = {"ended": {**entry, "end": 1.0}, "far": {**entry, "start": 7.3e9}, "jitter": {**entry, "jitter": 1e300},
            "args": {**entry, "args": 5}, "good": entry}
    ticks = Ticks(store_of(app).settings, run)
    processes.worker()
    poller = processes.poller(overrides={**overrides, "beat_schedule": beat})
    wait_for(lambda: ticks.counts(), 60, lambda: f"a run of good; poller log:\n{processes.log(poller)[-3000:]}")
    processes.check_alive()
    log = processes.log(poller)
    assert "recurring schedule beat:ended ends before its first time: not run" in log
    assert "beat_schedule entry 'far' is not run: ValueError: a schedule's start and end must be between" in log
    assert "beat_schedule entry 'jitter' is not run: ValueError: jitter and catch_up must be" in log
    assert "beat_schedule entry 'args' is not run: TypeError" in log
    assert sorted(d.schedule_id for d in schedules.all()) == ["beat:good"]


def test_a_put_beyond_the_store_s_range_writes_nothing(overrides):
    """A start within the store's range whose first occurrence's jitter takes it past 2106: refused
    before anything is written, not a definition without its occurrence."""
    app = create_app(**overrides)
    schedules = Schedules(app)
    with pytest.raises(ValueError, match="2106") as refused:
        schedules.upsert("edge", app.signature("tasks.demo.add", args=(1, 2)), 60, start=2**32 - 61,
                         jitter=3600)
    assert schedules.get("edge") is None, f"written, then refused: {refused.value}"
    assert str(refused.value) == "recurring schedule edge starts after 2106, beyond what the store holds"


#: Resumes schedule ``r`` of the app its environment configures, killed (-9) before it writes the
#: pending occurrence: after its compare-and-set.
KILLED_RESUME = textwrap.dedent("""
    import os, signal
    from celery_delayed import Schedules
    from celery_delayed.recurring.definitions import Definitions
    from tasks import create_app
    Definitions._write_pending = lambda self, definition: os.kill(os.getpid(), signal.SIGKILL)
    Schedules(create_app()).resume("r")
""")


def test_resume_again_completes_a_resume_killed_after_its_compare_and_set(overrides):
    """A ``delayed schedules resume`` killed between writing the definition and its pending occurrence
    left a schedule neither paused nor running; running it again writes the occurrence."""
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    schedules.upsert("r", app.signature("tasks.demo.add", args=(1, 2)), 60)
    schedules.pause("r")
    killed = subprocess.run([sys.executable, "-c", KILLED_RESUME], cwd=ROOT, env=environment(overrides), timeout=60)
    assert killed.returncode == -9
    held = schedules.get("r")
    assert not held.paused and store.message(held.pending_id) is None
    done = celery(overrides, "delayed", "schedules", "resume", "r")
    assert done.returncode == 0 and "r: resumed" in done.stdout, done
    assert store.message(held.pending_id) is not None


def test_a_cursor_beyond_hscan_s_range_is_one_line(overrides):
    for cursor in ("0:99999999999999999999999", "\u00b2:0"):
        bad = celery(overrides, "delayed", "schedules", "list", "--after", cursor)
        assert bad.returncode == 1 and bad.stderr.strip() == f"Error: not a cursor of a list of recurring schedules: " \
            f"{cursor!r}", bad


def test_a_page_of_no_schedules_is_refused_not_a_cursor_that_never_moves(overrides):
    """``Schedules.list(count=0)`` returned no schedule and the first page's cursor again: a client
    paging until the cursor is '' looped for ever."""
    app = create_app(**overrides)
    schedules = Schedules(app)
    schedules.upsert("one", app.signature("tasks.demo.add", args=(1, 2)), 3600)
    with pytest.raises(ValueError, match="a page of recurring schedules holds 1 or more, got 0"):
        schedules.list(count=0)


def test_a_definitions_key_of_another_type_holds_back_only_the_occurrences_of_its_own_schedules(overrides, processes):
    """Occurrences are advanced a claim at a time: one whose definitions key is written over (WRONGTYPE)
    failed the advance of every occurrence claimed with it, which stayed in flight with it, were claimed
    again with it each visibility timeout, and never ran again.  Only its own stay in flight now."""
    overrides.update(delayed_partitions=2)
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules, store = Schedules(app), store_of(app)
    names = [f"s{i}" for i in range(60)]
    broken = next(name for name in names if store.partition(name) == 1)
    fine = [name for name in names if store.partition(name) == 0][:8]  # each claimed with broken's half the time
    for name in [broken, *fine]:
        schedules.upsert(name, app.signature("tasks.demo.tick", args=(f"{run}-{name}",)), PERIOD_MS / 1000)
    store.redis.set(store.keys.recurring(1), "not a hash")
    processes.worker()
    poller = processes.poller()
    ticks = {name: Ticks(store.settings, f"{run}-{name}") for name in fine}
    wait_for(lambda: all(len(t.counts()) >= 5 for t in ticks.values()), 40,
             lambda: f"5 runs of each fine schedule: {[len(t.counts()) for t in ticks.values()]}; poller log:\n"
                     f"{processes.log(poller)[-3000:]}")
    processes.check_alive()


def test_a_chain_whose_next_time_is_beyond_the_store_s_range_ends_and_no_poller_stops(overrides, processes):
    """Every 100 years: the first time (2070, moved to now here) fits the store, the next (2170) does not.
    Its successor's write raised ValueError out of the claim's advance, which stopped the poller (exit
    1), and each next leader too (it takes the copy back with its first claim): the chain ends there now."""
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    held = schedules.upsert("century", app.signature("tasks.demo.add", args=(1, 2)), 100 * 365 * 86400)
    store.reschedule(held.pending_id, store.now_ms())
    poller = processes.poller()
    wait_for(lambda: schedules.get("century").pending_ms is None, 30,
             lambda: f"the chain to end; poller log:\n{processes.log(poller)[-3000:]}")
    assert "recurring schedule century ends: its next time" in processes.log(poller)
    processes.check_alive()


def test_an_advance_failing_by_a_fault_of_no_known_kind_parks_its_copy_and_no_poller_stops(overrides, processes):
    """An unexpected error while advancing one occurrence (here injected: ``faulty_poller``) went out of
    the poller's round and stopped it; every next leader takes the copy back with its first claim, and
    stopped in turn.  Now only that copy is dead-lettered, naming the error, and the other schedules
    claimed with it go on."""
    overrides.update(delayed_partitions=1)
    run = overrides["delayed_key_prefix"]
    app = create_app(**runtime(overrides))
    schedules, store = Schedules(app), store_of(app)
    for name in ("poison", "fine"):
        schedules.upsert(name, app.signature("tasks.demo.tick", args=(f"{run}-{name}",)), PERIOD_MS / 1000)
    processes.worker()
    log = processes.logdir / "faulty-poller.log"
    poller = subprocess.Popen([sys.executable, "-m", "tests.integration.faulty_poller", "poison"], cwd=ROOT,
                              env=environment(overrides), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    processes.procs.append((poller, log))
    fine = Ticks(store.settings, f"{run}-fine")
    wait_for(lambda: len(fine.counts()) >= 4 or poller.poll() is not None, 40, "four runs of the fine schedule")
    assert poller.poll() is None, f"the poller stopped:\n{log.read_text()[-3000:]}"
    parked = DeadLetters(store).list()
    assert [(d.reason, Envelope.decode(d.message).headers["delayed_schedule"]) for d in parked][:1] == [
        ("its recurring schedule cannot advance: RuntimeError: a fault in the advance of poison", "poison")]
    assert Ticks(store.settings, f"{run}-poison").counts() == {}


#: Upserts schedule ``Job.nightly`` (a ``str`` enum: its value "nightly" is what the store holds) of the
#: app its environment configures, killed (-9) after it writes the pending occurrence, before it
#: clears its put's mark.
KILLED_ENUM_UPSERT = textwrap.dedent("""
    import enum, os, signal
    from celery_delayed import Schedules
    from celery_delayed.recurring.definitions import Definitions
    from tasks import create_app
    class Job(str, enum.Enum):
        nightly = "nightly"
    Definitions._clear_marks = lambda self, marks: os.kill(os.getpid(), signal.SIGKILL)
    app = create_app()
    Schedules(app).upsert(Job.nightly, app.signature("tasks.demo.add", args=(1, 2)), 1)
""")


def test_a_schedule_id_of_a_str_enum_has_one_chain_after_its_upsert_was_killed(overrides):
    """An id that is a ``str`` enum member formats as ``Job.nightly`` on Python 3.11 while the store and
    the occurrence's header hold ``nightly``: the upsert's occurrence id was derived from the one,
    the put's completion (a poller's start, ``complete_puts``) derived another from the other, at the
    same time and version, and both went to run: the occurrence fired twice.  The id is the string
    the store holds, wherever it is derived."""
    app = create_app(**overrides)
    store = store_of(app)
    killed = subprocess.run([sys.executable, "-c", KILLED_ENUM_UPSERT], cwd=ROOT, env=environment(overrides),
                            timeout=60)
    assert killed.returncode == -9
    Definitions(store).complete_puts()
    pending = Schedules(app).get("nightly").pending_id
    assert store.message(pending) is not None
    wait_for(lambda: store.now_ms() > store.get(pending)["due_ms"], 10, "the occurrence to be due")
    due = [data for p in range(store.settings.partitions) for _, _, data in store.claim(p, 1, 10).items]
    runs = [advance for advance in Definitions(store).advance_many(due, store.now_ms()) if advance.goes]
    assert len(runs) == 1, f"{len(due)} occurrences of one time, {len(runs)} sent to run"
