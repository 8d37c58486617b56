"""Recurring schedules' definitions in the store, and the chain of their occurrences.

A definition is a value of the ``<prefix>:{p}:recurring`` HASH of its schedule id's partition: a line
of JSON, ``[version, pending ms, rule, origin]`` and, when not defaults, ``{options, paused, last ms}``
-- a version raised by every change, the nominal time of its one pending occurrence (an ordinary
scheduled task, :mod:`.occurrences`), the rule (:mod:`.rules` data), its origin (``beat`` for
``beat_schedule`` entries) -- then the message template, the envelope the client built, deflated as
stored tasks are (:func:`.envelope.deflate`).  Half the bytes of the first format, a JSON object with
the template in base64, which is still read (and rewritten in this one by the next change).

Every write is crash-safe and safe to race:

- :meth:`Definitions.put` compare-and-sets the definition (``lua/recurring_put.lua``) and, in the same
  step, marks the put as pending; then writes its pending occurrence, clears the mark, and cancels the
  previous one.  An occurrence is stored with its definition's version as its attempt number, so a
  newer definition's copy of an id replaces an older one's and never the reverse.  A put that stopped
  after its compare-and-set is completed by the next put of the same definition, by any poller's
  start (:meth:`Definitions.sync`), or by a running poller once its mark is old (:meth:`complete_puts`),
  which complete the marked ones only: it never writes a healthy
  schedule's occurrence again (that would supersede a copy another poller has in flight).
- :meth:`Definitions.advance_many` runs in the poller before a claim's occurrences are produced: it
  writes their successors (in bulk: a read of their definitions, a write of the successors, a
  pipeline of compare-and-sets), and the poller acks an occurrence only after Kafka has it, so a
  poller killed at any point either dispatches the occurrence again (one task id: it runs once) and
  writes the same successor again (one derived id: kept), or has written it already.
- An occurrence whose version is not its definition's (the schedule changed or was removed since
  it was written) is stale: dropped at dispatch, never run, no successor.  So a change racing a
  dispatch never leaves two chains: the old chain ends at its next occurrence.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from celery_delayed import inert
from celery_delayed.envelope import Envelope, EnvelopeError, deflate, inflate, stored_headers
from celery_delayed.recurring.occurrences import (NOMINAL_HEADER, RUN_NOW_VERSION, SCHEDULE_HEADER, VERSION_HEADER,
    occurrence, occurrence_id)
from celery_delayed.recurring.policy import Options, grace_ms
from celery_delayed.recurring.rules import Rule, rule_data, rule_from_data
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.layout import MAX_DUE_MS
from celery_delayed.store.outcomes import Change

logger = inert.logger(__name__)

#: The origin of the definitions ``beat_schedule`` made: the sync removes those no longer configured.
BEAT = "beat"
#: Definitions a :meth:`Definitions.page` asks each partition for at a time.
PAGE = 100
#: A schedule's options when none are given.
DEFAULTS = Options()
#: An occurrence :meth:`Definitions.advance_many` read: (index of its message, schedule id, version, nominal ms).
Due = tuple[int, str, Any, Any]
T = TypeVar("T")
#: A put of :meth:`Definitions.put_many`: (schedule id, template, rule, options).
Put = tuple[str, bytes, Rule, Options]


@dataclass(frozen=True)
class Definition:
    """One schedule: what runs (``template``), when (``rule``, plain data), how (``options``, the
    :class:`.Options` that are not defaults), whether it is paused, and its pending occurrence
    (``pending_ms``; None once its chain ended; while paused, the first time it missed).  ``last_ms``:
    the last occurrence dispatched to run, kept only for a schedule that must not overlap."""

    schedule_id: str
    rule: dict[str, Any]
    template: bytes
    origin: str
    version: int
    pending_ms: int | None
    options: dict[str, Any] = field(default_factory=dict)
    paused: bool = False
    last_ms: int | None = None
    #: (the template, as stored: deflated) when read from the store, so that :meth:`encode` of it or of a
    #: :func:`~dataclasses.replace` of it (the same template object) does not deflate it again
    stored_template: tuple[bytes, bytes] | None = field(default=None, compare=False, repr=False)

    @property
    def pending_id(self) -> str | None:
        """The task id of the pending occurrence."""
        return None if self.pending_ms is None else occurrence_id(self.schedule_id, self.pending_ms)

    @cached_property
    def parsed_options(self) -> Options:
        """:attr:`options` as :class:`.Options` (and :attr:`parsed_rule`, the rule): parsed once however
        often a poller's advance asks."""
        return Options.of(self.options) if self.options else DEFAULTS

    @cached_property
    def parsed_rule(self) -> Rule:
        return rule_from_data(self.rule)

    @cached_property
    def envelope(self) -> Envelope:
        """The template, decoded."""
        return Envelope.decode(self.template)

    @property
    def task_name(self) -> str:
        return self.envelope.task_name

    def describe(self) -> dict[str, Any]:
        """What an operator reads of it (``delayed schedules show``, ``--json``): plain data."""
        rule = (f"{self.rule['cron']} ({self.rule['tz']})" if "cron" in self.rule
                else f"every {self.rule['every_ms'] / 1000:g} s")
        return {"schedule_id": self.schedule_id, "task": self.task_name, "rule": rule, "origin": self.origin,
                "version": self.version, "paused": self.paused, "next_ms": self.pending_ms,
                "next_id": self.pending_id, "options": self.options, "last_ms": self.last_ms}

    def encode(self) -> bytes:
        extra = {name: value for name, value in (("options", self.options), ("paused", self.paused),
                                                 ("last_ms", self.last_ms)) if value}
        head = [self.version, self.pending_ms, self.rule, self.origin, *([extra] if extra else [])]
        stored = self.stored_template
        deflated = stored[1] if stored is not None and stored[0] is self.template else deflate(self.template, 0)
        return json.dumps(head, separators=(",", ":")).encode() + b"\n" + deflated

    @classmethod
    def decode(cls, schedule_id: str, data: bytes) -> Definition:
        """The stored definition, its rule, options and template read through (either format):
        :class:`UnreadableDefinition` when any of them cannot be (corrupt, a field missing or of another
        type)."""
        try:
            stored = None
            if data[:1] == b"{":  # the first format: one JSON object, the template in base64
                fields = json.loads(data)
                template = base64.b64decode(fields.pop("template"), validate=True)
            else:
                head, _, deflated = data.partition(b"\n")
                version, pending_ms, rule, origin, *extra = json.loads(head)
                fields = {"version": version, "pending_ms": pending_ms, "rule": rule, "origin": origin,
                          **(extra[0] if extra else {})}
                template = inflate(deflated)
                stored = (template, deflated)
            held = cls(schedule_id, fields["rule"], template, fields["origin"], fields["version"],
                       fields["pending_ms"], fields.get("options", {}), fields.get("paused", False),
                       fields.get("last_ms"), stored)
            if not (type(held.version) is int and isinstance(held.origin, str) and isinstance(held.paused, bool)
                    and all(ms is None or (type(ms) is int and 0 <= ms < MAX_DUE_MS)
                            for ms in (held.pending_ms, held.last_ms))):
                raise TypeError("version, origin, paused, pending_ms or last_ms of another type or range")
            held.parsed_rule, held.parsed_options, held.envelope  # noqa: B018 -- read through, once (cached)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnreadableDefinition(f"recurring schedule {schedule_id!r} is unreadable in the store "
                                       f"({type(exc).__name__}: {exc})") from None
        return held


class UnreadableDefinition(ValueError):
    """A stored definition that cannot be read: its occurrence is dead-lettered by the poller, lists
    leave it out (logged), and only :meth:`Definitions.remove` changes it."""


@dataclass(frozen=True)
class Advance:
    """What :meth:`Definitions.advance_many` decided for a claimed copy: whether it goes to Kafka, and what
    it counts, once per occurrence (by the copy that moved the chain on; a run-now one at each dispatch):
    ``fired``, sent to run; ``missed``, the schedule's times that never run; ``overlapped``, not run,
    the previous occurrence still running; ``stale``, dropped; ``fault``, why its schedule cannot
    advance (a corrupt definition or occurrence): the poller dead-letters that copy alone."""

    goes: bool
    fired: bool = False
    missed: int = 0
    overlapped: bool = False
    stale: bool = False
    fault: str | None = None


#: What :meth:`Definitions.advance_many` answers for a copy that is no occurrence of ours.
NOT_AN_OCCURRENCE = Advance(True)


class Definitions:
    """The recurring schedules of one store: read, put, pause, resume, run now, remove, list, sync; the
    poller's :meth:`advance_many`."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        self.grace_ms = grace_ms(store.settings)

    def get(self, schedule_id: str) -> Definition | None:
        """The definition of ``schedule_id`` (None: none); :class:`UnreadableDefinition` if it is corrupt."""
        return self.get_many([schedule_id])[0]

    def get_many(self, schedule_ids: Sequence[str]) -> list[Definition | None]:
        """The definitions of ``schedule_ids`` (None: no such schedule), in one round trip;
        :class:`UnreadableDefinition` if one is corrupt."""
        return [None if data is None else Definition.decode(schedule_id, data)
                for schedule_id, data in zip(schedule_ids, self._stored_many(schedule_ids))]

    def _stored_many(self, schedule_ids: Sequence[str]) -> list[bytes | None]:
        """The stored definitions of ``schedule_ids`` as they are (None: none), in one round trip."""
        by_key: dict[str, list[str]] = {}
        for schedule_id in schedule_ids:
            by_key.setdefault(self._key(schedule_id), []).append(schedule_id)
        pipe = self.store.redis.pipeline(transaction=False)
        for key, ids in by_key.items():
            pipe.hmget(key, ids)
        found = {schedule_id: data for ids, held in zip(by_key.values(), self.store.execute(pipe))
                 for schedule_id, data in zip(ids, held)}
        return [found[schedule_id] for schedule_id in schedule_ids]

    def all(self) -> list[Definition]:
        """Every readable definition, partition by partition (each unreadable one logged)."""
        pipe = self.store.redis.pipeline(transaction=False)
        for partition in range(self.store.settings.partitions):
            pipe.hgetall(self.store.keys.recurring(partition))
        return [definition for held in self.store.execute(pipe) for definition in _readable(held)]

    def page(self, prefix: str = "", cursor: str = "", count: int = PAGE) -> tuple[list[Definition], str]:
        """The definitions whose id starts with ``prefix``, a page at a time (``HSCAN``, partition by
        partition: never all at once): one page from ``cursor`` ('' first), and the cursor of the next
        ('' after the last).  A page holds about ``count``, in no order; one may be empty."""
        if count < 1:  # a page of none would never move the cursor on
            raise ValueError(f"a page of recurring schedules holds 1 or more, got {count}")
        partition, _, position = (cursor or "0:0").partition(":")
        if not (partition.isascii() and partition.isdigit() and position.isascii() and position.isdigit()
                and int(position) < 2**64):  # HSCAN's cursors are unsigned 64-bit
            raise ValueError(f"not a cursor of a list of recurring schedules: {cursor!r}")
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        found: list[Definition] = []
        p, at = int(partition), int(position)
        while p < self.store.settings.partitions and len(found) < count:
            at, held = self.store.redis.hscan(self.store.keys.recurring(p), at, match=pattern, count=count)
            found.extend(_readable(held))
            if at == 0:
                p += 1
        return found, "" if p >= self.store.settings.partitions else f"{p}:{at}"

    def put(self, schedule_id: str, template: bytes, rule: Rule, origin: str = "api",
            options: Options = DEFAULTS) -> Definition:
        """Create or change a schedule; returns its definition.  A change (rule, template, origin or
        options) raises its version and replaces its pending occurrence with the rule's next time from
        now (or from the schedule's start); putting what is stored changes nothing (pollers starting at
        once all put ``beat_schedule``).  A paused schedule stays paused.  ``ValueError`` when the
        schedule would end before its first time."""
        while True:
            (held, putting), = self._read_many([schedule_id])
            new = self._wanted(held, (schedule_id, template, rule, options), origin, self.store.now_ms)
            if new is held:
                if putting is not None:  # a put that stopped after its compare-and-set (or one since superseded)
                    self._write_pending([new] if putting == new.version else [])
                    self._clear_marks([(schedule_id, putting)])
                return new
            if self._compare_and_set(schedule_id, held.version if held else 0, new, pending=True):
                break
        self._write_pending([new])
        self._clear_marks([(schedule_id, new.version)])
        self._cancel_replaced([(held, new)])
        logger.info("recurring schedule %s: version %d, next at %s ms", schedule_id, new.version, new.pending_ms)
        return new

    def put_many(self, puts: Sequence[Put], now_ms: int, origin: str = "api") -> list[Definition]:
        """:meth:`put` of each of ``puts`` in order, with the first times from ``now_ms`` (each checked by
        :meth:`first_time` at it: none raises here), in bulk: one read of their definitions and marks,
        one pipeline of compare-and-sets (each marking its put), one write of the pending occurrences,
        one pipeline clearing the marks, one of cancels -- the steps of :meth:`put`, so a crash leaves
        each schedule as a crashed put leaves it.  A schedule put twice is put again after the first
        (a round of its own); a compare-and-set lost to another writer is done again by :meth:`put`."""
        found: list[Any] = [None] * len(puts)
        for round_ in _rounds(list(enumerate(puts)), lambda item: item[1][0]):
            for (index, _), definition in zip(round_, self._put_round([put for _, put in round_], now_ms, origin)):
                found[index] = definition
        return found

    def _put_round(self, puts: list[Put], now_ms: int, origin: str) -> list[Definition]:
        """:meth:`put_many` of puts of distinct schedules."""
        found: dict[str, Definition] = {}
        interrupted, marks, changes = [], [], []
        for put, (held, putting) in zip(puts, self._read_many([schedule_id for schedule_id, *_ in puts])):
            new = self._wanted(held, put, origin, lambda: now_ms)
            if new is held:
                if putting is not None:  # as in put: a put that stopped after its compare-and-set
                    interrupted.extend([new] if putting == new.version else [])
                    marks.append((new.schedule_id, putting))
                found[new.schedule_id] = new
            else:
                changes.append((held, new))
        won = self._compare_and_set_many([(held.version if held else 0, new) for held, new in changes], put=True)
        written = [(held, new) for held, new in changes if won[new.schedule_id]]
        self._write_pending(interrupted + [new for _, new in written])
        self._clear_marks(marks + [(new.schedule_id, new.version) for _, new in written])
        self._cancel_replaced(written)
        found.update((new.schedule_id, new) for _, new in written)
        for schedule_id, template, rule, options in puts:
            if schedule_id not in found:  # another writer changed it in between
                found[schedule_id] = self.put(schedule_id, template, rule, origin, options)
        logger.info("%d recurring schedule(s) put, %d changed", len(puts), len(written))
        return [found[schedule_id] for schedule_id, *_ in puts]

    def _wanted(self, held: Definition | None, put: Put, origin: str, now_ms: Callable[[], int]) -> Definition:
        """The definition ``put`` makes of ``held``: ``held`` itself when it already is it, else the next
        version, its first time from ``now_ms()`` (read only then)."""
        schedule_id, template, rule, options = put
        data, wanted = rule_data(rule), options.data()
        if held is not None and (held.rule, held.template, held.origin, held.options) == (data, template, origin,
                                                                                         wanted):
            return held
        return Definition(schedule_id, data, template, origin, held.version + 1 if held else 1,
                          self.first_time(schedule_id, rule, options, now_ms()), wanted,
                          held is not None and held.paused)

    @staticmethod
    def first_time(schedule_id: str, rule: Rule, options: Options, now_ms: int) -> int:
        """The first time of a chain of ``rule`` put at ``now_ms``; ``ValueError`` when the schedule ends
        before it, or it is beyond what the store holds."""
        first = options.first(rule, now_ms)
        if first is None:
            raise ValueError(f"recurring schedule {schedule_id} ends before its first time")
        if options.due_ms(schedule_id, first) >= MAX_DUE_MS:
            raise ValueError(f"recurring schedule {schedule_id} starts after 2106, beyond what the store holds")
        return first

    def remove(self, schedule_id: str) -> bool:
        """Delete a schedule and cancel its pending occurrence (one in flight is dropped as stale).  An
        unreadable one is deleted as it is (no writer can change it: their compare-and-set cannot read
        it either); its occurrence is then dropped as stale."""
        try:
            while (held := self.get(schedule_id)) is not None:
                if self._compare_and_set(schedule_id, held.version, None):
                    self._cancel_replaced([(held, None)])
                    logger.info("recurring schedule %s removed", schedule_id)
                    return True
        except UnreadableDefinition as exc:
            logger.warning("%s: removed as it is", exc)
            return bool(self.store.redis.hdel(self._key(schedule_id), schedule_id))
        return False

    def pause(self, schedule_id: str) -> Definition | None:
        """Stop running a schedule until :meth:`resume`: its pending occurrence is cancelled (one in
        flight is dropped as stale, or runs) and, when the cancel removed it, kept as the first time it
        misses.  The definition points past it until then, so a pause interrupted in between skips it
        rather than run it twice.  None when there is no such schedule."""
        while (held := self.get(schedule_id)) is not None and not held.paused:
            paused = replace(held, version=held.version + 1, paused=True,
                             pending_ms=None if held.pending_ms is None else self._next(held, held.pending_ms))
            if self._compare_and_set(schedule_id, held.version, paused):
                if held.pending_id is not None and self.store.cancel(held.pending_id) is Change.DONE:
                    kept = replace(paused, pending_ms=held.pending_ms)  # it never ran: the first missed
                    paused = kept if self._compare_and_set(schedule_id, paused.version, kept) else paused
                logger.info("recurring schedule %s paused", schedule_id)
                return paused
        return held

    def resume(self, schedule_id: str) -> Definition | None:
        """Run a paused schedule again: its pending occurrence is written again, at the first time it
        missed, and the poller dispatches it by the schedule's misfire policy.  None when there is none."""
        while (held := self.get(schedule_id)) is not None and held.paused:
            resumed = replace(held, version=held.version + 1, paused=False)
            if self._compare_and_set(schedule_id, held.version, resumed, pending=True):
                self._write_pending([resumed])
                self._clear_marks([(schedule_id, resumed.version)])
                logger.info("recurring schedule %s resumed, next at %s ms", schedule_id, resumed.pending_ms)
                return resumed
        if held is not None:
            self._write_pending([held])  # a resume that stopped after its compare-and-set, completed
        return held

    def run_now(self, schedule_id: str) -> str | None:
        """Run a schedule once more, now, out of its chain (paused or not); returns that run's task id
        (its own, derived from (schedule id, now): never one of the chain's).  None when there is none."""
        held = self.get(schedule_id)
        if held is None:
            return None
        now = self.store.now_ms()
        task_id, message = occurrence(held.envelope, schedule_id, RUN_NOW_VERSION, now,
                                      self.store.settings.compress_min_bytes)
        self.store.schedule(task_id, now, message)
        logger.info("recurring schedule %s: run now as task %s", schedule_id, task_id)
        return task_id

    def sync(self, entries: dict[str, tuple[bytes, Rule, Options]], origin: str = BEAT) -> None:
        """Make the schedules of ``origin`` be ``entries`` (schedule id -> template, rule, options): complete
        the puts that stopped after their compare-and-set (:meth:`complete_puts`), put each entry, and
        remove the others of that origin.  An entry that cannot be put (it ended, starts beyond the
        store's range) is logged and removed as one no longer configured, one whose stored copy is
        unreadable logged and left: the others are synced."""
        self.complete_puts()
        synced = set()
        for schedule_id, (template, rule, options) in entries.items():
            try:
                self.put(schedule_id, template, rule, origin, options)
                synced.add(schedule_id)
            except ValueError as exc:
                logger.error("%s: not run", exc)
        for held in self.all():
            if held.schedule_id not in synced and held.origin == origin:
                self.remove(held.schedule_id)

    def marks(self) -> dict[str, int]:
        """The marks of the puts whose pending occurrence is being written (``lua/recurring_put.lua``):
        schedule id -> version, in one round trip."""
        pipe = self.store.redis.pipeline(transaction=False)
        for partition in range(self.store.settings.partitions):
            pipe.hgetall(self.store.keys.recurring_putting(partition))
        return {schedule_id.decode(): int(version)
                for held in self.store.execute(pipe) for schedule_id, version in held.items()}

    def complete_puts(self, marks: dict[str, int] | None = None) -> int:
        """Write the pending occurrence of each put (or resume) that stopped after its compare-and-set,
        which marked it, and clear the marks; the other schedules are left alone.  ``marks``: only those
        (of :meth:`marks`), else all.  Returns how many occurrences were written."""
        if marks is None:
            marks = self.marks()
        if not marks:
            return 0
        stored = {schedule_id.encode(): data for schedule_id, data in zip(marks, self._stored_many(list(marks)))
                  if data is not None}
        interrupted = [held for held in _readable(stored)
                       if held.version == marks[held.schedule_id]]  # else a later write superseded it
        self._write_pending(interrupted)
        self._clear_marks(marks.items())
        logger.info("%d interrupted put(s) of recurring schedules completed", len(interrupted))
        return len(interrupted)

    def advance_many(self, messages: Sequence[bytes], now_ms: int) -> list[Advance]:
        """Before claimed copies of version-5 task ids are produced: for each that is an occurrence, write
        its successor and point its definition at it, then say whether it goes (:class:`Advance`, one per
        message, in order).  In bulk: one read of the definitions, one write of the successors, one
        pipeline of compare-and-sets (two occurrences of one schedule: one after the other).

        The successor is the rule's next time after the occurrence's nominal time, or after a later
        instant that the schedule's misfire policy chooses when the occurrence is late
        (:meth:`.Options.misfire_of`); none past the schedule's end; and it is not written when the
        chain already went past it (a copy dispatched again after a crash, while the chain caught up).
        An occurrence that does not go is acked unsent: a stale one (of another version than its
        definition's: the schedule changed, paused or removed since it was written; it has no
        successor), a missed one, or one that would overlap the previous run.  A run-now copy goes, out
        of the chain.  A store error is raised: the copies then stay in flight, and are claimed again
        after the visibility timeout."""
        found: list[Advance] = [NOT_AN_OCCURRENCE] * len(messages)
        waiting: list[Due] = []
        for index, message in enumerate(messages):
            try:  # the schedule's headers are never defaults a compact envelope leaves out
                headers = stored_headers(message)
            except EnvelopeError:
                continue  # not an occurrence of ours: the poller's routing parks it
            schedule_id = headers.get(SCHEDULE_HEADER)
            if schedule_id is None:
                continue
            if headers.get(VERSION_HEADER) == RUN_NOW_VERSION:
                found[index] = Advance(True, fired=True)
            else:
                waiting.append((index, schedule_id, headers.get(VERSION_HEADER), headers.get(NOMINAL_HEADER)))
        for now in _rounds(waiting, lambda item: item[1]):  # a schedule's second occurrence waits for the chain
            for (index, *_), advance in zip(now, self._advance_round(now, now_ms)):  # its first moved
                found[index] = advance
        return found

    def _advance_round(self, occurrences: list[Due], now_ms: int) -> list[Advance]:
        """:meth:`advance_many` of occurrences of distinct schedules."""
        faults: dict[str, str] = {}  # schedule id -> why it cannot advance
        live, misfires = [], []
        for (_, schedule_id, version, nominal), data in zip(
                occurrences, self._stored_many([schedule_id for _, schedule_id, _, _ in occurrences])):
            try:
                held = None if data is None else Definition.decode(schedule_id, data)
                if held is not None and held.version == version:
                    misfires.append(held.parsed_options.misfire_of(held.parsed_rule, schedule_id, nominal, now_ms,
                                                                   self.grace_ms))
                    live.append((held, nominal))
            except Exception as exc:  # whatever one occurrence or definition holds, only its copy is parked
                faults[schedule_id] = f"its recurring schedule cannot advance: {type(exc).__name__}: {exc}"
        # the last run being this very occurrence is a copy dispatched again (its poller died after the
        # advance, before Kafka had it): it overlaps nothing, and goes (a worker runs one task id once)
        running = self._running([held for (held, nominal), misfire in zip(live, misfires)
                                 if misfire.runs and not held.parsed_options.overlap and held.last_ms != nominal],
                                now_ms)
        steps = {}  # schedule id -> (held, successor, runs, overlapped, misfire, whether it moves the chain)
        for (held, nominal), misfire in zip(live, misfires):
            overlapped = held.schedule_id in running
            runs = misfire.runs and not overlapped
            successor = replace(held, pending_ms=self._next(held, misfire.after_ms),
                                last_ms=nominal if runs and not held.parsed_options.overlap else held.last_ms)
            # not when the chain went past it: a copy dispatched again after a crash
            moves = successor.pending_ms is None or held.pending_ms is None or successor.pending_ms >= held.pending_ms
            steps[held.schedule_id] = (held, successor, runs, overlapped, misfire, moves)
        moving = [(held, successor) for held, successor, _, _, _, moves in steps.values() if moves]
        self._write_pending([successor for _, successor in moving])
        advanced = self._compare_and_set_many([(held.version, successor) for held, successor in moving], put=False)
        results = []
        for _, schedule_id, version, nominal in occurrences:
            if schedule_id in faults:
                results.append(Advance(False, fault=faults[schedule_id]))
                continue
            if schedule_id not in steps:
                logger.info("occurrence at %s ms of recurring schedule %s (version %s) is stale: dropped, not run",
                            nominal, schedule_id, version)
                results.append(Advance(False, stale=True))
                continue
            held, successor, runs, overlapped, misfire, _ = steps[schedule_id]
            moved = advanced.get(schedule_id, False)  # whether this copy moved the chain on: counted once
            if moved and (misfire.missed or overlapped):
                logger.info("recurring schedule %s: occurrence at %d ms %s, %d time(s) missed, next at %s ms",
                            schedule_id, nominal, "runs" if runs else "does not run", misfire.missed,
                            successor.pending_ms)
            results.append(Advance(runs, fired=runs and moved, missed=misfire.missed if moved else 0,
                                   overlapped=overlapped and moved))
        return results

    def _running(self, helds: list[Definition], now_ms: int) -> set[str]:
        """The schedules (of ``helds``) whose last occurrence dispatched to run may still be running: a
        worker holds its run claim, or it did not finish (no finished record) and was due less than the
        grace ago (on its way to a worker, or waiting for one).  One round trip."""
        lasts = [(held.schedule_id, held.last_ms) for held in helds if held.last_ms is not None]
        if not lasts:
            return set()
        pipe, keys = self.store.redis.pipeline(transaction=False), self.store.keys
        for schedule_id, last_ms in lasts:
            task_id = occurrence_id(schedule_id, last_ms)
            pipe.exists(keys.run(task_id))
            pipe.exists(keys.done(task_id))
        replies = self.store.execute(pipe)
        return {schedule_id for (schedule_id, last_ms), claimed, done in zip(lasts, replies[::2], replies[1::2])
                if claimed or (now_ms - last_ms < self.grace_ms and not done)}

    def _next(self, held: Definition, after_ms: int) -> int | None:
        """The schedule's next time after ``after_ms``; None past its end, for a crontab with no time
        for years, or for a time the store cannot hold (after 2106): its chain ends."""
        try:
            at = held.parsed_options.within(held.parsed_rule.next_after(after_ms))
            if at is not None and held.parsed_options.due_ms(held.schedule_id, at) >= MAX_DUE_MS:
                raise ValueError(f"its next time ({at} ms) is after 2106, beyond what the store holds")
            return at
        except ValueError as exc:
            logger.error("recurring schedule %s ends: %s", held.schedule_id, exc)
            return None

    def _cancel_replaced(self, replaced: Iterable[tuple[Definition | None, Definition | None]]) -> None:
        """For each ``(held, new)``: cancel ``held``'s pending occurrence unless ``new`` has it (a copy in
        flight is dropped as stale), in one pipeline."""
        stale = [held.pending_id for held, new in replaced if held is not None and held.pending_id is not None
                 and (new is None or held.pending_id != new.pending_id)]
        if stale:
            self.store.cancel_many(stale)

    def _write_pending(self, definitions: Iterable[Definition]) -> None:
        """Store the pending occurrence of each of ``definitions`` that has one and is not paused (kept if
        it is there; a copy of an older version, or one in flight, is replaced), in bulk."""
        compress = self.store.settings.compress_min_bytes
        items, attempts = [], []
        for definition in definitions:
            if definition.pending_ms is None or definition.paused:
                continue
            task_id, message = occurrence(definition.envelope, definition.schedule_id, definition.version,
                                          definition.pending_ms, compress)
            items.append((task_id, definition.parsed_options.due_ms(definition.schedule_id, definition.pending_ms),
                          message, definition.envelope.queue))
            attempts.append(definition.version)
        if items:
            self.store.schedule_attempts(items, attempts)

    def _read_many(self, schedule_ids: Sequence[str]) -> list[tuple[Definition | None, int | None]]:
        """Each schedule's definition, and the version of its put still pending (:meth:`complete_puts`),
        if any, in one round trip."""
        by_partition: dict[int, list[str]] = {}
        for schedule_id in schedule_ids:
            by_partition.setdefault(self.store.partition(schedule_id), []).append(schedule_id)
        pipe = self.store.redis.pipeline(transaction=False)
        for partition, ids in by_partition.items():
            pipe.hmget(self.store.keys.recurring(partition), ids)
            pipe.hmget(self.store.keys.recurring_putting(partition), ids)
        replies = self.store.execute(pipe)
        found = {schedule_id: (None if data is None else Definition.decode(schedule_id, data),
                               None if putting is None else int(putting))
                 for ids, held, marks in zip(by_partition.values(), replies[::2], replies[1::2])
                 for schedule_id, data, putting in zip(ids, held, marks)}
        return [found[schedule_id] for schedule_id in schedule_ids]

    def _clear_marks(self, marks: Iterable[tuple[str, int]]) -> None:
        """Clear the pending-put marks ``(schedule id, version)`` whose occurrence is written
        (``lua/recurring_put_done.lua``), each unless a later put marked its schedule again."""
        by_partition: dict[int, list[Any]] = {}
        for schedule_id, version in marks:
            by_partition.setdefault(self.store.partition(schedule_id), []).extend((schedule_id, version))
        pipe = self.store.redis.pipeline(transaction=False)
        for partition, args in by_partition.items():
            self.store.scripts["recurring_put_done"](keys=[self.store.keys.recurring_putting(partition)], args=args,
                                                     client=pipe)
        self.store.execute(pipe)

    def _compare_and_set(self, schedule_id: str, version: int, new: Definition | None, pending: bool = False) -> bool:
        """Write ``new`` (None: delete) if the stored definition is at ``version`` (0: none); ``pending``:
        and mark the put as pending until its occurrence is written (:meth:`_clear_marks`)."""
        partition = self.store.partition(schedule_id)
        return bool(self.store.scripts["recurring_put"](
            keys=[self.store.keys.recurring(partition), self.store.keys.recurring_putting(partition)],
            args=[schedule_id, version, new.encode() if new else "", "", new.version if new and pending else ""]))

    def _compare_and_set_many(self, changes: list[tuple[int, Definition]], put: bool) -> dict[str, bool]:
        """Write each ``(version read, new)`` if the stored definition is at that version, in one pipeline;
        schedule id -> whether written.  ``put``: and mark each put as pending (as :meth:`_compare_and_set`
        with ``pending``); else each advances a chain: only if it moves its pending occurrence later (or
        ends the chain)."""
        if not changes:
            return {}
        pipe, keys = self.store.redis.pipeline(transaction=False), self.store.keys
        for version, new in changes:
            partition = self.store.partition(new.schedule_id)
            self.store.scripts["recurring_put"](keys=[keys.recurring(partition), keys.recurring_putting(partition)],
                                                args=[new.schedule_id, version, new.encode(), "" if put else "1",
                                                      new.version if put else ""], client=pipe)
        return {new.schedule_id: bool(done) for (_, new), done in zip(changes, self.store.execute(pipe))}

    def _key(self, schedule_id: str) -> str:
        return self.store.keys.recurring(self.store.partition(schedule_id))


def _rounds(items: list[T], schedule_of: Callable[[T], str]) -> Iterator[list[T]]:
    """``items`` in rounds of distinct schedules (``schedule_of(item)``), in order: a schedule's second
    item goes in the round after its first (which the caller writes before reading the next round)."""
    while items:
        now: list[T] = []
        later: list[T] = []
        seen = set()
        for item in items:
            (later if schedule_of(item) in seen else now).append(item)
            seen.add(schedule_of(item))
        yield now
        items = later


def _readable(held: dict[bytes, bytes]) -> Iterator[Definition]:
    """The definitions of ``held`` (schedule id -> stored JSON) that can be read; each other one is
    logged in one line and left as it is (``delayed schedules remove`` deletes it)."""
    for schedule_id, data in held.items():
        try:
            yield Definition.decode(schedule_id.decode(), data)
        except UnreadableDefinition as exc:
            logger.error("%s: left out", exc)
