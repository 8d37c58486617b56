"""Recurring schedules from signatures: :class:`Schedules` (create, change, remove them at run time) and
:func:`beat_entries` (the app's ``beat_schedule``, which ``celery -A proj delayed poller`` syncs at start).

A schedule's message template is what ``apply_async`` builds for its signature (headers, routing,
serializer, body), captured in a :class:`.Batch` that is never written; :mod:`celery_delayed.recurring`
keeps it and derives each occurrence from it.
"""
from __future__ import annotations

import builtins
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import Celery
from celery.canvas import Signature

from celery_delayed import inert
from celery_delayed.client.batch import Batch, batching
from celery_delayed.client.bulk import read_chunk, results_subscribed_on_get
from celery_delayed.client.intercept import DelayedAMQP
from celery_delayed.client.template import Shapes
from celery_delayed.envelope import KEY_HEADER, Envelope
from celery_delayed.recurring.definitions import Definition, Definitions, Put
from celery_delayed.recurring.occurrences import TEMPLATE_ID
from celery_delayed.recurring.policy import Options
from celery_delayed.recurring.rules import Rule, rule_of

logger = inert.logger(__name__)

#: The ETA a template is built with: far enough to go to the store whatever ``delayed_min_delay`` is.
TEMPLATE_ETA = datetime(2100, 1, 1, tzinfo=timezone.utc)
TEMPLATE_DUE_MS = int(TEMPLATE_ETA.timestamp() * 1000)
#: The schedule id of ``beat_schedule`` entry ``<name>``.
BEAT_PREFIX = "beat:"
#: A schedule's options (:meth:`Schedules.upsert`'s keyword arguments), also read from a ``beat_schedule``
#: entry's keys or its ``options`` (where they are taken out, not sent to ``apply_async``).
OPTION_NAMES = ("start", "end", "jitter", "misfire", "catch_up", "overlap")
#: Items :meth:`Schedules.upsert_many` puts at once.
BATCH = 1000


class UpsertManyError(Exception):
    """:meth:`Schedules.upsert_many` stopped at an item it could not upsert, or at a failed store write.

    ``upserted`` is how many of the items, in order, were upserted before it; ``rest`` iterates over the
    others, from the one it stopped at.  ``upsert_many(error.rest)`` upserts them (an item already put
    is put again as the same: nothing changes, an interrupted put is completed).
    """

    def __init__(self, message: str, upserted: int, rest: Iterator[Any]) -> None:
        super().__init__(message)
        self.upserted = upserted
        self.rest = rest


class Schedules:
    """The recurring schedules of ``app`` (on which ``celery_delayed.install`` was called), kept in its store."""

    def __init__(self, app: Celery) -> None:
        if not isinstance(app.amqp, DelayedAMQP):
            raise RuntimeError("celery_delayed.install(app) was not called on this app")
        self.app = app
        self.definitions = Definitions(app.amqp.delayed_store)

    def upsert(self, schedule_id: str, signature: Signature, schedule: Any, tz: str | None = None,
               **options: Any) -> Definition:
        """Run ``signature`` by ``schedule`` (a ``crontab``, evaluated in ``tz``, default the app's
        ``timezone``; a ``schedule``, ``timedelta`` or seconds, from the epoch), from its next time on.
        Changing a schedule replaces its pending occurrence; the same again changes nothing.

        Options (:data:`OPTION_NAMES`, docs/recurring.md): ``start``, ``end`` (datetimes, naive ones in
        ``tz``, or seconds since the epoch), ``jitter`` (seconds or a timedelta: each occurrence is due
        up to that late, by a delay derived from its time), ``misfire`` (``"once"``, the default,
        ``"skip"``, ``"all"``), ``catch_up`` (the window ``"all"`` runs missed times within), ``overlap`` (False:
        skip an occurrence while the previous one runs).  A bad value raises ``ValueError``."""
        _, template, rule, parsed = self._put_of(schedule_id, signature, schedule, tz, options)
        return self.definitions.put(schedule_id, template, rule, options=parsed)

    def upsert_many(self, items: Iterable[Any], *, progress: Callable[[int], None] | None = None,
                    results: bool = False) -> builtins.list[Definition] | int:
        """:meth:`upsert` of each item, in order: ``(schedule_id, signature, schedule)``, or with a 4th, a
        dict of :meth:`upsert`'s keyword arguments (``tz`` and the options).  The same definitions and
        pending occurrences as :meth:`upsert` of each, written a batch (:data:`BATCH`) at a time in a few
        round trips, by the same crash-safe steps.  Returns how many were upserted: the client's memory
        stays flat whatever the number of items (a generator is read as it goes); ``results=True``:
        their definitions instead, in order.  ``progress`` gets the number upserted so far after each batch.

        Raises :class:`UpsertManyError` (its ``upserted`` and ``rest``) at an item :meth:`upsert` would
        refuse (its index and error in one line: the items before it upserted, it and the others not
        touched), a store write that failed (its batch's schedules each absent, whole, or completed by
        the next poller start or put), ``items`` raising as it is read (what it gave before upserted),
        or ``progress`` raising."""
        rest, count, done = iter(items), 0, []
        with self.app.producer_or_acquire() as producer:
            templates = Templates(self.app, producer)
            while True:
                chunk, broken = read_chunk(rest, BATCH)
                if not chunk:
                    break
                puts: builtins.list[Put] = []
                bad: Exception | None = None
                try:
                    for item in chunk:
                        puts.append(self._item(item, templates))
                except Exception as exc:  # whatever one item holds: those before it are upserted
                    bad = exc
                try:
                    now_ms = self.definitions.store.now_ms()
                    for at, (schedule_id, _, rule, options) in enumerate(puts):
                        try:
                            Definitions.first_time(schedule_id, rule, options, now_ms)
                        except ValueError as exc:
                            bad, puts = exc, puts[:at]
                            break
                    put = self.definitions.put_many(puts, now_ms)
                except Exception as exc:
                    raise UpsertManyError(f"stopped at items[{count}]: putting {len(puts)} schedules failed: "
                                          f"{type(exc).__name__}: {exc}", count,
                                          itertools.chain(chunk, rest)) from exc
                count += len(put)
                if results:
                    done.extend(put)
                if bad is not None:
                    raise UpsertManyError(f"items[{count}] ({_named(chunk[len(puts)])}): {type(bad).__name__}: "
                                          f"{bad}; the {count} before it upserted", count,
                                          itertools.chain(chunk[len(puts):], rest)) from bad
                if broken is not None:
                    raise UpsertManyError(f"stopped at items[{count}]: reading the items raised "
                                          f"{type(broken).__name__}: {broken}", count, iter(())) from broken
                if progress:
                    try:
                        progress(count)
                    except Exception as exc:  # the caller's: the count and the rest must not be lost with it
                        raise UpsertManyError(f"stopped after {count} items: the progress callback raised "
                                              f"{type(exc).__name__}: {exc}", count, rest) from exc
        return done if results else count

    def _item(self, item: Any, templates: Templates) -> Put:
        """The put of an :meth:`upsert_many` item."""
        if not isinstance(item, (tuple, builtins.list)) or len(item) not in (3, 4) or \
                (len(item) == 4 and not isinstance(item[3], dict)):
            raise ValueError("an item is (schedule_id, signature, schedule) or (schedule_id, signature, schedule, "
                             f"{{options}}), got {item!r:.200}")
        options = dict(item[3]) if len(item) == 4 else {}
        return self._put_of(item[0], item[1], item[2], options.pop("tz", None), options, templates)

    def _put_of(self, schedule_id: str, signature: Signature, schedule: Any, tz: str | None, options: dict[str, Any],
                templates: Templates | None = None) -> Put:
        """What :meth:`upsert`'s arguments put; ``ValueError`` if one is bad."""
        _check_id(schedule_id)
        zone = tz or zone_of(self.app)
        return (schedule_id, template_of(self.app, signature, templates), rule_of(schedule, zone),
                options_of(options, zone))

    def remove(self, schedule_id: str) -> bool:
        """Stop a schedule: its pending occurrence never runs.  False when there was none."""
        return self.definitions.remove(schedule_id)

    def pause(self, schedule_id: str) -> Definition | None:
        """Stop running a schedule until :meth:`resume` (its misfire policy says what then runs of the
        times it missed).  None when there is no such schedule."""
        return self.definitions.pause(schedule_id)

    def resume(self, schedule_id: str) -> Definition | None:
        """Run a paused schedule again.  None when there is no such schedule."""
        return self.definitions.resume(schedule_id)

    def run_now(self, schedule_id: str) -> str | None:
        """Run a schedule once now, besides its chain; returns that run's task id (None: no such schedule)."""
        return self.definitions.run_now(schedule_id)

    def get(self, schedule_id: str) -> Definition | None:
        return self.definitions.get(schedule_id)

    def list(self, prefix: str = "", cursor: str = "", count: int = 100) -> tuple[builtins.list[Definition], str]:
        """A page of the schedules whose id starts with ``prefix`` (about ``count``, in no order) and the
        cursor of the next page ('' after the last): ``cursor`` ('' for the first page)."""
        return self.definitions.page(prefix, cursor, count)

    def all(self) -> builtins.list[Definition]:
        """Every schedule, at once (:meth:`list` pages through millions)."""
        return self.definitions.all()


def _named(item: Any) -> str:
    """An :meth:`Schedules.upsert_many` item, named in its error by its schedule id."""
    return f"schedule {item[0]!r:.100}" if isinstance(item, (tuple, builtins.list)) and item else "not an item"


def _check_id(schedule_id: Any) -> None:
    """``ValueError`` unless ``schedule_id`` is a string with a UTF-8 form (the store's field and hash):
    found only when its batch was partitioned, another id failed a whole :meth:`Schedules.upsert_many`
    batch, named as its first item."""
    if not isinstance(schedule_id, str) or not _encodes(schedule_id):
        raise ValueError(f"a schedule id is a string (of UTF-8 characters), got {schedule_id!r:.100}")


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def options_of(options: dict[str, Any], tz: str) -> Options:
    """The :class:`.Options` of :meth:`Schedules.upsert`'s keyword arguments (naive datetimes in ``tz``)."""
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown schedule option(s) {', '.join(sorted(unknown))}; known: {', '.join(OPTION_NAMES)}")
    if not isinstance(options.get("overlap", True), bool):
        raise ValueError(f"overlap must be True or False, got {options['overlap']!r}")
    return Options(start_ms=_instant_ms(options.get("start"), tz), end_ms=_instant_ms(options.get("end"), tz),
                   jitter_ms=_duration_ms(options.get("jitter", 0), "jitter"),
                   misfire=options.get("misfire", "once"),
                   catch_up_ms=_duration_ms(options.get("catch_up", 0), "catch_up"),
                   overlap=options.get("overlap", True))


def _instant_ms(value: Any, tz: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return int((value if value.tzinfo else value.replace(tzinfo=ZoneInfo(tz))).timestamp() * 1000)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value * 1000)
    raise ValueError(f"start and end must be datetimes or seconds since the epoch, got {value!r}")


def _duration_ms(value: Any, name: str) -> int:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise ValueError(f"{name} must be seconds >= 0 or a timedelta, got {value!r}")
    return round(seconds * 1000)


def zone_of(app: Celery) -> str:
    """The zone crontabs are read in: the app's ``timezone`` (UTC by default, as ``celery beat``)."""
    return str(app.conf.timezone or "UTC")


def template_of(app: Celery, signature: Signature, templates: Templates | None = None) -> bytes:
    """The stored message ``signature.apply_async`` builds (task id :data:`TEMPLATE_ID`), written nowhere,
    without what differs from one process to another (``origin``, ``reply_to``) or belongs to the caller
    (``parent_id``), so every process builds the same template for one signature.  ``templates``: those
    of many signatures (:class:`Templates`).

    Refused (``ValueError``): a canvas (its members' ids would be the same in every occurrence), a
    replace-by-key header, and ``expires`` (it would be fixed at the template's time, not each run's).
    """
    if type(signature) is not Signature:
        raise ValueError(f"a recurring schedule runs one task's signature, not a {type(signature).__name__}")
    if KEY_HEADER in (signature.options.get("headers") or {}) or signature.options.get("expires") is not None:
        raise ValueError(f"recurring schedules do not support {KEY_HEADER} nor expires (yet): {signature!r}")
    template = (templates or Templates(app)).envelope(signature)
    template.headers.pop("origin", None)
    template.headers.update(root_id=TEMPLATE_ID, parent_id=None)
    template.properties.pop("reply_to", None)
    return template.encode()


class Templates:
    """The messages ``apply_async`` builds for signatures (:func:`template_of`), into one batch, with
    ``producer``; a signature of a shape already built (its task and options, :mod:`.template`) is made
    from that shape's message, as :func:`.apply_many` makes tasks.  A batch (its event dispatcher), a
    producer and ``apply_async`` per signature were most of :meth:`Schedules.upsert_many`'s time."""

    def __init__(self, app: Celery, producer: Any = None) -> None:
        self.app, self.producer = app, producer
        self.batch = Batch(app, [])
        self.shapes = Shapes(app, {})

    def envelope(self, signature: Signature) -> Envelope:
        shape = self.shapes.shape(signature)
        template = self.shapes.templates.get(shape) if shape is not None else None
        made = template and template.make(TEMPLATE_ID, signature.get("args"), signature.get("kwargs"),
                                          TEMPLATE_DUE_MS, TEMPLATE_ETA.isoformat(), None)
        if made:
            return Envelope.decode(made.frame)
        batch = self.batch
        batch.published = None
        token = batching.set(batch)
        try:
            with results_subscribed_on_get(self.app):
                result = signature.apply_async(eta=TEMPLATE_ETA, countdown=None, task_id=TEMPLATE_ID,
                                               producer=self.producer)
        finally:
            batching.reset(token)
        items, batch.items, batch.events = batch.items, [], []
        if len(items) != 1:
            raise ValueError(f"{signature!r} did not build one delayed message (is celery_delayed installed?)")
        if shape is not None:
            self.shapes.learn(shape, signature, batch.published, result)
        return Envelope.decode(items[0][2])


def beat_entries(app: Celery) -> dict[str, tuple[bytes, Rule, Options]]:
    """The recurring schedules of the app's ``beat_schedule`` (schedule id ``beat:<name>`` -> template,
    rule, options), as ``celery beat`` would send each entry (``task``, ``args``, ``kwargs``,
    ``options``); the schedule's own options (:data:`OPTION_NAMES`) are the entry's keys, or are taken
    out of its ``options``.  An entry that cannot be one (a ``solar`` schedule, ``expires``, a bad
    option...) is logged and left out."""
    entries = {}
    for name, entry in (app.conf.beat_schedule or {}).items():
        try:
            sent = dict(entry.get("options", {}))
            own = {key: sent.pop(key) if key in sent else entry[key]
                   for key in OPTION_NAMES if key in sent or key in entry}
            signature = app.signature(entry["task"], args=entry.get("args", ()), kwargs=entry.get("kwargs", {}),
                                      options=sent)
            entries[BEAT_PREFIX + name] = (template_of(app, signature), rule_of(entry["schedule"], zone_of(app)),
                                           options_of(own, zone_of(app)))
        except Exception as exc:  # whatever one entry holds (options=None, args=5...), only it is left out
            logger.error("beat_schedule entry %r is not run: %s: %s", name, type(exc).__name__, exc)
    return entries
