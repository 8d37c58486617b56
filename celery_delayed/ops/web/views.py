"""What each page of ``celery delayed web`` shows, as JSON-ready dicts (the API returns them as they are).

Every read is bounded, so a page answers as fast with 10M tasks as with ten:
counts are one script call per partition, the load histogram is counted from the
bucket index, lists are pages of :func:`.browse.find` and the dead letters'
newest.  Bulk actions run as :class:`Job` threads whose progress a page polls.
"""
from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from celery_delayed import inert
from celery_delayed import store_of
from celery_delayed.kafka import fleet_warnings
from celery_delayed.ops import browse
from celery_delayed.ops.browse import Filter
from celery_delayed.poller.leadership import leaders, make_etcd
from celery_delayed.recurring.definitions import Definition, Definitions
from celery_delayed.recurring.occurrences import occurrence_id
from celery_delayed.settings import redact_url
from celery_delayed.store.dlq import DeadLetterError, DeadLetters
from celery_delayed.store.inspection import totals
from celery_delayed.store.outcomes import Change
from celery_delayed.store.revoke import cancel_or_revoke

if TYPE_CHECKING:
    from celery import Celery

logger = inert.logger(__name__)
MINUTE_MS, HOUR_MS = 60_000, 3_600_000
#: The load histogram: per minute for the next hour, per hour for the next two days.
NEAR_BINS, FAR_BINS = 60, 48
#: Seconds between two readings of the days-ahead histogram.
FAR_EVERY = 30.0
#: Seconds between two counts of the scheduled tasks per task name (each reads the whole schedule).
NAMES_EVERY = 300.0
#: Seconds between two looks at Kafka: whether it answers, and which queues no worker reads.
KAFKA_EVERY = 30.0
#: Seconds between two scrapes of the pollers' metrics.
SCRAPE_EVERY = 5.0
#: Dead letters a bulk requeue or purge takes between two progress reports.
LETTERS_CHUNK = 100
#: Letters a bulk requeue could not requeue that its job names (with why); the count has them all.
KEPT_SHOWN = 20
#: Bulk jobs kept for their pages (the oldest finished ones are forgotten first).
KEPT_JOBS = 100


class Views:
    """The data behind every page and API route of one Celery app's store."""

    def __init__(self, app: Celery, metrics_urls: tuple[str, ...] = ()) -> None:
        self.app = app
        self.store = store_of(app)
        self.letters = DeadLetters(self.store)
        self.definitions = Definitions(self.store)
        self.jobs = Jobs()
        # a poller's /metrics also reads the store and Kafka: scraped in the background, every few seconds
        self._dispatch = Refreshing(DispatchRate(metrics_urls).read, SCRAPE_EVERY) if metrics_urls else None
        self._etcd = None
        # the days-ahead histogram counts every bucket of two days (~0.5 s of short calls at any store
        # size): read in the background, at most every FAR_EVERY seconds, shown with its age
        self._far = Refreshing(lambda: self._histogram(self.store.now_ms(), HOUR_MS, FAR_BINS), FAR_EVERY)
        # Kafka's answer takes up to seconds (a timeout when it is away): asked in the background
        self._kafka = Refreshing(lambda: fleet_warnings(self.store.settings), KAFKA_EVERY)
        self._names: Refreshing | None = None  # started by the first overview: a walk of the whole schedule

    # -- overview ------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """Per partition and in all: scheduled, in flight, overdue, next due, the leader and its lease;
        per queue: overdue, next due, paused since; Kafka's warnings (unreachable, queues no worker
        reads; empty until first read); dead letters; the load histogram; the pollers'
        dispatch rate and lag when their metrics are given; the tasks per task name (None while the
        first count runs)."""
        now_ms = self.store.now_ms()
        rows = self.store.counts()
        lead, etcd_error = self._leaders()
        for row in rows:
            row.update(lead.get(row["partition"], {"poller": None, "lease_ttl_s": None}))
        summed = {**totals(rows), "led": sum(1 for r in rows if r["poller"]),
                  "pollers": len({r["poller"] for r in rows if r["poller"]})}
        return {"now_ms": now_ms, "totals": summed, "partitions": rows, "queues": self.store.queues(),
                "etcd_error": etcd_error, "kafka_warnings": self._kafka.get(wait=False) or [],
                "dead_letters": {"count": self.letters.count(), "oldest_age_s": self.letters.oldest_age()},
                "histogram": {"next_hour": self._histogram(now_ms, MINUTE_MS, NEAR_BINS),
                              "next_days": self._far.get()},
                "dispatch": self._dispatch.get() if self._dispatch else None,
                "task_names": self._task_names()}

    def _task_names(self) -> dict[str, Any] | None:
        """Scheduled tasks per task name, the names the app does not register flagged (a deploy renamed
        or removed them); counted in the background every NAMES_EVERY seconds, shown with its age."""
        if self._names is None:
            self._names = Refreshing(lambda: {"as_of_ms": self.store.now_ms(), "tasks": browse.by_task(self.app)},
                                     NAMES_EVERY)
        try:
            return self._names.get(wait=False)
        except Exception as exc:  # the app's task modules fail to import here, say: the rest of the page shows
            return {"as_of_ms": self.store.now_ms(), "tasks": [], "error": f"{exc!r}"}

    def _histogram(self, now_ms: int, bin_ms: int, bins: int) -> dict[str, Any]:
        start = now_ms - now_ms % bin_ms
        return {"start_ms": start, "bin_s": bin_ms // 1000, "as_of_ms": now_ms,
                "counts": self.store.histogram(start, start + bins * bin_ms, bin_ms)}

    def _leaders(self) -> tuple[dict[int, dict], str | None]:
        try:
            if self._etcd is None:
                self._etcd = make_etcd(self.store.settings)
            return leaders(self.store.settings, self._etcd), None
        except Exception as exc:  # etcd down: the store's figures still show
            return {}, f"etcd: {exc!r}"

    # -- the schedule ----------------------------------------------------------
    def upcoming(self, flt: Filter, after: str | None, limit: int) -> dict[str, Any]:
        page = browse.find(self.store, flt, limit, after)
        return {"now_ms": self.store.now_ms(), "filter": flt.as_dict(), "items": page.items,
                "cursor": page.cursor, "examined": page.examined, "limit": limit}

    def task(self, task_id: str) -> dict[str, Any] | None:
        """``delayed show``'s view of a task (and Redis' time), or None."""
        info = self.store.get(task_id)
        if info is not None:
            info["now_ms"] = self.store.now_ms()
        return info

    def cancel(self, task_id: str) -> dict[str, Any]:
        """Cancel for good, as a revoke does; a task being dispatched is revoked in the workers."""
        outcome = cancel_or_revoke(self.app, [task_id])[task_id]
        if outcome is Change.UNKNOWN:
            outcome.check(task_id, "cancelled")
        return {"task_id": task_id, "outcome": "cancelled" if outcome is Change.DONE else "revoked in the workers"}

    def reschedule(self, task_id: str, eta: str | None, shift: str | None) -> dict[str, Any]:
        """Move a task to ``eta`` or by ``shift`` (as :func:`.browse.parse_move` reads them)."""
        to_ms, shift_ms = browse.parse_move(eta, shift, self.store.now_ms())
        due_ms = browse.move(self.store, task_id, to_ms=to_ms, shift_ms=shift_ms)
        return {"task_id": task_id, "due_ms": due_ms}

    def queue_action(self, queue: str, action: str) -> dict[str, Any]:
        """Pause or resume a queue (:meth:`.DelayedStore.pause`); ``changed`` False when it already was."""
        changed = self.store.pause(queue) if action == "pause" else self.store.resume(queue)
        return {"queue": queue, "paused": action == "pause", "changed": changed}

    def queue_rate(self, queue: str, rate: str | None) -> dict[str, Any]:
        """Set a queue's rate (tasks a second, "off" for none; empty: back to ``delayed_queue_rates``)."""
        self.store.set_rate(queue, browse.parse_rate(rate))
        return {"queue": queue, "rate": self.store.queue_rates().get(queue)}

    def run_now(self, task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, "due_ms": browse.move(self.store, task_id, to_ms=self.store.now_ms())}

    # -- recurring schedules ---------------------------------------------------
    def schedules(self, prefix: str, after: str | None, limit: int) -> dict[str, Any]:
        """A page of the recurring schedules whose id starts with ``prefix`` (in no order: a scan of
        the store, see :meth:`.Definitions.page`), each as :meth:`schedule` shows it."""
        page, cursor = self.definitions.page(prefix, after or "", limit)
        return {"now_ms": self.store.now_ms(), "prefix": prefix, "limit": limit, "cursor": cursor,
                "items": [self._schedule(definition) for definition in page]}

    def schedule(self, schedule_id: str) -> dict[str, Any] | None:
        """One schedule as ``delayed schedules show --json`` gives it, with the state of its pending
        occurrence (scheduled, dispatched...) and of its last run, where it is kept; None if unknown."""
        definition = self.definitions.get(schedule_id)
        return None if definition is None else {**self._schedule(definition), "now_ms": self.store.now_ms()}

    def schedule_action(self, schedule_id: str, action: str) -> dict[str, Any] | None:
        """Pause, resume or run a schedule now (``delayed schedules pause|resume|run-now``); None if unknown."""
        if action == "run-now":
            task_id = self.definitions.run_now(schedule_id)
            return None if task_id is None else {"schedule_id": schedule_id, "task_id": task_id}
        done = self.definitions.pause(schedule_id) if action == "pause" else self.definitions.resume(schedule_id)
        return None if done is None else {"schedule_id": schedule_id, "paused": done.paused}

    def _schedule(self, definition: Definition) -> dict[str, Any]:
        info = definition.describe()
        pending = self.store.get(info["next_id"]) if info["next_id"] else None
        info["next_state"] = pending["state"] if pending else None
        last_id = None if info["last_ms"] is None else occurrence_id(definition.schedule_id, info["last_ms"])
        info["last_id"], info["last_state"] = last_id, last_id and self.app.AsyncResult(last_id).state
        return info

    # -- bulk ------------------------------------------------------------------
    def bulk(self, action: str, flt: Filter, shift_ms: int | None = None, to_ms: int | None = None,
             confirm: str | None = None) -> Job:
        """Start a bulk job on every task matching ``flt``: ``count``, or ``cancel`` / ``reschedule``,
        which run only with ``confirm`` naming a finished count of the same filter not used before
        (a double submit changes nothing twice)."""
        if action == "count":
            return self.jobs.start("count", flt, lambda progress: {"matched": browse.count(self.store, flt, progress)})
        if action not in ("cancel", "reschedule"):
            raise ValueError(f"unknown bulk action {action!r}: count, cancel or reschedule")
        if flt.is_empty():
            raise ValueError(f"a bulk {action} needs a filter (task, queue, due window or id prefix)")
        if not self.jobs.use_count(confirm or "", flt):
            raise ValueError(f"{action} by filter needs confirming: count the tasks of this filter first, then "
                             "send the count job's id as confirm (each count confirms one change)")
        if action == "cancel":
            return self.jobs.start("cancel", flt, lambda progress: browse.cancel(self.app, flt, progress))
        return self.jobs.start("reschedule", flt, lambda progress: browse.reschedule(
            self.store, flt, shift_ms=shift_ms, to_ms=to_ms, progress=progress))

    # -- dead letters ----------------------------------------------------------
    def dead_letters(self, task: str | None, reason: str | None, limit: int) -> dict[str, Any]:
        letters = self.letters.find(task, reason, limit)
        return {"now_ms": self.store.now_ms(), "count": self.letters.count(),
                "filter": {k: v for k, v in (("task", task), ("reason", reason)) if v},
                "items": [{k: v for k, v in letter.describe().items() if k not in ("headers", "traceback")}
                          for letter in letters]}

    def dead_letter(self, task_id: str) -> dict[str, Any] | None:
        letter = self.letters.get(task_id)
        return None if letter is None else {"message_error": None, "message_preview": None, **letter.describe()}

    def letters_bulk(self, action: str, flt: LetterFilter, confirm: str | None) -> Job:
        """Start a job that requeues or purges every dead letter ``flt`` selects, :data:`LETTERS_CHUNK`
        at a time; ``confirm`` must be how many it selects now (what the page said), so a page gone
        stale changes nothing unseen.  A job, not the request: 100,000 letters take minutes."""
        if action not in ("requeue", "purge"):
            raise ValueError(f"unknown dead-letter action {action!r}: requeue or purge")
        if not (confirm or "").isdigit():  # before reading up to every letter to count them
            raise ValueError(f"{action} of dead letters needs confirm=<how many match>")
        ids = self.letters.matching(flt.task, flt.reason)
        if confirm != str(len(ids)):
            raise ValueError(f"{action} of {len(ids)} dead letters needs confirm={len(ids)}")
        change = getattr(self, action)

        def work(progress: Callable[[int, int], None]) -> dict[str, Any]:
            totals: dict[str, Any] = {}
            for start in range(0, len(ids), LETTERS_CHUNK):
                for name, n in change(ids[start:start + LETTERS_CHUNK]).items():
                    totals[name] = totals.get(name, 0) + n if isinstance(n, int) else [*totals.get(name, []), *n]
                progress(min(start + LETTERS_CHUNK, len(ids)), len(ids))
            if "kept_letters" in totals:
                totals["kept_letters"] = totals["kept_letters"][:KEPT_SHOWN]
            return totals

        return self.jobs.start(action, flt, work)

    def requeue(self, task_ids: list[str]) -> dict[str, Any]:
        """Requeue dead letters: counts of those requeued, unknown (gone) and kept (their message is
        not one of that task, so they stay parked), and ``kept_letters``: each kept one and why."""
        requeued = unknown = 0
        kept: list[str] = []
        for task_id in task_ids:
            try:
                if self.letters.requeue(task_id, self.app.backend):
                    requeued += 1
                else:
                    unknown += 1
            except DeadLetterError as exc:  # one such letter must not stop the others
                kept.append(f"{task_id}: {exc}")
        return {"requeued": requeued, "unknown": unknown, "kept": len(kept), "kept_letters": kept}

    def purge(self, task_ids: list[str]) -> dict[str, Any]:
        purged = sum(self.letters.purge(t) for t in task_ids)
        return {"purged": purged, "unknown": len(task_ids) - purged}


class Refreshing:
    """A value computed again in a background thread once older than ``every`` seconds; until the new
    one is ready the last is served (only reads before the first value wait).  A failed computation
    is logged and the last value kept; with no value yet, readers get its error."""

    def __init__(self, compute: Callable[[], Any], every: float) -> None:
        self._compute, self._every = compute, every
        self._value: Any = None
        self._error: Exception | None = None
        self._at = 0.0
        self._lock = threading.Lock()
        self._busy = False
        self.ready = threading.Event()
        self._refresh()

    def get(self, wait: bool = True) -> Any:
        """The latest value; without ``wait``, None until the first one is ready."""
        if not wait and not self.ready.is_set():
            return None
        self.ready.wait()
        if time.monotonic() - self._at > self._every:
            self._refresh()
        if self._value is None:  # never computed: the reader sees why
            assert self._error is not None
            raise self._error
        return self._value

    def _refresh(self) -> None:
        with self._lock:
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._run, name="web-refresh", daemon=True).start()

    def _run(self) -> None:
        try:
            self._value, self._at = self._compute(), time.monotonic()
        except Exception as exc:
            self._error = exc
            logger.warning("web view: recomputing a cached view failed: %r", exc)
        finally:
            with self._lock:
                self._busy = False
            self.ready.set()


@dataclass(frozen=True)
class LetterFilter:
    """The dead letters a bulk requeue or purge takes: of task name ``task``, whose reason contains
    ``reason`` (None: any)."""

    task: str | None = None
    reason: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Job:
    """A bulk action running in a thread of the web process: its progress, then its result."""

    action: str
    filter: Filter | LetterFilter
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: str = "running"  # running, done, failed
    examined: int = 0
    matched: int = 0
    result: dict | None = None
    error: str | None = None
    used: bool = False  # a count that confirmed a change
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "filter": self.filter.as_dict()}


class JobRunning(Exception):
    """A bulk job of the kind asked for is running: one of each kind at a time, so requests cannot pile up
    walks of the whole schedule."""


class Jobs:
    """The web process's bulk jobs by id (kept in memory: a restart forgets them, not their effect)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def use_count(self, job_id: str, flt: Filter) -> bool:
        """Whether ``job_id`` is a finished, unused count of ``flt``; it is used from now on."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.action != "count" or job.state != "done" or job.filter != flt or job.used:
                return False
            job.used = True
            return True

    def start(self, action: str, flt: Filter | LetterFilter, work: Callable[[Callable[[int, int], None]], dict]) -> Job:
        job = Job(action, flt)

        def progress(examined: int, matched: int) -> None:
            job.examined, job.matched = examined, matched

        def run() -> None:
            try:
                job.result = work(progress)
                job.state = "done"
            except Exception as exc:  # shown on the job's page; what was done before it stays done
                job.error, job.state = f"{type(exc).__name__}: {exc}", "failed"
            finally:
                job.finished = time.time()

        with self._lock:
            running = next((j for j in self._jobs.values() if j.action == action and j.state == "running"), None)
            if running is not None:
                raise JobRunning(f"a {action} job is running ({running.id}): start another once it ends")
            self._jobs[job.id] = job
            finished = [j for j in self._jobs.values() if j.finished]  # oldest first
            for old in finished[:max(0, len(self._jobs) - KEPT_JOBS)]:
                del self._jobs[old.id]
        threading.Thread(target=run, name=f"bulk-{job.id}", daemon=True).start()
        return job


class DispatchRate:
    """The pollers' dispatch rate and lag, from their Prometheus endpoints (``--metrics URL``).

    The rate is the dispatched counters' growth since the previous read; the lag
    quantiles are read from the dispatch lag histograms' buckets (since each
    poller started), the bucket's upper bound a quantile falls in.
    """

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self._last: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def read(self) -> dict[str, Any]:
        dispatched, buckets, errors = 0.0, {}, []  # type: float, dict[float, float], list[str]
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    text = reply.read().decode()
            except OSError as exc:
                errors.append(f"{redact_url(url)}: {exc}")
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "celery_delayed_dispatched_total":
                        dispatched += sample.value
                    elif sample.name == "celery_delayed_dispatch_lag_seconds_bucket":
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + sample.value
        now = time.monotonic()
        with self._lock:
            last, self._last = self._last, (now, dispatched)
        rate = None if last is None or now <= last[0] else max(0.0, dispatched - last[1]) / (now - last[0])
        return {"dispatched": dispatched, "rate_per_s": rate, "lag_p50_s": _quantile(buckets, 0.5),
                "lag_p99_s": _quantile(buckets, 0.99), "errors": errors}


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile ``q`` (cumulative counts by bound)."""
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    return next(le for le, n in sorted(buckets.items()) if n >= q * total)
