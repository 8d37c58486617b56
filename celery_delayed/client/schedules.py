"""Recurring schedules from signatures: :class:`Schedules` (create, change, remove them at run time) and
:func:`beat_entries` (the app's ``beat_schedule``, which ``celery -A proj delayed poller`` syncs at start).

A schedule's message template is what ``apply_async`` builds for its signature (headers, routing,
serializer, body), captured in a :class:`.Batch` that is never written; :mod:`celery_delayed.recurring`
keeps it and derives each occurrence from it.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import Celery
from celery.canvas import Signature

from celery_delayed import inert
from celery_delayed.client.batch import Batch, batching
from celery_delayed.client.bulk import results_subscribed_on_get
from celery_delayed.client.intercept import DelayedAMQP
from celery_delayed.envelope import KEY_HEADER, Envelope
from celery_delayed.recurring.definitions import Definition, Definitions
from celery_delayed.recurring.occurrences import TEMPLATE_ID
from celery_delayed.recurring.rules import Rule, rule_of

logger = inert.logger(__name__)

#: The ETA a template is built with: far enough to go to the store whatever ``delayed_min_delay`` is.
TEMPLATE_ETA = datetime(2100, 1, 1, tzinfo=timezone.utc)
#: The schedule id of ``beat_schedule`` entry ``<name>``.
BEAT_PREFIX = "beat:"


class Schedules:
    """The recurring schedules of ``app`` (on which ``celery_delayed.install`` was called), kept in its store."""

    def __init__(self, app: Celery) -> None:
        if not isinstance(app.amqp, DelayedAMQP):
            raise RuntimeError("celery_delayed.install(app) was not called on this app")
        self.app = app
        self.definitions = Definitions(app.amqp.delayed_store)

    def upsert(self, schedule_id: str, signature: Signature, schedule: Any, tz: str | None = None) -> Definition:
        """Run ``signature`` by ``schedule`` (a ``crontab``, evaluated in ``tz``, default the app's
        ``timezone``; a ``schedule``, ``timedelta`` or seconds, from the epoch), from its next time on.
        Changing a schedule replaces its pending occurrence; the same again changes nothing."""
        return self.definitions.put(schedule_id, template_of(self.app, signature),
                                    rule_of(schedule, tz or zone_of(self.app)))

    def remove(self, schedule_id: str) -> bool:
        """Stop a schedule: its pending occurrence never runs.  False when there was none."""
        return self.definitions.remove(schedule_id)

    def get(self, schedule_id: str) -> Definition | None:
        return self.definitions.get(schedule_id)

    def all(self) -> list[Definition]:
        return self.definitions.all()


def zone_of(app: Celery) -> str:
    """The zone crontabs are read in: the app's ``timezone`` (UTC by default, as ``celery beat``)."""
    return str(app.conf.timezone or "UTC")


def template_of(app: Celery, signature: Signature) -> bytes:
    """The stored message ``signature.apply_async`` builds (task id :data:`TEMPLATE_ID`), written nowhere,
    without what differs from one process to another (``origin``, ``reply_to``) or belongs to the caller
    (``parent_id``), so every process builds the same template for one signature.

    Refused (``ValueError``): a canvas (its members' ids would be the same in every occurrence), a
    replace-by-key header, and ``expires`` (it would be fixed at the template's time, not each run's).
    """
    if type(signature) is not Signature:
        raise ValueError(f"a recurring schedule runs one task's signature, not a {type(signature).__name__}")
    if KEY_HEADER in (signature.options.get("headers") or {}) or signature.options.get("expires") is not None:
        raise ValueError(f"recurring schedules do not support {KEY_HEADER} nor expires (yet): {signature!r}")
    batch = Batch(app, [])
    token = batching.set(batch)
    try:
        with results_subscribed_on_get(app):
            signature.apply_async(eta=TEMPLATE_ETA, countdown=None, task_id=TEMPLATE_ID)
    finally:
        batching.reset(token)
    if len(batch.items) != 1:
        raise ValueError(f"{signature!r} did not build one delayed message (is celery_delayed installed?)")
    template = Envelope.decode(batch.items[0][2])
    template.headers.pop("origin", None)
    template.headers.update(root_id=TEMPLATE_ID, parent_id=None)
    template.properties.pop("reply_to", None)
    return template.encode()


def beat_entries(app: Celery) -> dict[str, tuple[bytes, Rule]]:
    """The recurring schedules of the app's ``beat_schedule`` (schedule id ``beat:<name>`` -> template,
    rule), as ``celery beat`` would send each entry (``task``, ``args``, ``kwargs``, ``options``).  An
    entry that cannot be one (a ``solar`` schedule, ``expires``...) is logged and left out."""
    entries = {}
    for name, entry in (app.conf.beat_schedule or {}).items():
        try:
            signature = app.signature(entry["task"], args=entry.get("args", ()), kwargs=entry.get("kwargs", {}),
                                      options=entry.get("options", {}))
            entries[BEAT_PREFIX + name] = (template_of(app, signature), rule_of(entry["schedule"], zone_of(app)))
        except (KeyError, ValueError) as exc:
            logger.error("beat_schedule entry %r is not run: %s", name, exc)
    return entries
