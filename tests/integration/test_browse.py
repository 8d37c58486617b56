"""Finding scheduled tasks by filter, and bulk cancel / reschedule of every match (celery_delayed.ops.browse).

Batches end in the middle of runs of tasks due at the same time, and matches and
others are interleaved, so a walk that skipped or re-read entries after removing
some would be caught.
"""
from __future__ import annotations

import time
import uuid

import pytest
from celery import states

from celery_delayed import store_of
from celery_delayed.ops import browse
from celery_delayed.ops.browse import Filter
from tasks import create_app

from .support import envelopes

pytestmark = pytest.mark.cluster_too

MINUTE = 60_000


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    """Batches of 64 entries: each partition's ~350 tasks take several, most ending inside a run of
    tasks due at the same time."""
    monkeypatch.setattr(browse, "BATCH", 64)


def _fill(store, now: int) -> dict[str, int]:
    """1,400 tasks over 20 due times (70 at each, 3 task names and 2 queues interleaved); their dues."""
    dues: dict[str, int] = {}
    for i, (task, queue) in enumerate([("app.report", "mail"), ("app.bill", "mail"), ("app.report", "web")]):
        for k in range(20):
            due = now + (k + 1) * MINUTE
            batch = list(envelopes(70 if i == 0 else 35, queue, due, prefix=f"{task}-{queue}-{k}", task=task))
            store.schedule_many(batch)
            dues.update((task_id, due) for task_id, _, _ in batch)
    return dues


def _dues(store) -> dict[str, int]:
    found, cursor = {}, None
    while True:
        page = store.upcoming(1000, cursor)
        found.update((item["task_id"], item["due_ms"]) for item in page.items)
        if (cursor := page.cursor) is None:
            return found


def test_find_pages_through_the_matches_in_due_order_without_gaps_or_repeats(overrides):
    store = store_of(create_app(**overrides))
    now = int(time.time() * 1000)
    dues = _fill(store, now)
    flt = Filter(task="app.report", queue="mail", due_after=now + 3 * MINUTE, due_before=now + 15 * MINUTE)
    expected = sorted((due, task_id) for task_id, due in dues.items()
                      if task_id.startswith("app.report-mail-") and flt.due_after <= due < flt.due_before)
    seen, cursor, pages = [], None, 0
    while True:
        page = browse.find(store, flt, limit=33, after=cursor)
        assert len(page.items) <= 33 and page.examined <= browse.FIND_BUDGET
        seen += [(item["due_ms"], item["task_id"]) for item in page.items]
        pages += 1
        if (cursor := page.cursor) is None:
            break
    assert sorted(seen) == expected and len(seen) == 12 * 70, (len(seen), pages)
    assert [due for due, _ in seen] == sorted(due for due, _ in seen)  # due order across pages
    assert seen[0][1].startswith("app.report-mail-2-") and page.items[-1]["argsrepr"]


def test_find_stops_at_its_budget_and_goes_on_from_there(overrides):
    store = store_of(create_app(**overrides))
    now = int(time.time() * 1000)
    _fill(store, now)
    page = browse.find(store, Filter(task="no.such.task"), limit=10, budget=300)
    assert page.items == [] and 300 <= page.examined < 400 and page.cursor is not None
    rest = browse.find(store, Filter(task="no.such.task"), limit=10, after=page.cursor, budget=10_000)
    assert rest.items == [] and rest.cursor is None and page.examined + rest.examined == 2800


def test_bulk_cancel_by_filter_cancels_every_match_and_leaves_the_others(overrides):
    app = create_app(**overrides)
    store = store_of(app)
    now = int(time.time() * 1000)
    dues = _fill(store, now)
    flt = Filter(task="app.report", due_before=now + 12 * MINUTE)
    matching = {t for t, due in dues.items() if t.startswith("app.report-") and due < flt.due_before}
    assert browse.count(store, flt) == len(matching) == 11 * 105

    seen = []
    totals = browse.cancel(app, flt, progress=lambda examined, matched: seen.append(matched))
    assert totals == {"cancelled": len(matching), "dispatching": 0}
    assert seen and seen[-1] == len(matching)
    assert _dues(store) == {t: due for t, due in dues.items() if t not in matching}
    some = sorted(matching)[::300]
    assert all(app.AsyncResult(t).state == states.REVOKED for t in some)
    assert browse.count(store, flt) == 0


@pytest.mark.parametrize("how", ["shift", "to"])
def test_bulk_reschedule_moves_every_match_once(overrides, how):
    store = store_of(create_app(**overrides))
    now = int(time.time() * 1000)
    dues = _fill(store, now)
    flt = Filter(queue="mail", due_after=now + 5 * MINUTE)
    matching = {t for t, due in dues.items() if "-mail-" in t and due >= flt.due_after}
    # a shift of 3 minutes lands most moved tasks further on in the walk; "to" gathers them at one time
    # that some matches already have
    move = {"shift": {"shift_ms": 3 * MINUTE}, "to": {"to_ms": now + 10 * MINUTE}}[how]
    totals = browse.reschedule(store, flt, **move)
    expected = {t: (due if t not in matching else move.get("to_ms", due + move.get("shift_ms", 0)))
                for t, due in dues.items()}
    assert _dues(store) == expected
    already_there = sum(1 for t in matching if dues[t] == move.get("to_ms"))
    assert totals == {"moved": len(matching) - already_there, "dispatching": 0}


def test_histogram_counts_tasks_per_bin_from_the_bucket_index(overrides):
    store = store_of(create_app(**overrides))
    start = (int(time.time()) // 60 + 2) * 60_000
    store.schedule_many(envelopes(7, "q", start + 5_000, prefix="a"))
    store.schedule_many(envelopes(3, "q", start + 59_999, prefix="b"))
    store.schedule_many(envelopes(4, "q", start + 2 * MINUTE + 1, prefix="c"))
    store.schedule_many(envelopes(5, "q", start + 10 * MINUTE, prefix="d"))  # past the range
    assert store.histogram(start, start + 4 * MINUTE, MINUTE) == [10, 0, 4, 0]
    with pytest.raises(ValueError, match="whole 10 s buckets"):
        store.histogram(start + 1, start + MINUTE, MINUTE)


def _same_time(store, n: int, task: str, due: int) -> list[str]:
    """``n`` tasks of ``task`` all due at ``due``, under random ids (so tasks of two names interleave)."""
    ids = []
    for _ in range(n):
        batch = list(envelopes(1, "q", due, prefix=uuid.uuid4().hex, task=task))
        store.schedule_many(batch)
        ids.append(batch[0][0])
    return ids


def test_a_bulk_cancel_misses_nothing_while_others_cancel_tasks_it_has_read(overrides):
    """Another operator's cancel of tasks the walk has already read, between two of its batches, must not
    make it skip unread ones (it once went on after "as many tasks at that due time as stayed")."""
    app = create_app(**overrides)
    store = store_of(app)
    due = int(time.time() * 1000) + 10 * MINUTE
    _same_time(store, 600, "app.A", due)
    others = _same_time(store, 600, "app.B", due)
    cancelled_by_the_other = []

    def meanwhile(examined: int, matched: int) -> None:
        if not cancelled_by_the_other:  # after the first batch: the other operator cancels every app.B
            cancelled_by_the_other.extend(others)
            store.cancel_many(others)

    totals = browse.cancel(app, Filter(task="app.A"), progress=meanwhile)
    assert totals == {"cancelled": 600, "dispatching": 0}
    assert _dues(store) == {}


def test_paging_shows_every_task_once_while_tasks_at_that_time_are_cancelled_and_added(overrides):
    store = store_of(create_app(**overrides))
    due = int(time.time() * 1000) + 10 * MINUTE
    present = set(_same_time(store, 400, "app.A", due))
    shown: list[str] = []
    cursor = None
    while True:
        page = browse.find(store, Filter(), limit=50, after=cursor)
        shown += [item["task_id"] for item in page.items]
        store.cancel_many(shown[-5:])  # an operator cancels tasks it was shown
        present -= set(shown[-5:])
        _same_time(store, 5, "app.new", due)  # others schedule more at the same time
        if (cursor := page.cursor) is None:
            break
    assert len(shown) == len(set(shown)), "a task was shown twice"
    assert present <= set(shown), f"{len(present - set(shown))} tasks scheduled throughout were never shown"
