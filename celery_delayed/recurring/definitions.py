"""Recurring schedules' definitions in the store, and the chain of their occurrences.

A definition is JSON in the ``<prefix>:{p}:recurring`` HASH of its schedule id's partition: the rule
(:mod:`.rules` data), the message template (the stored form the client built, base64), its origin
(``beat`` for ``beat_schedule`` entries), a version raised by every change, and the nominal time of
its one pending occurrence (an ordinary scheduled task, :mod:`.occurrences`).

Every write is crash-safe and safe to race:

- :meth:`Definitions.put` compare-and-sets the definition (``lua/recurring_put.lua``), then writes its
  pending occurrence, then cancels the previous one.  An occurrence is stored with its definition's
  version as its attempt number, so a newer definition's copy of an id replaces an older one's and
  never the reverse.  A put that stopped after its compare-and-set is completed by the next put of
  the same definition, or by any poller's start (:meth:`Definitions.sync`).
- :meth:`Definitions.advance` runs in the poller before an occurrence is produced: it writes the
  successor, and the poller acks the occurrence only after Kafka has it, so a poller killed at any
  point either dispatches the occurrence again (one task id: it runs once) and writes the same
  successor again (one derived id: kept), or has written it already.
- An occurrence whose version is not its definition's (the schedule changed or was removed since
  it was written) is stale: dropped at dispatch, never run, no successor.  So a change racing a
  dispatch never leaves two chains: the old chain ends at its next occurrence.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace
from typing import Any

from celery_delayed import inert
from celery_delayed.envelope import Envelope, EnvelopeError
from celery_delayed.recurring.occurrences import (NOMINAL_HEADER, SCHEDULE_HEADER, VERSION_HEADER, occurrence,
    occurrence_id)
from celery_delayed.recurring.rules import Rule, rule_data, rule_from_data
from celery_delayed.store.delayed import DelayedStore

logger = inert.logger(__name__)

#: The origin of the definitions ``beat_schedule`` made: the sync removes those no longer configured.
BEAT = "beat"


@dataclass(frozen=True)
class Definition:
    """One schedule: what runs (``template``), when (``rule``, plain data), and its pending occurrence."""

    schedule_id: str
    rule: dict[str, Any]
    template: bytes
    origin: str
    version: int
    pending_ms: int

    @property
    def pending_id(self) -> str:
        """The task id of the pending occurrence."""
        return occurrence_id(self.schedule_id, self.pending_ms)

    @property
    def task_name(self) -> str:
        return Envelope.decode(self.template).task_name

    def encode(self) -> str:
        return json.dumps({"rule": self.rule, "template": base64.b64encode(self.template).decode(),
                           "origin": self.origin, "version": self.version, "pending_ms": self.pending_ms},
                          separators=(",", ":"))

    @classmethod
    def decode(cls, schedule_id: str, data: bytes) -> Definition:
        fields = json.loads(data)
        return cls(schedule_id, fields["rule"], base64.b64decode(fields["template"]), fields["origin"],
                   fields["version"], fields["pending_ms"])


class Definitions:
    """The recurring schedules of one store: read, put, remove, sync; the poller's :meth:`advance`."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store

    def get(self, schedule_id: str) -> Definition | None:
        data = self.store.redis.hget(self._key(schedule_id), schedule_id)
        return None if data is None else Definition.decode(schedule_id, data)

    def all(self) -> list[Definition]:
        """Every definition, partition by partition."""
        pipe = self.store.redis.pipeline(transaction=False)
        for partition in range(self.store.settings.partitions):
            pipe.hgetall(self.store.keys.recurring(partition))
        return [Definition.decode(schedule_id.decode(), data)
                for held in self.store.execute(pipe) for schedule_id, data in held.items()]

    def put(self, schedule_id: str, template: bytes, rule: Rule, origin: str = "api") -> Definition:
        """Create or change a schedule; returns its definition.  A change (rule, template or origin)
        raises its version and replaces its pending occurrence with the rule's next time from now;
        putting what is stored changes nothing (pollers starting at once all put ``beat_schedule``)."""
        data = rule_data(rule)
        while True:
            held = self.get(schedule_id)
            if held is not None and (held.rule, held.template, held.origin) == (data, template, origin):
                self._write_pending(held)  # a put that stopped after its compare-and-set, completed
                return held
            new = Definition(schedule_id, data, template, origin, held.version + 1 if held else 1,
                             rule.next_after(self.store.now_ms()))
            if self._compare_and_set(schedule_id, held.version if held else 0, new):
                break
        self._write_pending(new)
        if held is not None and held.pending_id != new.pending_id:  # a copy in flight is dropped as stale
            self.store.cancel(held.pending_id)
        logger.info("recurring schedule %s: version %d, next at %d ms", schedule_id, new.version, new.pending_ms)
        return new

    def remove(self, schedule_id: str) -> bool:
        """Delete a schedule and cancel its pending occurrence (one in flight is dropped as stale)."""
        while (held := self.get(schedule_id)) is not None:
            if self._compare_and_set(schedule_id, held.version, None):
                self.store.cancel(held.pending_id)
                logger.info("recurring schedule %s removed", schedule_id)
                return True
        return False

    def sync(self, entries: dict[str, tuple[bytes, Rule]], origin: str = BEAT) -> None:
        """Make the schedules of ``origin`` be ``entries`` (schedule id -> template, rule): put each,
        remove the others of that origin, and write every other schedule's pending occurrence again
        (harmless: derived ids), which completes a put that stopped after its compare-and-set."""
        for schedule_id, (template, rule) in entries.items():
            self.put(schedule_id, template, rule, origin)
        for held in self.all():
            if held.schedule_id in entries:
                continue
            if held.origin == origin:
                self.remove(held.schedule_id)
            else:
                self._write_pending(held)

    def advance(self, message: bytes, now_ms: int) -> bool:
        """Before a claimed copy of a version-5 task id is produced: if it is an occurrence, write its
        successor (the rule's next time after its nominal time, or after ``now_ms`` when it is late:
        missed times are skipped) and point its definition at it.  False when it is a stale occurrence
        (not to be produced: it never runs, and has no successor); True for everything else.  A store
        error is raised: the copy then stays in flight, and is claimed again after the visibility timeout."""
        try:
            headers = Envelope.decode(message).headers
        except EnvelopeError:
            return True  # not an occurrence of ours: the poller's routing parks it
        schedule_id = headers.get(SCHEDULE_HEADER)
        if schedule_id is None:
            return True
        held = self.get(schedule_id)
        if held is None or held.version != headers.get(VERSION_HEADER):
            logger.info("occurrence %s of recurring schedule %s (version %s) is stale: dropped, not run",
                        headers.get("id"), schedule_id, headers.get(VERSION_HEADER))
            return False
        try:
            successor = replace(held, pending_ms=rule_from_data(held.rule).next_after(max(headers[NOMINAL_HEADER],
                                                                                          now_ms)))
        except ValueError as exc:  # a crontab with no time for years: this occurrence is its last
            logger.error("recurring schedule %s ends: %s", schedule_id, exc)
            return True
        self._write_pending(successor)
        self._compare_and_set(schedule_id, held.version, successor, forward=True)
        return True

    def _write_pending(self, definition: Definition) -> None:
        """Store the pending occurrence of ``definition`` (kept if it is there; a copy of an older
        version, or one in flight, is replaced)."""
        task_id, message = occurrence(Envelope.decode(definition.template), definition.schedule_id,
                                      definition.version, definition.pending_ms, self.store.settings.compress_min_bytes)
        self.store.schedule(task_id, definition.pending_ms, message, attempt=definition.version)

    def _compare_and_set(self, schedule_id: str, version: int, new: Definition | None, forward: bool = False) -> bool:
        """Write ``new`` (None: delete) if the stored definition is at ``version`` (0: none), and with
        ``forward`` only if it moves the pending occurrence later."""
        return bool(self.store.scripts["recurring_put"](keys=[self._key(schedule_id)],
                                                        args=[schedule_id, version, new.encode() if new else "",
                                                              "1" if forward else ""]))

    def _key(self, schedule_id: str) -> str:
        return self.store.keys.recurring(self.store.partition(schedule_id))
