"""Finding scheduled tasks by what they are, and acting on all that match: the operators' search.

A :class:`Filter` (task name, queue, due window, task id prefix) selects tasks.
:func:`find` pages through them in due order for a view, reading at most a
budget of entries per call, so a rare match never turns a page into a scan of
millions.  :func:`count`, :func:`cancel` and :func:`reschedule` walk every match
partition by partition in bounded batches, reporting progress, for the CLI's and
the web view's bulk actions.  Reads and writes go through :class:`.DelayedStore`.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable, Iterator

from celery_delayed.store.inspection import Page, cursor_after, parse_cursor
from celery_delayed.store.layout import due_ms_of, member_of
from celery_delayed.store.outcomes import Change
from celery_delayed.store.revoke import cancel_or_revoke

if TYPE_CHECKING:
    from celery import Celery

    from celery_delayed.store.delayed import DelayedStore

#: Entries one bulk batch reads from a partition.
BATCH = 500
#: Most entries :func:`find` examines for one page.
FIND_BUDGET = 3_000
#: Entries :func:`find` describes (reads the messages of) at a time.
SCAN_CHUNK = 250

Progress = Callable[[int, int], None]  # (entries examined so far, matches so far)


@dataclass(frozen=True)
class Filter:
    """Which scheduled tasks an operator means: every field given must match (None: any)."""

    task: str | None = None  # task name, exact
    queue: str | None = None
    due_after: int | None = None  # ms since the epoch, included
    due_before: int | None = None  # ms since the epoch, excluded
    id_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.due_after is not None and self.due_before is not None and self.due_before <= self.due_after:
            raise ValueError(f"an empty due window: due_before ({self.due_before}) is not after due_after "
                             f"({self.due_after})")

    def matches(self, item: dict) -> bool:
        """Whether a described entry (:meth:`.Inspection.describe`) is selected by the fields that need
        its message; the due window is applied by the walk itself."""
        return ((self.task is None or item["task"] == self.task)
                and (self.queue is None or item["queue"] == self.queue)
                and (self.id_prefix is None or item["task_id"].startswith(self.id_prefix)))

    def is_empty(self) -> bool:
        return not any(v not in (None, "") for v in asdict(self).values())

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, "")}


@dataclass(frozen=True)
class Found(Page):
    """A page of :func:`find`: matches in due order, the cursor after the last entry examined, and
    how many were examined (a page may hold fewer than asked when the budget ran out)."""

    examined: int = 0


def find(store: DelayedStore, flt: Filter, limit: int = 50, after: str | None = None,
         budget: int = FIND_BUDGET) -> Found:
    """The next ``limit`` tasks matching ``flt`` in due order, examining at most ``budget`` entries.

    ``after``: the cursor of the previous page (the window's start bounds it).  The
    cursor returned continues the walk where it stopped (None: nothing is left in
    the due window).
    """
    position = parse_cursor(after)
    if flt.due_after is not None and (position[0] is None or position[0] < flt.due_after):
        position = (flt.due_after, b"")
    # a partition's first read is about a page (the common case: most entries match), later ones as needed
    entries = itertools.islice(store.scan(position, chunk=min(budget, max(limit + 1, 64))), budget)
    items: list[dict] = []
    examined = 0
    for batch in _batches(entries, SCAN_CHUNK):
        inside = [e for e in batch if flt.due_before is None or e[0] < flt.due_before]
        examined += len(inside)
        for item in store.describe(inside):
            if flt.matches(item):
                items.append(item)
                if len(items) == limit:
                    return Found(items, cursor_after((item["due_ms"], member_of(item["task_id"]), 0)), examined)
        if len(inside) < len(batch):  # the window ends here
            return Found(items, None, examined)
        last = batch[-1]
    more = examined == budget  # stopped by the budget, not by the end of the schedule
    return Found(items, cursor_after(last) if more else None, examined)


def _batches(entries: Iterator, size: int) -> Iterator[list]:
    while batch := list(itertools.islice(entries, size)):
        yield batch


def walk(store: DelayedStore, flt: Filter, progress: Progress | None = None,
         act: Callable[[list[dict]], None] | None = None) -> Iterator[list[dict]]:
    """Every task matching ``flt``, partition by partition, in batches of up to :data:`BATCH` entries.

    ``act`` (bulk actions) is given each batch's matches before the next batch is
    read, which starts after the last entry read (its due time and id): entries
    removed or added before it meanwhile, by ``act`` or by anyone, shift nothing.
    """
    examined = matched = 0
    for p in range(store.settings.partitions):
        for batch in _batches(store.partition_scan(p, (flt.due_after, b""), BATCH), BATCH):
            entries = [e for e in batch if flt.due_before is None or e[0] < flt.due_before]
            if not entries:
                break
            examined += len(entries)
            matches = [item for item in store.describe(entries) if flt.matches(item)]
            matched += len(matches)
            yield matches
            if act:  # before the next batch is read
                act(matches)
            if progress:
                progress(examined, matched)
            if len(entries) < len(batch):  # the window ends here
                break


def count(store: DelayedStore, flt: Filter, progress: Progress | None = None) -> int:
    """How many scheduled tasks match ``flt`` (a walk of the due window given: bounded batches)."""
    return sum(len(batch) for batch in walk(store, flt, progress))


def by_task(app: Celery, elsewhere: Iterable[str] = (), progress: Progress | None = None) -> list[dict]:
    """Per task name scheduled in ``app``'s store: how many (``count``), the earliest one's due time
    (``next_due_ms``) and whether it is ``registered``: by the app once its modules are imported (as a
    worker's are at start), or named in ``elsewhere`` (tasks other services' workers run).  A task the
    workers do not know would be dead-lettered when due; those names come first.  A walk of the whole
    schedule (bounded batches)."""
    app.loader.import_default_modules()
    registered = set(app.tasks) | set(elsewhere)
    names: dict[str, dict] = {}
    for batch in walk(app.amqp.delayed_store, Filter(), progress):
        for item in batch:
            seen = names.setdefault(item["task"], {"task": item["task"], "count": 0, "next_due_ms": item["due_ms"],
                                                   "registered": item["task"] in registered})
            seen["count"] += 1
            seen["next_due_ms"] = min(seen["next_due_ms"], item["due_ms"])
    return sorted(names.values(), key=lambda row: (row["registered"], row["task"]))


def cancel(app: Celery, flt: Filter, progress: Progress | None = None) -> dict[str, int]:
    """Cancel every scheduled task matching ``flt`` as a revoke does (out of the store, recorded
    REVOKED); returns how many were ``cancelled`` and how many a poller was already ``dispatching``
    (a Celery revoke is sent to the workers for those)."""
    totals = {"cancelled": 0, "dispatching": 0}

    def act(matches: list[dict]) -> None:
        outcomes = cancel_or_revoke(app, [item["task_id"] for item in matches])
        totals["cancelled"] += sum(outcome is Change.DONE for outcome in outcomes.values())
        totals["dispatching"] += sum(outcome is Change.IN_FLIGHT for outcome in outcomes.values())

    for _ in walk(app.amqp.delayed_store, flt, progress, act):
        pass
    return totals


def reschedule(store: DelayedStore, flt: Filter, *, shift_ms: int | None = None, to_ms: int | None = None,
               progress: Progress | None = None) -> dict[str, int]:
    """Move every scheduled task matching ``flt`` by ``shift_ms`` or to ``to_ms``; returns how many
    were ``moved`` and how many a poller was already ``dispatching`` (those run as they were).

    A moved task may land further on in the walk: it is recognised and left alone
    (by id while a shift's tasks are ahead, by its due time when all go to one time).
    """
    if (shift_ms is None) == (to_ms is None):
        raise ValueError("give a shift or a new due time, not both")
    totals = {"moved": 0, "dispatching": 0}
    ahead: dict[str, int] = {}  # ids shifted in this partition -> their new due ms, until the walk passes it
    partition = [0]

    def act(matches: list[dict]) -> None:
        if matches and matches[0]["partition"] != partition[0]:
            partition[0] = matches[0]["partition"]
            ahead.clear()
        todo = [item for item in matches if item["task_id"] not in ahead and item["due_ms"] != to_ms]
        moves = [(item["task_id"], to_ms if to_ms is not None else item["due_ms"] + shift_ms) for item in todo]
        outcomes = store.reschedule_many(moves)
        totals["moved"] += sum(outcome is Change.DONE for outcome in outcomes.values())
        totals["dispatching"] += sum(outcome is Change.IN_FLIGHT for outcome in outcomes.values())
        if shift_ms is not None:
            ahead.update((task_id, due) for task_id, due in moves if outcomes[task_id] is Change.DONE)
            if matches:  # the walk has passed these (an entry moved to the last due time may still come)
                for task_id in [t for t, due in ahead.items() if due < matches[-1]["due_ms"]]:
                    del ahead[task_id]

    for _ in walk(store, flt, progress, act):
        pass
    return totals


def move(store: DelayedStore, task_id: str, *, to_ms: int | None = None, shift_ms: int | None = None) -> int:
    """Reschedule one task to ``to_ms`` or by ``shift_ms`` from its due time; returns the new due ms.
    Raises :class:`.TaskNotScheduled` or :class:`.TaskInFlight` as :meth:`.DelayedStore.reschedule` does."""
    if (to_ms is None) == (shift_ms is None):
        raise ValueError("give a new due time or a shift, not both")
    if to_ms is None:
        info = store.get(task_id)
        if info is None:
            Change.UNKNOWN.refuse(task_id, "rescheduled")
        if info["due_ms"] is None:  # claimed: in flight
            Change.IN_FLIGHT.refuse(task_id, "rescheduled")
        to_ms = info["due_ms"] + shift_ms
    return store.reschedule(task_id, to_ms)


def parse_when(text: str | None, now_ms: int) -> int | None:
    """A time an operator typed, in ms since the epoch: ISO 8601 (naive = UTC, as Celery reads an ETA;
    a browser's datetime-local field is one), ms since the epoch, or ``now``, ``now+10m``, ``now-2h``
    (s, m, h, d).  Empty: None."""
    text = (text or "").strip()
    if not text:
        return None
    if text.startswith("now"):
        offset = text[3:].replace(" ", "")
        return now_ms + (parse_seconds(offset) * 1000 if offset else 0)
    try:  # int() refuses more than 4300 digits
        return int(text) if text.isdigit() else due_ms_of(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (give ISO 8601 such as 2026-12-24T18:00, ms since the epoch, "
                         "or now+10m)") from None


def parse_rate(text: str | None) -> float | None:
    """A queue's rate as an operator gives it: tasks a second, ``off`` (0: no limit), or nothing (None:
    back to ``delayed_queue_rates``)."""
    try:
        return None if text is None else 0.0 if text == "off" else float(text)
    except ValueError:
        raise ValueError(f"a rate must be tasks a second, or off; got {text!r}") from None


def parse_move(eta: str | None, shift: str | None, now_ms: int) -> tuple[int | None, int | None]:
    """How an operator asked to move tasks, as ``(to_ms, shift_ms)``: to a new due time (``eta``, as
    :func:`parse_when` reads it) or by a shift (as :func:`parse_seconds` reads it); exactly one."""
    to_ms = parse_when(eta, now_ms)
    shift_ms = parse_seconds(shift.strip()) * 1000 if shift and shift.strip() else None
    if (to_ms is None) == (shift_ms is None):
        raise ValueError("give a new due time (eta: ISO 8601, ms since the epoch, now+10m) or a shift "
                         "(90, 90m, -1h), not both")
    return to_ms, shift_ms


def parse_seconds(text: str) -> int:
    """``+90``, ``90s``, ``-10m``, ``2h``, ``1d``: whole seconds (a shift)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        return int(body) * unit
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (give seconds, or a number with s, m, h or d)") from None


