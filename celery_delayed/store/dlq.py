"""The dead-letter queue: messages that cannot be dispatched or run, kept for operators.

Stored in Redis beside the store (``<prefix>:{dlq}:msg`` HASH and
``<prefix>:{dlq}:index`` ZSET by time, one hash tag so it works on a cluster),
so it survives restarts of every component.  A record is one JSON line
(reason, traceback, attempts, time, source) followed by the original bytes.
Operators list and read records, requeue them (back through the store, due
now, under the same task id) or purge them (``celery delayed dlq ...``).  The
queue keeps ``delayed_dlq_max_age`` seconds and ``delayed_dlq_max_entries``
letters at most: each new letter drops the oldest ones past either.
A message parked before it ran also gets a FAILURE result (:meth:`DeadLetters.park`),
so whoever waits on it learns why instead of waiting for ever.
"""
from __future__ import annotations

import builtins
import contextlib
import itertools
import json
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol
from collections.abc import Callable, Iterator

from celery_delayed import inert
from celery_delayed.envelope import Envelope, EnvelopeError, attempt_of
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.records import forget_run_records

logger = inert.logger(__name__)

#: Records read and requeued per round trip by :meth:`DeadLetters.requeue_all`.
REQUEUE_CHUNK = 500
#: Bytes of an undecodable message shown to operators.
PREVIEW_BYTES = 200
#: Most letters one :meth:`DeadLetters.add` drops to keep the queue within its retention.
TRIM_LIMIT = 100


class DeadLetterError(ValueError):
    """A dead letter cannot be read or requeued; the message says which and why."""


class DeadLettered(Exception):
    """The FAILURE result of a task parked in the dead-letter queue before it ran; says why."""


class ResultBackend(Protocol):
    """What parking and requeueing need of a Celery result backend."""

    def forget(self, task_id: str) -> None: ...

    def mark_as_failure(self, task_id: str, exc: BaseException, traceback: str | None = None) -> None: ...


def reason_of(error: object) -> str:
    """A dead letter's reason for what a task ended with: ``Type: message`` for an error, else its repr."""
    return f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else repr(error)


@dataclass
class DeadLetter:
    """One parked message and why it was parked."""

    task_id: str
    reason: str
    source: str
    traceback: str = ""
    attempts: int = 0
    timestamp: float = 0.0
    message: bytes = b""

    def encode(self) -> bytes:
        return json.dumps(self._meta(), separators=(",", ":")).encode() + b"\n" + self.message

    @classmethod
    def decode(cls, data: bytes) -> DeadLetter:
        """Parse a record; fields unknown to this version are ignored, a damaged record raises."""
        end = data.find(b"\n")
        if end < 0:
            raise DeadLetterError("dead-letter record has no meta line")
        try:
            meta = json.loads(data[:end])
            return cls(**{k: v for k, v in meta.items() if k in _META_FIELDS}, message=data[end + 1:])
        except (ValueError, TypeError, AttributeError) as exc:  # not JSON, not an object, fields missing
            raise DeadLetterError(f"dead-letter record is damaged: {exc}") from None

    def describe(self) -> dict[str, Any]:
        """Everything an operator may want, JSON-ready: the record's fields, then the
        message's task name, queue and headers, or why the message is not an envelope."""
        info = {**self._meta(), "message_bytes": len(self.message)}
        try:
            envelope = Envelope.decode(self.message)
        except EnvelopeError as exc:
            info.update(task="?", queue=None, headers=None, message_error=str(exc),
                        message_preview=repr(self.message[:PREVIEW_BYTES]))
        else:
            info.update(task=envelope.task_name or "?", queue=envelope.queue, headers=envelope.headers)
        return info

    def matches(self, task: str | None, reason: str | None) -> bool:
        """Whether the letter's task name is ``task`` and its reason contains ``reason`` (None: any)."""
        if reason is not None and reason.lower() not in self.reason.lower():
            return False
        if task is None:
            return True
        try:
            return Envelope.decode(self.message).task_name == task
        except EnvelopeError:
            return False

    def _meta(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "message"}


_META_FIELDS = frozenset(f.name for f in fields(DeadLetter)) - {"message"}


class DeadLetters:
    """Add, list, read, requeue and purge dead letters by task id."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        self.keys = store.keys.dlq  # the record hash, the index by time parked
        self._scripts = store.scripts

    def add(self, letter: DeadLetter) -> None:
        """Park ``letter``, and drop the oldest letters past ``delayed_dlq_max_age`` or beyond
        ``delayed_dlq_max_entries`` (at most :data:`TRIM_LIMIT` per call)."""
        letter.timestamp = letter.timestamp or time.time()
        settings, store = self.store.settings, self.store
        pipe = store.redis.pipeline(transaction=False)
        self._scripts["dead_letter"](keys=self.keys, client=pipe, args=[
            letter.task_id, letter.encode(), int(settings.dlq_max_age * 1000), settings.dlq_max_entries, TRIM_LIMIT])
        store.durable.end(pipe)  # its message is settled next: a failover must not lose it
        ((_, trimmed),) = store.durable.confirm(pipe, store.execute(pipe), [store.keys.dlq_wait])
        if trimmed:
            logger.warning("dead-letter queue: dropped its %d oldest letter(s), past delayed_dlq_max_age=%ss "
                           "or beyond delayed_dlq_max_entries=%d", trimmed, settings.dlq_max_age,
                           settings.dlq_max_entries)

    def park(self, letter: DeadLetter, backend: ResultBackend | None) -> None:
        """:meth:`add` a message that will not run, and record its FAILURE in ``backend`` (the app's
        result backend), so ``AsyncResult.get()`` raises :class:`DeadLettered` naming the reason.

        Not for tasks that failed when run: Celery has recorded their failure.  A
        backend that cannot record it is logged: the message is parked either way.
        """
        self.add(letter)
        if backend is None:
            return
        try:
            reason = DeadLettered(f"dead-lettered by the {letter.source}: {letter.reason}")
            backend.mark_as_failure(letter.task_id, reason, traceback=letter.traceback or None)
        except Exception:  # any backend, any error: waiters keep waiting, the dead letter stays
            logger.exception("could not record the FAILURE of dead-lettered task %s", letter.task_id)

    def get(self, task_id: str) -> DeadLetter | None:
        data = self._redis("hget", self.keys[0], task_id)
        return DeadLetter.decode(data) if data is not None else None

    def list(self, limit: int = 100) -> list[DeadLetter]:
        """The most recent ``limit`` dead letters, newest first."""
        ids = self._redis("zrevrange", self.keys[1], 0, limit - 1)
        if not ids:
            return []
        return [DeadLetter.decode(d) for d in self._redis("hmget", self.keys[0], ids) if d is not None]

    def find(self, task: str | None = None, reason: str | None = None, limit: int = 100,
             budget: int = 5_000) -> builtins.list[DeadLetter]:
        """The newest ``limit`` dead letters of task name ``task`` whose reason contains ``reason``
        (None: any), among the newest ``budget`` letters; a damaged record is shown as one whose
        reason says so."""
        found = []
        for letter in itertools.islice(self._newest(), budget):
            if letter.matches(task, reason):
                found.append(letter)
                if len(found) == limit:
                    break
        return found

    def matching(self, task: str | None = None, reason: str | None = None) -> builtins.list[str]:
        """The task ids of every dead letter :meth:`find` would select (the whole queue is read, in
        chunks: it holds at most ``delayed_dlq_max_entries``)."""
        return [letter.task_id for letter in self._newest() if letter.matches(task, reason)]

    def _newest(self) -> Iterator[DeadLetter]:
        """Every dead letter, newest first, :data:`REQUEUE_CHUNK` per round trip.

        Each page starts after the last letter seen (its time, then its id: the index's order),
        not at a position, so letters requeued, purged or parked meanwhile make it skip none."""
        last: tuple[float, bytes] | None = None
        tied = 0  # letters seen at the last one's time: read again, and dropped
        while True:
            asked = REQUEUE_CHUNK + tied
            page = self._redis("zrevrangebyscore", self.keys[1], "+inf" if last is None else last[0], "-inf",
                                start=0, num=asked, withscores=True)
            fresh = [(task_id, ms) for task_id, ms in page if last is None or (ms, task_id) < last]
            ids = [task_id for task_id, _ in fresh]
            for raw_id, data in zip(ids, self._redis("hmget", self.keys[0], ids) if ids else []):
                if data is None:  # purged between the two reads
                    continue
                try:
                    yield DeadLetter.decode(data)
                except DeadLetterError as exc:
                    yield DeadLetter(task_id=raw_id.decode(), reason=str(exc), source="?")
            if len(page) < asked or not fresh:
                return
            ms = fresh[-1][1]
            tied = (tied if last is not None and last[0] == ms else 0) + sum(m == ms for _, m in fresh)
            last = (ms, fresh[-1][0])

    def holds(self, task_id: str) -> bool:
        """Whether a dead letter of ``task_id`` is parked (its record is not read)."""
        return bool(self._redis("hexists", self.keys[0], task_id))

    def count(self) -> int:
        return self._redis("zcard", self.keys[1])

    def oldest_age(self) -> float | None:
        """Seconds since the oldest dead letter was parked (by Redis' clock); None when there is none."""
        oldest = self._redis("zrange", self.keys[1], 0, 0, withscores=True)
        return max(0.0, (self.store.now_ms() - oldest[0][1]) / 1000) if oldest else None

    def _redis(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """``command`` of the store's Redis, its errors the store's (:meth:`.DelayedStore._unchecked`)."""
        return self.store._call_redis(getattr(self.store.redis, command), *args, **kwargs)

    # -- requeue -------------------------------------------------------------
    def requeue(self, task_id: str, backend: ResultBackend | None = None) -> bool:
        """Send a dead letter back through the store, due now, under the same task id.

        Returns False when there is no such dead letter.  Raises
        :class:`DeadLetterError`, leaving the record in place, when its message
        is not an envelope of that task.  ``backend``: the app's result backend,
        whose stored result of the task is forgotten so the rerun is not skipped;
        the task's done and revoked records are dropped for the same reason.
        """
        data = self._redis("hget", self.keys[0], task_id)
        if data is None:
            return False
        self._send_back([(task_id, data, *_requeueable(task_id, data))], self.store.now_ms(), backend)
        return True

    def requeue_all(self, backend: ResultBackend | None = None,
                    report: Callable[[str, DeadLetterError | None], None] | None = None) -> int:
        """Requeue every dead letter parked before this call, oldest first; returns how many.

        Records that cannot be requeued stay in the queue; ``report`` is told of
        each task id with None (requeued) or the error that kept it.
        """
        now_ms = self.store.now_ms()
        requeued = kept = 0
        while ids := self._parked_before(now_ms, skip=kept):
            batch: builtins.list[tuple[str, bytes, bytes, int]] = []
            outcomes: builtins.list[tuple[str, DeadLetterError | None]] = []
            raw_id: bytes
            for raw_id, data in zip(ids, self._redis("hmget", self.keys[0], ids)):
                task_id = raw_id.decode()
                try:
                    batch.append((task_id, data, *_requeueable(task_id, data)))
                    outcomes.append((task_id, None))
                except DeadLetterError as exc:
                    kept += 1
                    outcomes.append((task_id, exc))
            self._send_back(batch, now_ms, backend)
            requeued += len(batch)
            if report:
                for task_id, error in outcomes:
                    report(task_id, error)
        return requeued

    def _parked_before(self, ms: int, skip: int) -> builtins.list[bytes]:
        """Up to :data:`REQUEUE_CHUNK` task ids parked no later than ``ms``, oldest first, after ``skip``."""
        return self._redis("zrange", self.keys[1], "-inf", ms, byscore=True, offset=skip, num=REQUEUE_CHUNK)

    def _send_back(self, records: builtins.list[tuple[str, bytes, bytes, int]], now_ms: int,
                   backend: ResultBackend | None) -> None:
        """Forget results, schedule ``(task_id, record, envelope, attempt)`` due now, then drop the records.

        Results go first: once scheduled, a poller and a worker may run the task
        at once, and forgetting after that could drop the new result.  Each task
        is stored as the attempt its message is (Celery's ``retries``), which
        replaces a copy of that attempt still in flight: stored as a first
        attempt, it would be kept out by that copy, which the ack of its
        dispatch (a poller stalled since) then removes, the task nowhere.
        Records go last, so a crash in between runs a task twice but never
        loses it; a record replaced meanwhile (the rerun failed again) is kept.
        """
        if not records:
            return
        for task_id, *_ in records:
            _forget(backend, task_id)
        forget_run_records(self.store, [task_id for task_id, *_ in records])
        for attempt in sorted({attempt for *_, attempt in records}):
            self.store.schedule_many([(task_id, now_ms, envelope) for task_id, _, envelope, a in records
                                      if a == attempt], attempt=attempt)
        pipe = self.store.redis.pipeline(transaction=False)
        for task_id, record, *_ in records:
            self._scripts["remove_dead_letter"](keys=self.keys, args=[task_id, record], client=pipe)
        self.store.execute(pipe)

    # -- purge ---------------------------------------------------------------
    def purge(self, task_id: str) -> bool:
        """Drop one dead letter for good; False when there was none."""
        return self.store._call("remove_dead_letter", self.keys, [task_id]) == 1

    def purge_all(self) -> int:
        """Drop every dead letter (UNLINK: freed in the background); returns how many there were."""
        return self.store._call("purge_dead_letters", self.keys, [])


def _requeueable(task_id: str, data: bytes | None) -> tuple[bytes, int]:
    """The envelope bytes of a stored record and the attempt it is, or :class:`DeadLetterError`
    saying why it cannot run again."""
    if data is None:
        raise DeadLetterError(f"dead letter {task_id} is indexed but has no record (purge it)")
    try:
        message = DeadLetter.decode(data).message
    except DeadLetterError as exc:
        raise DeadLetterError(f"dead letter {task_id} cannot be requeued: {exc}") from None
    try:
        envelope = Envelope.decode(message)
    except EnvelopeError as exc:
        raise DeadLetterError(f"dead letter {task_id} cannot be requeued: "
                              f"its message is not a valid envelope ({exc})") from None
    if envelope.task_id != task_id:
        raise DeadLetterError(f"dead letter {task_id} cannot be requeued: its message is task {envelope.task_id}")
    return message, attempt_of(envelope.headers)


def _forget(backend: ResultBackend | None, task_id: str) -> None:
    """Drop the task's stored result, so a once-per-task-id check does not skip the rerun."""
    if backend is None:
        return
    with contextlib.suppress(NotImplementedError):  # the app has no result backend: nothing is stored
        backend.forget(task_id)
