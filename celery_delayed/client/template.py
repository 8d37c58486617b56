"""Messages from a template, for :func:`.bulk.apply_many`.

Most tasks of a campaign share everything but their id, arguments and times.
The first task of each *shape* (its task and options, but for its id, ``eta``,
``countdown`` and ``expires``) is sent by Celery itself (``apply_async``); what
Celery built for it is kept as a :class:`Template`, and each later task of that
shape is made from it: a new id (and root id), its arguments (serialized as
kombu does, ``argsrepr``/``kwargsrepr`` as Celery writes them), ETA and expiry,
in the stored form the per-task path would write.  Its task-sent event and
``after_task_publish`` are sent as Celery sends them.

Whatever a template cannot reproduce goes by the per-task path: canvases, tasks
whose class overrides ``apply_async`` or ``shadow_name``, routers that are
functions (they see the arguments), a ``before_task_publish`` or ``task_sent``
receiver (it may change each message), a call from inside a task (its children
are linked to it), and any task that is not delayed, already expired, keyed or
oversized.  ``tests/unit/test_celery_seams.py`` pins the Celery internals relied on.
"""
from __future__ import annotations

import os
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import Celery, signals
from celery.app.routes import MapRoute
from celery.app.task import Task
from celery.canvas import Signature
from celery.result import AsyncResult
from celery.utils.saferepr import saferepr
from celery.utils.time import maybe_make_aware
from kombu.compression import compress

from celery_delayed.envelope import JSON_ENCODING, JSON_TYPE, Envelope, deflate, format_of, json_encoder, serialize
from celery_delayed.settings import RECORD_OVERHEAD

#: Options that differ from task to task of one shape.
PER_TASK = frozenset(("task_id", "eta", "countdown", "expires"))
#: Headers a template fills in per task, and the placeholders standing for them while it is built.
SLOTS = {name: f"\0{name}\0" for name in ("id", "argsrepr", "kwargsrepr", "expires")}
#: Task ids drawn from the system's random source at once.
IDS_AT_ONCE = 1024
#: Argument types whose ``repr`` is what Celery's ``saferepr`` writes (when short: see :func:`argsrepr`).
_PLAIN = (int, float, bool, type(None))


class _NoShape(Exception):
    """An option value a shape cannot be keyed by (not plain data)."""


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable key telling apart what Celery would serialize differently."""
    kind = type(value)
    if kind in (str, int, float, bool, bytes, datetime) or value is None:
        return kind, value
    if isinstance(value, dict):  # Signatures too
        return kind, tuple((_frozen(k), _frozen(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind, tuple(_frozen(v) for v in value)
    raise _NoShape


def argsrepr(value: tuple | list | dict, maxsize: int, maxlevels: int) -> str:
    """``saferepr(value, maxsize, maxlevels=maxlevels)``, as Celery writes it in a message's headers,
    by plain ``repr`` when every item is a number, bool, None or short ASCII string (where they agree)."""
    items = value.values() if type(value) is dict else value
    if all(type(item) in _PLAIN or (type(item) is str and _plain_text(item)) for item in items) \
            and (type(value) is not dict or all(type(key) is str and key.isidentifier() for key in value)):
        text = repr(value)
        if len(text) < maxsize // 2:
            return text
    return saferepr(value, maxsize, maxlevels=maxlevels)


def _plain_text(text: str) -> bool:
    """Whether ``repr`` writes ``text`` as ``saferepr`` does: short printable ASCII, no quote nor backslash."""
    return len(text) < 64 and text.isascii() and text.isprintable() and "'" not in text and "\\" not in text


@dataclass
class Made:
    """One task made from a template: its compact frame (:func:`.envelope.deflate` makes its stored form:
    :meth:`.Batch.add_made` does so where it is written), and the headers its events repeat."""

    frame: bytes
    task_id: str
    due_ms: int
    argsrepr: str | None  # None: the template's own (given as an option)
    kwargsrepr: str | None
    eta: str
    expires: str | None


class Template:
    """A shape's message as Celery built it for one task, to make the shape's other tasks from.

    The compact frame of the template's envelope is a format string with a field
    where each per-task header goes (:data:`SLOTS`); a task's frame is it filled
    with its values, then its serialized body.
    """

    def __init__(self, app: Celery, task: Task, envelope: Envelope, body: tuple, publish: dict[str, Any],
                 event: dict | None, options: dict[str, Any], result: AsyncResult) -> None:
        self.task, self.name, self.queue = task, envelope.task_name, envelope.queue
        headers, task_id = envelope.headers, envelope.task_id
        self.embed = body[2]
        self.serializer, self.compression = publish["serializer"], publish["compression"]
        self.exchange, self.routing_key = publish["exchange"], publish["routing_key"]
        self.content = envelope.content_type, envelope.content_encoding
        self._json = json_encoder() if self.serializer == "json" and self.content == (JSON_TYPE, JSON_ENCODING) \
            else None
        self._embed_json = self._json(self.embed) if self._json is not None else ""
        self.own_root = headers.get("root_id") == task_id
        self.repr_args = "argsrepr" not in options
        self.repr_kwargs = "kwargsrepr" not in options
        self.has_expires = options.get("expires") is not None
        self.ignored = result.ignored
        self.check = getattr(task, "__header__", None) if task.typing else None
        conf = app.conf
        self.maxsizes = app.amqp.argsrepr_maxsize, app.amqp.kwargsrepr_maxsize, conf.task_repr_maxlevels
        self.event = event
        self._event_frame: str | None = None  # (Batch.event_frame)
        self.after_headers = dict(publish["headers"])
        slotted = dict(headers, id=SLOTS["id"])
        if self.own_root:
            slotted["root_id"] = SLOTS["id"]
        filled = ["id"]
        for name, own in (("argsrepr", self.repr_args), ("kwargsrepr", self.repr_kwargs),
                          ("expires", self.has_expires)):
            if own:
                slotted[name] = SLOTS[name]
                filled.append(name)
        properties = dict(envelope.properties)
        if properties.get("correlation_id") == task_id:
            properties["correlation_id"] = SLOTS["id"]
        frame = Envelope(task_id=SLOTS["id"], queue=envelope.queue, headers=slotted, body=b"",
                         content_type=envelope.content_type, content_encoding=envelope.content_encoding,
                         properties=properties, exchange=envelope.exchange, routing_key=envelope.routing_key).encode()
        self.frame = format_of(frame.decode("ascii"),  # (JSON of ASCII text: json.dumps' default)
                               {name: encode_basestring_ascii(SLOTS[name]) for name in filled})
        settings = app.amqp.delayed_settings
        self.compress_min_bytes, self.max_message_bytes = settings.compress_min_bytes, settings.max_message_bytes
        self.max_record = settings.kafka_message_max_bytes

    def make(self, task_id: str, args: tuple, kwargs: dict, due_ms: int, eta: str, expires: str | None
             ) -> Made | None:
        """The task ``task_id`` of this shape, or None when it must take the per-task path.
        Raises what ``apply_async`` raises for arguments the task does not take or cannot serialize."""
        if self.check is not None:
            self.check(*args, **kwargs)
        if (type(args) is not tuple and type(args) is not list) or not isinstance(kwargs, dict):
            return None
        maxsize_args, maxsize_kwargs, maxlevels = self.maxsizes
        text_args = argsrepr(args, maxsize_args, maxlevels) if self.repr_args else None
        text_kwargs = argsrepr(kwargs, maxsize_kwargs, maxlevels) if self.repr_kwargs else None
        if self.has_expires and expires is None:
            return None
        try:
            body = self.encode(args, kwargs)
        except Exception:  # the per-task path raises it as Celery does
            return None
        if body is None:
            return None
        values = {"id": encode_basestring_ascii(task_id)}  # the JSON of what fills the frame's fields
        if text_args is not None:
            values["argsrepr"] = encode_basestring_ascii(text_args)
        if text_kwargs is not None:
            values["kwargsrepr"] = encode_basestring_ascii(text_kwargs)
        if expires is not None:  # (a field of the frame when the shape has its own expiry)
            values["expires"] = encode_basestring_ascii(expires)
        frame = self.frame.format_map(values).encode() + body
        room = self.max_record - len(task_id.encode()) - RECORD_OVERHEAD  # for the stored form, in a Kafka record
        if len(frame) > self.max_message_bytes or (
                len(frame) > room and len(deflate(frame, self.compress_min_bytes)) > room):  # (never longer deflated)
            return None  # the per-task path refuses it (DelayedAMQP.stored_form)
        return Made(frame, task_id, due_ms, text_args, text_kwargs, eta, expires)

    def encode(self, args: tuple | list, kwargs: dict) -> bytes | None:
        """The body of a task of this shape, serialized and compressed as kombu's producer does for this
        template (None: not as the template's content type says).  A JSON body is the arguments' JSON
        spliced into the template's encoded ``embed``: the same text as the whole body encoded."""
        if self._json is not None:
            data = f"[{self._json(args)}, {self._json(kwargs)}, {self._embed_json}]".encode()
            return compress(data, self.compression)[0] if self.compression else data
        data, content_type, content_encoding = serialize((args, kwargs, self.embed), self.serializer,
                                                         self.compression, {})
        return data if (content_type, content_encoding) == self.content else None

    def sent(self, made: Made, args: tuple, kwargs: dict, batch: Any) -> None:
        """What Celery does once a task is published: ``after_task_publish``, then its task-sent event."""
        root_id = made.task_id if self.own_root else self.after_headers.get("root_id")
        changed = {"id": made.task_id, "root_id": root_id, "eta": made.eta}
        if made.argsrepr is not None:
            changed["argsrepr"] = made.argsrepr
        if made.kwargsrepr is not None:
            changed["kwargsrepr"] = made.kwargsrepr
        if self.has_expires:
            changed["expires"] = made.expires
        if signals.after_task_publish.receivers:
            signals.after_task_publish.send(sender=self.name, body=(args, kwargs, self.embed),
                                            headers={**self.after_headers, **changed},
                                            exchange=self.exchange, routing_key=self.routing_key)
        if self.event is not None:
            changes = {"uuid": made.task_id, "root_id": root_id, "eta": made.eta,
                       "expires": changed.get("expires", self.event.get("expires")),
                       "args": changed.get("argsrepr", self.event["args"]),
                       "kwargs": changed.get("kwargsrepr", self.event["kwargs"])}
            if self._event_frame is None:
                self._event_frame = batch.event_frame(self.event)
            if self._event_frame:
                batch.publish_made(self._event_frame, changes)
            else:
                batch.publish("task-sent", {**self.event, **changes}, None, **batch.event_options)

    def result(self, task_id: str) -> AsyncResult:
        """The task's result, as ``send_task`` returns it."""
        result = self.task.AsyncResult(task_id)
        result.ignored = self.ignored
        return result


def _random_ids(count: int) -> Iterator[str]:
    """``count`` random task ids, as ``str(uuid.uuid4())`` writes them (version 4, RFC 4122 variant)."""
    hexes = os.urandom(16 * count).hex()
    for at in range(0, 32 * count, 32):
        h = hexes[at:at + 32]
        yield f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


#: The first hex digit of a version 4 UUID's fourth group, from a random one: its variant bits set to 10.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}




class Shapes:
    """The templates of one :func:`.bulk.apply_many` call, by shape; which tasks can be made from one."""

    def __init__(self, app: Celery, when: dict[str, Any], enabled: bool = True) -> None:
        self.app, self.when = app, when
        self.templates: dict[Hashable, Template | None] = {}
        conf, amqp = app.conf, app.amqp
        self.enabled = (enabled and conf.task_protocol == 2 and not conf.task_always_eager
                        and app.current_worker_task is None and not signals.before_task_publish.receivers
                        and not signals.task_sent.receivers
                        and all(type(route) is MapRoute for route in amqp.router.routes))
        self._ids: Iterator[str] = iter(())
        self.min_delay_ms = amqp.delayed_settings.min_delay * 1000
        self.zone = app.timezone

    def shape(self, signature: Signature) -> Hashable | None:
        """The key of ``signature``'s shape, or None when it cannot be made from a template."""
        if not self.enabled or type(signature) is not Signature:
            return None
        options = signature.get("options")  # (not signature.options: its property costs 10x a dict's get)
        try:
            return signature.get("task"), tuple((k, _frozen(v)) for k, v in options.items()
                                                if k not in PER_TASK and v is not None), \
                options.get("expires") is not None
        except _NoShape:
            return None

    def learn(self, shape: Hashable, signature: Signature, published: dict[str, Any] | None,
              result: AsyncResult) -> None:
        """Keep what Celery published for ``signature`` as its shape's template (None: the shape is
        not made from templates)."""
        task = self.app.tasks.get(signature.task)
        if shape in self.templates or published is None or task is None:
            return
        kind = type(task)
        envelope = published["envelope"]
        own_times = envelope.headers.get("expires") is None or signature.options.get("expires") is not None
        plain = kind.apply_async is Task.apply_async and kind.shadow_name is Task.shadow_name
        self.templates[shape] = Template(self.app, task, envelope, published["body"], published, published["event"],
                                         {k: v for k, v in signature.options.items() if v is not None},
                                         result) if plain and own_times else None

    def make(self, template: Template, signature: Signature) -> Made | None:
        """``signature``'s task made from ``template`` (its shape's), or None when it takes the per-task path."""
        options = signature.get("options")
        times = self.times(options)
        if times is None:
            return None
        task_id = options.get("task_id") or next(self._ids, None) or self._more_ids()
        return template.make(task_id, signature.get("args"), signature.get("kwargs"), *times)

    def _more_ids(self) -> str:
        """The next of a new series of random (version 4) task ids: ``str(uuid4())`` reads the system's
        random source once per id, a third of a task's time on a busy machine."""
        self._ids = _random_ids(IDS_AT_ONCE)
        return next(self._ids)

    def times(self, options: dict[str, Any]) -> tuple[int, str, str | None] | None:
        """``(due_ms, eta, expires)`` of a signature of ``options``, the times as Celery's ``as_task_v2``
        writes them (ISO strings), or None when it is not a delayed task a template can make."""
        when = self.when or options
        countdown, eta = when.get("countdown"), when.get("eta")
        now = datetime.now(timezone.utc)
        if countdown:  # (now + countdown, in the app's zone: what app.now() and add_seconds_to_datetime give)
            if type(countdown) not in (int, float):
                return None  # the per-task path checks it
            eta = (now + timedelta(seconds=countdown)).astimezone(self.zone)
        if not isinstance(eta, datetime):
            return None  # none, or a string: the per-task path parses it
        due_ms = int(maybe_make_aware(eta).timestamp() * 1000)
        if due_ms - now.timestamp() * 1000 < self.min_delay_ms:
            return None
        expires: Any = options.get("expires")
        if type(expires) in (int, float):
            expires = (now + timedelta(seconds=expires)).astimezone(self.zone)
        if isinstance(expires, datetime):
            if int(maybe_make_aware(expires).timestamp() * 1000) <= due_ms:
                return None  # expired when due: recorded revoked by the per-task path
            expires = expires.isoformat()
        elif expires is not None:
            return None
        return due_ms, eta.isoformat(), expires
