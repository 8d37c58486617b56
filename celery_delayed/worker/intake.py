"""The worker's event-loop side of the Kafka feed: what Celery is given.

The feed's Kafka thread reads records and decides which may run (:mod:`.consumer`);
here, on the loop, each admitted record becomes a kombu message given to
Celery's own task strategy, or is settled without running (finished, revoked,
replaced, put back, or dead-lettered when it can never run).  Celery acks or
rejects the request when it ends, which settles the record's offset and
releases its run claim; a requeue goes back through the store.
"""
from __future__ import annotations

import enum
import reprlib
import time
import traceback
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from celery import signals, states
from celery.exceptions import BackendError
from celery.worker import state as worker_state
from kombu.exceptions import OperationalError
from kombu.message import Message
from kombu.serialization import prepare_accept_content

from celery_delayed import inert
from celery_delayed import metrics
from celery_delayed.envelope import KEY_HEADER, KEY_MODE_HEADER, Envelope, attempt_of
from celery_delayed.kafka import CLAIMED_HEADER, DUE_HEADER
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters, reason_of
from celery_delayed.store.layout import MAX_DUE_MS, iso_of
from celery_delayed.store.outcomes import STORE_ERRORS
from celery_delayed.store.revoke import record_revoked
from celery_delayed.worker.broker import connect, publish_args
from celery_delayed.worker.failures import parking
from celery_delayed.worker.offsets import OffsetTracker, PartitionOffsets
from celery_delayed.worker.once import FROM_KAFKA, Admit, Copy, RunClaims, Verdict

logger = inert.logger(__name__)

#: What a hand-over to Celery may raise that is not the message's fault: the record is tried again.
#: Anything else Celery's strategy raises is about the message itself, which can never run.
TRANSIENT_ERRORS = (*STORE_ERRORS, BackendError, OperationalError, ConnectionError, TimeoutError, OSError)
#: How often (s) a record that ended checks whether its dead letter is written yet, before it settles.
PARK_CHECK = 0.5
#: Longest a stopping worker tries to reach Celery's broker to hand back the tasks it read (s).
HAND_BACK_WITHIN = 2.0


#: Celery >= 5.7 cancels the ETA timer entries of the requests it drops when its consumer
#: restarts, and forgets every one it dropped; before, a dropped request cannot be told.
_DROPS_ARE_FORGOTTEN = hasattr(worker_state, "scheduled_requests")


@signals.task_received.connect
def _restore_eta(request: Any = None, **_: Any) -> None:
    """A task from Kafka sees the ETA it was scheduled with (``self.request.eta``), though
    Celery's timer never held it: the strategy has read the message, so the ETA goes back into
    the request's dict, which the pool builds the task's context from."""
    marks = request.request_dict.get(FROM_KAFKA) if request is not None else None
    if isinstance(marks, dict) and marks.get("eta"):
        request.request_dict["eta"] = marks["eta"]


class Intake:
    """Acts, on the worker's event loop, on the records the feed admitted (:meth:`dispatch`).

    ``in_hand``: the tasks given to Celery and not settled yet, by id.  ``on_settled`` is
    called after each settle (a prefetch slot is free).
    """

    def __init__(self, c: Any, store: DelayedStore, claims: RunClaims, offsets: OffsetTracker,
                 on_settled: Callable[[], None]) -> None:
        self.c = c
        self.store = store
        self.settings = store.settings
        self.claims = claims
        self.offsets = offsets
        self.dead_letters = DeadLetters(store)
        self.accept = prepare_accept_content(c.app.conf.accept_content)
        self.in_hand: dict[str, Task] = {}
        self._on_settled = on_settled
        self._requests: dict[str, Any] = {}  # Celery's request of each task in hand, once it made one
        self._jobs: dict[str, Any] = {}  # their pool jobs, kept from the start of a warm shutdown
        self._shutting_down = False  # the worker is stopping (not its consumer restarting): hand back (let_go)
        signals.task_received.connect(self._on_received)  # weakly: gone with this intake
        signals.worker_shutting_down.connect(self._on_shutting_down)

    def dispatch(self, arrival: Arrival) -> None:
        """Act on one admitted record: hand it to Celery's strategy for its task, or settle it
        without running it (dead-lettered, finished, revoked, replaced or put back).

        Raises only for errors outside the message (the record is tried again,
        with the run claim it holds); a message that cannot be run is dead-lettered.
        """
        record, partition, task, verdict = arrival.record, arrival.partition, arrival.task, arrival.verdict
        if task is None or verdict is None:  # it can never run: any other was admitted before its hand-over
            self._dead_letter(record, partition, arrival.problem or "never admitted", arrival.trace)
            return
        task_id = task.envelope.task_id
        if verdict.admit is Admit.FINISHED:
            self._skip_finished(task_id, record, partition, verdict.meta)
        elif verdict.admit in (Admit.REVOKED, Admit.REPLACED):
            logger.info("task %s was %s: recorded as REVOKED, not run", task_id, verdict.admit.value)
            record_revoked(self.c.app, task_id, task.envelope, reason=verdict.admit.value)
            metrics.SKIPPED_REVOKED.inc()
            self._settle(partition, record.offset())
        elif verdict.admit is Admit.BUSY:  # another copy is running: try again once its claim would have expired,
            # dispatched then (the poller sends it the dispatch lead early), not found still claimed again and again
            metrics.DEFERRED_DUPLICATES.inc()
            self._put_back(task_id, record.value(), attempt_of(task.headers),
                           verdict.wait_ms + int(self.settings.dispatch_lead * 1000))
            self._settle(partition, record.offset())
        else:
            self.in_hand[task_id] = task
            try:
                self._run_claimed(arrival, task)
            except _Unrunnable as exc:
                self._release(task_id)
                self._dead_letter(record, partition, str(exc), exc.traceback)
            except BaseException:  # tried again holding its claim, which _drop_ready gives up if need be
                self._untrack(task_id)
                raise

    def give_up(self, arrival: Arrival, reason: str, tb: str) -> None:
        """Dead-letter a record :meth:`dispatch` failed on again and again, by no fault it knows, its
        run claim given up."""
        if (task_id := arrival.claimed()) is not None:
            self._release(task_id)
        self._dead_letter(arrival.record, arrival.partition, reason, tb)

    def _run_claimed(self, arrival: Arrival, task: Task) -> None:
        """Give a claimed record to Celery, acknowledged or put back through the store when it ends."""
        record, partition = arrival.record, arrival.partition
        task_id, offset = task.envelope.task_id, record.offset()

        def on_ack(log: Any = None, errors: Any = None) -> None:
            self._release(task_id)
            self._settle_once_parked(task_id, partition, offset)

        def on_reject(log: Any = None, errors: Any = None, requeue: bool = False) -> None:
            if requeue:  # back through the store, due now, so the requeue survives any crash
                self._untrack(task_id)
                self._requeue(task_id, record.value(), attempt_of(task.envelope.headers), partition, offset)
            else:
                self._release(task_id)
                self._settle_once_parked(task_id, partition, offset)

        try:
            message = self._message(arrival, task)
            _check_body(message.payload)  # decoded once: kombu keeps it for Celery's strategy
            task.strategy(message, None, on_ack, on_reject, self.c.on_task_message)
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:
            raise _Unrunnable(f"invalid task message: {exc!r}", traceback.format_exc()) from exc

    def _message(self, arrival: Arrival, task: Task) -> Message:
        """The kombu message Celery's strategy takes, from a record's envelope and headers.

        Due now: Celery's own ETA timer must not hold it again; the ETA travels in our header,
        where the process running it finds it for request.eta, remembers when it finished,
        and task code (benchmarks) can read when each hop happened.  Dispatched ahead of its
        due time (delayed_dispatch_lead), Celery's timer holds it for the rest of the lead.
        """
        record, envelope, headers = arrival.record, task.envelope, task.headers
        marks = _record_headers(record)
        due_ms, claimed_ms, now_ms = marks.get(DUE_HEADER), marks.get(CLAIMED_HEADER), int(time.time() * 1000)
        eta = iso_of(due_ms)
        headers.pop("eta", None)
        if (start_ms := hold_until(due_ms, claimed_ms, now_ms)) is not None:
            headers["eta"] = eta if start_ms == due_ms else iso_of(start_ms)
        headers[FROM_KAFKA] = {"eta": eta, "due": due_ms, "claimed": claimed_ms,
                               "produced": record.timestamp()[1], "read": arrival.read_ms, "handed": now_ms}
        return Message(body=envelope.body, content_type=envelope.content_type,
                       content_encoding=envelope.content_encoding, headers=headers,
                       properties=envelope.properties, accept=self.accept, channel=None,
                       delivery_info={"exchange": envelope.exchange,
                                      "routing_key": envelope.routing_key or envelope.queue})

    def let_go(self, running: set[str]) -> None:
        """Once the feed stopped: give up the run claims of the tasks in hand that can never run here,
        and hand them back to Celery's broker (:meth:`_hand_back`).

        The claims of the others stay held and extended until Celery settles their tasks: the
        running ones, and those in its pool; a job Celery's pool flush dropped after writing it to
        a child, which runs it, is put back in the pool's books (:func:`_back_in_pool`).  One whose
        fate cannot be told (Celery < 5.7, or its job gone) is no longer extended and lapses after
        the run lease.  A copy read meanwhile waits in the store for the claim."""
        never, stale = [], []
        for task_id in self.in_hand.keys() - running:
            fate = self._fate(task_id)
            if fate is _Fate.NEVER:
                never.append(self.in_hand[task_id])
                request = self._requests.get(task_id)
                if request is not None and worker_state.requests.get(task_id) is request:
                    stale.append(request)  # still in Celery's books (see _fate)
            elif fate is _Fate.UNKNOWN:
                self.claims.forget(task_id)
            else:
                _back_in_pool(self._job_of(self._requests[task_id]))
            self._untrack(task_id)
        for request in stale:
            self._forget_request(request)
        hand_back = self._shutting_down and self.settings.done_ttl > 0  # else none is (_hand_back)
        given_up = []
        for task in never:
            if hand_back and self._released_now(task.envelope.task_id):
                given_up.append(task)
            else:  # told when the store answers: meanwhile no copy may run
                self.claims.release(task.envelope.task_id)
        if given_up:
            self._hand_back(given_up)

    def _forget_request(self, request: Any) -> None:
        """Drop a request Celery's ``on_close`` missed (see :meth:`_fate`) as it drops the others: its
        ETA timer entry cancelled, so that it never starts here, also once a restarted consumer
        opens its gate again (its claim is given up: the record is read again), and out of Celery's
        books.  After the fates are told: an eventlet timer's cancel lets the other greenlets run."""
        entry = getattr(request, "_eta_timer_entry", None)
        if entry is not None and self.c.timer is not None:
            try:
                self.c.timer.cancel(entry)
            except Exception as exc:  # as Celery's on_close: the closed gate drops it anyway
                logger.warning("could not cancel the ETA timer entry of task %s: %r", request.id, exc)
        if worker_state.requests.get(request.id) is request:
            worker_state.requests.pop(request.id, None)
        worker_state.scheduled_requests.discard(request)

    def _released_now(self, task_id: str) -> bool:
        """Give a claim up now, so that a broker copy of its task may run; False when the store cannot
        be told now."""
        try:
            self.claims.release_now(task_id)
        except STORE_ERRORS:
            return False
        return True

    def _hand_back(self, tasks: list[Task]) -> None:
        """Send tasks this stopping worker read but can no longer run (their claims given up) to
        Celery's broker, due when they are (:mod:`.broker`), as Celery's own ETA path returns a stopping
        worker's reserved tasks to the broker: a live worker runs each when due, not once the
        partitions' next owners read it again from Kafka (a partition has no owner for a heartbeat or
        more after its worker left the group).  Only when the worker stops: a consumer that restarts
        (its broker connection lost) reads its partitions again itself.  Their Kafka copies stay, and
        the run claims keep to one run; should the broker be away, those copies alone run them.  A
        Kafka copy read after the broker copy ended finds that it ran by its done record alone (a
        result may be ignored, and an attempt that retried stores none): with ``delayed_done_ttl = 0``
        nothing is handed back.  On a Redis broker this worker's own pending read of its queues (a
        BRPOP, answered before the others' one time in as many workers as wait) may take a copy back:
        it returns to the queue when this worker closes its connection, and the Kafka copy may run
        first then, as without the hand-back."""
        now_ms = int(time.time() * 1000)
        try:
            with connect(self.c.app, within=HAND_BACK_WITHIN) as connection:
                producer = connection.Producer()
                for task in tasks:
                    due_ms = task.headers[FROM_KAFKA]["due"] or now_ms
                    producer.publish(**publish_args(self.c.app, task.envelope, due_ms, now_ms, handed_back=True))
        except Exception as exc:  # any failure leaves the Kafka copies, which run all the same
            logger.warning("could not hand the tasks read here back to Celery's broker (%r): they run when the "
                           "partitions' next owners read them", exc)
        else:
            logger.info("handed %d tasks read here back to Celery's broker: %s", len(tasks),
                        ", ".join(task.envelope.task_id for task in tasks))

    def _on_received(self, request: Any = None, **_: Any) -> None:
        """Keep Celery's request of a task in hand (``task_received``, sent while the strategy
        makes it): whether it reached the pool tells :meth:`let_go` if it may still run."""
        if request is not None and request.id in self.in_hand:
            self._requests[request.id] = request

    def _on_shutting_down(self, **_: Any) -> None:
        """At the start of a warm shutdown (``worker_shutting_down``), before Celery flushes its pool:
        mark the worker stopping, so that :meth:`let_go` hands back what it drops; and hold the pool job
        of each request in hand, which Celery refers to weakly only, so that :meth:`_fate` can still see
        afterwards whether it was written to a child."""
        self._shutting_down = True
        for task_id, request in self._requests.items():
            if request._apply_result is not None:
                self._jobs[task_id] = request._apply_result()

    def _job_of(self, request: Any) -> Any:
        """The pool job of a request given to the pool: the one held since the warm shutdown began, else
        the one Celery still refers to (None once the pool dropped it)."""
        return self._jobs.get(request.id) or request._apply_result()

    def _fate(self, task_id: str) -> _Fate:
        """Whether the task of a request in hand, not running, may still run once Celery stopped its
        consumer (which flushes the pool: a prefork job not yet written to a child is dropped)."""
        request = self._requests.get(task_id)
        if request is None or not _DROPS_ARE_FORGOTTEN:
            return _Fate.UNKNOWN
        if request._apply_result is None:  # never given to the pool: dropped, unless Celery still has it
            if worker_state.requests.get(task_id) is not request:
                return _Fate.NEVER
            # Celery still has it, but unless it is reserved or running, only in its books: in an eventlet
            # worker the ETA timer cancels of Celery's on_close let the other greenlets run, and a record
            # handed over then was scheduled after on_close had looked (its books cleared under it); it
            # never starts here (the gate is closed), and left to lapse it waited out its run lease.
            if request in worker_state.reserved_requests or request in worker_state.active_requests:
                return _Fate.UNKNOWN
            return _Fate.NEVER
        job = self._job_of(request)
        if job is None:
            return _Fate.UNKNOWN
        if getattr(job, "_write_to", True) is None and not job._accepted:  # prefork: flushed unwritten
            return _Fate.NEVER
        return _Fate.MAY_RUN

    def _untrack(self, task_id: str) -> None:
        self.in_hand.pop(task_id, None)
        self._requests.pop(task_id, None)
        self._jobs.pop(task_id, None)

    def _requeue(self, task_id: str, data: bytes, attempt: int, partition: PartitionOffsets, offset: int) -> None:
        """Give up a rejected task's run claim and put it back in the store, then settle it; while the
        store is down, try again every second (unsettled meanwhile: a crash reads it again from Kafka).

        The claim is given up first, at once: a copy dispatched before a later release reached Redis
        would find it held and wait for it to lapse (a pool child killed by a stop that reached the
        whole process group ran again a run lease late)."""
        try:
            self.claims.release_now(task_id)
            self._put_back(task_id, data, attempt)
        except STORE_ERRORS as exc:
            logger.warning("task %s could not be requeued (%s); trying again in 1 s", task_id, exc)
            self.c.timer.call_after(1.0, self._requeue, (task_id, data, attempt, partition, offset))
            return
        self._settle(partition, offset)

    def _put_back(self, task_id: str, data: bytes, attempt: int, delay_ms: int = 0) -> None:
        """Schedule a record again in the store, ``delay_ms`` from now by Redis' clock (the pollers').

        A copy of a newer attempt is kept, and so is one of the same attempt still
        scheduled (it runs anyway); an older one, or the same attempt in flight,
        gives way to this one (see :meth:`.DelayedStore.schedule`).
        """
        self.store.schedule(task_id, self.store.now_ms() + delay_ms, data, attempt)

    def _release(self, task_id: str) -> None:
        self._untrack(task_id)
        self.claims.release(task_id)

    def _skip_finished(self, task_id: str, record: Any, partition: PartitionOffsets,
                       meta: dict | None = None) -> None:
        """Acknowledge a copy of a task that already ended, without running it.

        A task that failed for good whose worker was killed after Celery stored
        the FAILURE but before it was parked is parked now, from this copy, so
        the dead-letter queue still holds every task that failed for good.
        """
        logger.debug("task %s already finished: delivery acknowledged without running", task_id)
        if (meta and meta.get("status") == states.FAILURE and self.settings.dead_letter_failures
                and not self.dead_letters.holds(task_id)):
            logger.warning("task %s failed for good but was never parked (its worker died first): parked now",
                           task_id)
            self.dead_letters.add(DeadLetter(
                task_id=task_id, source="worker", reason=reason_of(meta.get("result")),
                traceback=meta.get("traceback") or "", attempts=(meta.get("retries") or 0) + 1,
                message=record.value()))
            metrics.DEAD_LETTERED.labels("worker").inc()
        metrics.SKIPPED_FINISHED.inc()
        self._settle(partition, record.offset())

    def _dead_letter(self, record: Any, partition: PartitionOffsets, reason: str, tb: str = "") -> None:
        task_id = (record.key() or b"").decode(errors="replace") or f"{record.topic()}:{record.offset()}"
        logger.error("task %s: %s; moved to the dead-letter queue", task_id, reason)
        self.dead_letters.park(DeadLetter(task_id=task_id, reason=reason, traceback=tb, source="worker",
                                          message=record.value() or b""), self.c.app.backend)
        metrics.DEAD_LETTERED.labels("worker").inc()
        self._settle(partition, record.offset())

    def _settle_once_parked(self, task_id: str, partition: PartitionOffsets, offset: int) -> None:
        """Settle a record that ended, once the dead letter the worker's main process may be writing
        for it is written (checked every :data:`PARK_CHECK` s): a worker that dies first leaves it
        unsettled, and the copy read again is parked from the FAILURE recorded (_skip_finished)."""
        if parking(task_id):
            self.c.timer.call_after(PARK_CHECK, self._settle_once_parked, (task_id, partition, offset))
        else:
            self._settle(partition, offset)

    def _settle(self, partition: PartitionOffsets, offset: int) -> None:
        self.offsets.settle(partition, offset)
        self._on_settled()


@dataclass
class Task:
    """The task of a record that can run: its decoded message, and Celery's strategy for it."""

    envelope: Envelope
    headers: dict  # the envelope's, which the hand-over edits
    strategy: Any  # Celery's strategy for its task (a closure Celery does not type)


@dataclass
class Arrival:
    """A record read from Kafka, on its way to Celery: decoded (``task``, or a ``problem``) and
    admitted (``verdict``) by the Kafka thread, acted on by the loop."""

    record: Any
    partition: PartitionOffsets
    read_ms: int  # when it was read (ms since the epoch)
    task: Task | None = None  # None when it has a problem
    problem: str | None = None  # why it can never run (dead-lettered), with its traceback
    trace: str = ""
    verdict: Verdict | None = None  # what admit() decided; None when it has a problem
    tries: int = 0  # hand-overs that failed by an error of no known transient kind

    def claimed(self) -> str | None:
        """The task id of a record admitted to run here (its run claim taken; the others are settled
        without a pool slot), else None."""
        if self.task is None or self.verdict is None or self.verdict.admit is not Admit.RUN:
            return None
        return self.task.envelope.task_id


def copy_of(task_id: str, headers: dict) -> Copy:
    """What :func:`.once.admit` decides on for a copy of a task, from its message's headers."""
    return Copy(task_id, attempt_of(headers), replace_key(headers))


def replace_key(headers: dict) -> str | None:
    """The ``delayed_key`` of a replace-mode task (it runs only while its key names it), else None."""
    key = headers.get(KEY_HEADER)
    return key if isinstance(key, str) and headers.get(KEY_MODE_HEADER, "replace") == "replace" else None


def _back_in_pool(job: Any) -> None:
    """Put a prefork job that Celery's pool flush dropped from the pool's books (its cache) after
    writing it to a child back in them: the child runs it, and with the job known again the pool
    reads its result, so Celery acks the task as usual (settling its run claim), and a warm shutdown
    waits for it; unknown, the child's result is never read, and the child waits 30 s to exit.
    (billiard's ApplyResult: ``_cache``, ``_job``; a test pins them.)"""
    cache = getattr(job, "_cache", None)
    if cache is not None and getattr(job, "_write_to", None) is not None and not job._accepted:
        cache.setdefault(job._job, job)


class _Fate(enum.Enum):
    """Whether a task in hand, not running, may still run after Celery stopped its consumer."""

    NEVER = "never"  # dropped by Celery: its run claim is given up
    MAY_RUN = "may run"  # in its pool: the claim stays held
    UNKNOWN = "unknown"  # cannot be told: the claim lapses after the run lease


class _Unrunnable(Exception):
    """Celery's strategy refused the message itself: it can never run, so it is dead-lettered."""

    def __init__(self, reason: str, traceback: str) -> None:
        super().__init__(reason)
        self.traceback = traceback


def hold_until(due_ms: int | None, claimed_ms: int | None, now_ms: int) -> int | None:
    """When Celery's ETA timer is to start a record handed to it at ``now_ms`` (this worker's
    clock), or None: at once.  The poller sends a task up to ``delayed_dispatch_lead`` before it is
    due, by Redis' clock (``claimed_ms``, when it took it); the wait is never longer than that lead,
    so a worker whose clock is behind Redis' does not hold the task (and its partition's commit)
    for the difference."""
    if due_ms is None:
        return None
    wait = due_ms - now_ms if claimed_ms is None else min(due_ms - now_ms, due_ms - claimed_ms)
    return now_ms + wait if wait > 1 else None


def _check_body(payload: Any) -> None:
    """Raise ValueError unless a task message's decoded body is one Celery can run: protocol 2's
    ``[args, kwargs, embed]`` (a list and two objects), or a dict with ``args`` (protocol 1's, which
    Celery converts).  Celery only counts the three parts before its pool runs the task: other args
    fail it there, other kwargs or embed break Celery's own callbacks (the task stays PENDING), and
    either way the record is acknowledged and nothing parked."""
    if isinstance(payload, dict) and "args" in payload:
        return
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3 and isinstance(payload[0], (list, tuple))
            and isinstance(payload[1], dict) and isinstance(payload[2], dict)):
        raise ValueError(f"task body is not [args (a list), kwargs (an object), embed (an object)]: "
                         f"{reprlib.repr(payload)}")


def _record_headers(record: Any) -> dict[str, int]:
    """The poller's ms-valued record headers (:data:`.kafka.DUE_HEADER`, :data:`.kafka.CLAIMED_HEADER`)."""
    found = {}
    for name, value in record.headers() or ():
        if name in (DUE_HEADER, CLAIMED_HEADER):
            try:
                ms = int(value)
            except (TypeError, ValueError):  # not ours after all: timing is information only
                continue
            if 0 <= ms < MAX_DUE_MS:  # no poller wrote any other (and a datetime may not hold it)
                found[name] = ms
    return found
