"""``Schedules.upsert_many`` on real servers: the same definitions and pending occurrences as ``upsert``
of each item, a bad item named with nothing half-written, and a client killed halfway leaving every
schedule absent, whole, or completed by a poller's start."""
from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import uuid
from datetime import datetime, timedelta

import pytest
from celery.schedules import crontab

from celery_delayed import Schedules, store_of
from celery_delayed.client import schedules as schedules_module
from celery_delayed.client.schedules import UpsertManyError
from celery_delayed.client.template import Template
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.layout import member_of, task_id_of
from tasks import create_app

from .support import ROOT, environment, wait_for

ZONES = ("UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata")


def varied(app, count: int, version: int) -> list[tuple]:
    """``count`` upserts of every kind (``version`` 0 and 1 differ in some rules, tasks and options)."""
    items = []
    for i in range(count):
        tz = ZONES[i % len(ZONES)]
        signature = (app.signature("tasks.demo.tick", args=(f"r{i % 3 + version}",)) if i % 4 else
                     app.signature("tasks.demo.add", args=(i, version), options={"priority": i % 5}))
        rule = (crontab(minute=i % 60, hour=f"*/{1 + (i + version) % 4}") if i % 3 else
                timedelta(minutes=30 + (i % 7) * 10 + version))
        options: dict = {"tz": tz} if i % 3 else {}
        if i % 5 == 1:
            options["start"] = datetime(2031, 1 + i % 12, 1 + i % 28, 8)  # naive: in tz
        if i % 6 == 2:
            options["end"] = datetime(2040, 1, 1)
        if i % 7 == 3:
            options["jitter"] = 30 + i % 90
        if i % 5 == 4:
            options.update(misfire=("skip", "all", "once")[i % 3], catch_up=600)
        if i % 8 == 5:
            options["overlap"] = False
        items.append((f"v:{i}", signature, rule, options))
    return items


def held(store: DelayedStore, schedules: Schedules) -> tuple[dict, dict, dict]:
    """The definitions, every stored task (message, due, attempt number) and the pending-put marks."""
    definitions = {d.schedule_id: d for d in schedules.all()}
    tasks = {}
    for due_ms, member, partition in store.scan():
        task_id = task_id_of(member)
        tasks[task_id] = (due_ms, store.message(task_id),
                          store.redis.hget(store.keys.attempts(partition), member_of(task_id)))
    marks = {p: store.redis.hgetall(store.keys.recurring_putting(p)) for p in range(store.settings.partitions)}
    return definitions, tasks, {p: m for p, m in marks.items() if m}


def test_upsert_many_stores_what_upsert_of_each_stores(overrides, monkeypatch):
    """A few hundred varied schedules (crontabs in four zones, intervals, start, end, jitter, misfire
    policies, overlap=False, other tasks and options), some there already at another version, one paused,
    ids given twice in one batch (changed, and the same again), batches of 64: the definitions, the
    pending occurrences (message, due time, attempt number) and the marks are those of ``upsert`` of
    each item, on a store of its own, most templates made from their shape's.  The store's clock is
    held at one instant for both."""
    monkeypatch.setattr(schedules_module, "BATCH", 64)
    paths = []
    for _ in ("upsert", "upsert_many"):
        app = create_app(**{**overrides, "delayed_key_prefix": "t" + uuid.uuid4().hex[:10]})
        paths.append((app, Schedules(app), store_of(app)))
    now = paths[0][2].now_ms()
    monkeypatch.setattr(DelayedStore, "now_ms", lambda self: now)
    for app, schedules, _ in paths:  # there before: another version, the same, a paused one
        for schedule_id, signature, rule, options in varied(app, 40, 1)[::2] + varied(app, 300, 0)[200:240]:
            schedules.upsert(schedule_id, signature, rule, **options)
        schedules.pause("v:202")
    (app, one, one_store), (bulk_app, many, many_store) = paths
    items = varied(app, 300, 0)
    items[10:10] = [items[50], (items[50][0], *varied(app, 51, 1)[50][1:]), items[60]]  # twice in one batch
    for schedule_id, signature, rule, options in items:
        one.upsert(schedule_id, signature, rule, **options)
    bulk_items = varied(bulk_app, 300, 0)
    bulk_items[10:10] = [bulk_items[50], (bulk_items[50][0], *varied(bulk_app, 51, 1)[50][1:]), bulk_items[60]]
    made, make = [], Template.make
    monkeypatch.setattr(Template, "make", lambda self, *args: made.append(make(self, *args)) or made[-1])
    upserted = many.upsert_many(bulk_items, results=True)

    definitions, tasks, marks = held(one_store, one)
    assert len(definitions) == 300 and len(tasks) == 299 and not marks  # one paused: no occurrence
    assert {d.version for d in definitions.values()} == {1, 2, 3}
    assert held(many_store, many) == (definitions, tasks, marks)
    assert [d.schedule_id for d in upserted] == [schedule_id for schedule_id, *_ in items]
    assert upserted[-1] == definitions[items[-1][0]]
    assert sum(bool(m) for m in made) > 250  # most templates made from their shape's, not by apply_async


def test_a_bad_item_is_named_in_one_line_and_those_before_it_are_upserted_whole(overrides):
    """A bad rule in items[537] (batch 1 of 1000): one line naming it; the 537 before it upserted, whole
    (definition, occurrence, no mark); it and the others not; its ``rest`` starts at it.  A schedule that
    ends before its first time, in the same way; and an item of another shape."""
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)

    def items(bad_at: int, bad: tuple):
        for i in itertools.count():
            yield bad if i == bad_at else (f"b:{i}", app.signature("tasks.demo.add", args=(i, i)), 3600)

    with pytest.raises(UpsertManyError) as raised:
        schedules.upsert_many(items(537, ("b:537", app.signature("tasks.demo.add", args=(0, 0)), "every day")))
    error = raised.value
    assert "\n" not in str(error) and str(error).startswith("items[537] (schedule 'b:537'): ValueError: ")
    assert error.upserted == 537 and next(error.rest)[0] == "b:537" and next(error.rest)[0] == "b:538"
    definitions, tasks, marks = held(store, schedules)
    assert set(definitions) == {f"b:{i}" for i in range(537)} and not marks
    assert set(tasks) == {d.pending_id for d in definitions.values()}

    ended = ("b:1500", app.signature("tasks.demo.add", args=(0, 0)), 3600, {"end": 0})
    with pytest.raises(UpsertManyError, match=r"^items\[1500\] \(schedule 'b:1500'\): ValueError: recurring "
                                              r"schedule b:1500 ends before its first time; the 1500 before"):
        schedules.upsert_many(items(1500, ended))
    with pytest.raises(UpsertManyError, match=r"^items\[3\] \(not an item\): ValueError: an item is"):
        schedules.upsert_many(items(3, "b:3"))  # type: ignore[arg-type]
    definitions, tasks, marks = held(store, schedules)
    assert set(definitions) == {f"b:{i}" for i in range(1500)} and not marks
    assert set(tasks) == {d.pending_id for d in definitions.values()}



@pytest.mark.parametrize("bad_id", [537, None, b"b:537", "b:\ud800"], ids=["int", "None", "bytes", "surrogate"])
def test_an_item_whose_id_is_not_a_string_is_named_and_those_before_it_are_upserted(overrides, bad_id):
    """An id Redis cannot take as a schedule id (not a str, or a str with no UTF-8 form) in items[537]:
    named in one line like any bad item, the 537 before it upserted whole; it failed the whole batch
    (partitioning its id raised), named as items[0] with none of the batch upserted (review 51)."""
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    items = [(f"b:{i}", app.signature("tasks.demo.add", args=(i, i)), 3600) for i in range(600)]
    items[537] = (bad_id, *items[537][1:])
    with pytest.raises(UpsertManyError) as raised:
        schedules.upsert_many(items)
    error = raised.value
    assert str(error).startswith("items[537] (schedule ") and "ValueError: a schedule id is a string" in str(error)
    assert "\n" not in str(error) and error.upserted == 537 and next(error.rest)[0] == bad_id
    definitions, tasks, marks = held(store, schedules)
    assert set(definitions) == {f"b:{i}" for i in range(537)} and not marks
    assert set(tasks) == {d.pending_id for d in definitions.values()}
    with pytest.raises(ValueError, match=r"^a schedule id is a string"):
        schedules.upsert(bad_id, app.signature("tasks.demo.add", args=(0, 0)), 3600)

def killed_client(overrides, *args: str) -> int:
    """Run ``upsert_many_client`` with ``args`` until it is killed (by itself, or after 3 batches
    reported): how many it reported upserted."""
    client = subprocess.Popen([sys.executable, "-m", "tests.integration.upsert_many_client", *args], cwd=ROOT,
                              env=environment(overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    reported = 0
    try:
        for line in client.stdout:
            reported = int(line.split()[1]) if line.startswith("upserted ") else reported
            if reported >= 3 * schedules_module.BATCH:
                client.send_signal(signal.SIGKILL)
                break
    finally:
        client.kill()
        rest, errors = client.communicate(timeout=60)
    assert client.returncode == -signal.SIGKILL, errors
    return max([reported, *(int(line.split()[1]) for line in rest.splitlines() if line.startswith("upserted "))])


@pytest.mark.parametrize("die_at", [None, "2"], ids=["killed-from-outside", "killed-after-its-compare-and-sets"])
def test_a_client_killed_halfway_leaves_each_schedule_absent_whole_or_completed_by_a_poller(
        overrides, processes, die_at):
    """``kill -9`` of an ``upsert_many`` client of 1M schedules: from outside after 3 batches, or by
    itself between batch 2's compare-and-sets and its occurrences.  Each schedule it reported is whole;
    each other is absent, whole, or marked; and a poller's start completes the marked ones."""
    app = create_app(**overrides)
    schedules, store = Schedules(app), store_of(app)
    reported = killed_client(overrides, "1000000", *([die_at] if die_at else []))
    definitions, tasks, marks = held(store, schedules)
    marked = {schedule_id.decode() for held in marks.values() for schedule_id in held}
    whole = {schedule_id for schedule_id, d in definitions.items() if d.pending_id in tasks}
    assert {f"um:{i}" for i in range(reported)} <= whole
    assert set(definitions) == whole | marked and not whole & marked and set(tasks) <= {
        d.pending_id for d in definitions.values()}
    if die_at:
        assert reported == schedules_module.BATCH and len(marked) == schedules_module.BATCH
    print(f"reported {reported}, {len(whole)} whole, {len(marked)} marked when killed")

    processes.poller()
    wait_for(lambda: not held(store, schedules)[2], 60, "the poller's start to complete the marked puts")
    definitions, tasks, _ = held(store, schedules)
    assert set(tasks) == {d.pending_id for d in definitions.values()} and len(tasks) == len(definitions)


def test_a_generator_is_read_as_it_goes_and_memory_stays_flat(overrides, monkeypatch):
    """A generator of 12 batches: read a batch ahead of what is put at most, and what the client holds
    (traced Python allocations) after the 12th batch is what it held after the 6th: no list of results
    (one grows ~1 MB a batch).  The first batches fill caches once (a connection, kombu's), sooner or later
    by the machine's speed: in CI they still grew 0.2 MB between the 3rd batch and the 6th, then not at all.
    Traced memory is the whole process's: threads other tests left in it allocate too (over 0.2 MB once,
    three tests at a time), so the bound is 1 MB, well under the 7.9 MB a list of results grows by."""
    import tracemalloc

    monkeypatch.setattr(schedules_module, "BATCH", 500)
    app = create_app(**overrides)
    schedules, read, held_at = Schedules(app), [0], {}

    def items():
        for i in range(12 * 500):
            read[0] += 1
            yield f"m:{i}", app.signature("tasks.demo.add", args=(i, i)), 3600

    def progress(count: int) -> None:
        assert read[0] <= count + 500
        held_at[count] = tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        assert schedules.upsert_many(items(), progress=progress) == 6000
    finally:
        tracemalloc.stop()
    grown = held_at[6000] - held_at[3000]
    assert grown < 1_000_000, f"{grown} bytes more held after 12 batches than after 6: {held_at}"
