"""The stored form of a task message: what Celery built, compactly framed.

A message is stored, and carried on Kafka, in one of three forms, told apart by
the first byte:

- ``\\x01`` + META + ``\\n`` + BODY: the *compact* form written now.  META is one
  line of JSON (JSON escapes newlines inside strings) with the task id, queue,
  headers, properties, content type/encoding and routing.  Headers and
  properties equal to what Celery sets by default (``lang``, ``root_id`` = id,
  ``correlation_id`` = id, empty groups, ``retries`` 0...) are left out and put
  back on decode; the ``eta`` header is not kept at all: the store's score is
  the due time (:meth:`DelayedStore.reschedule` moves it) and a worker must not
  hold a due task again.
- ``\\x02`` + DEFLATE: the compact form after ``\\x01``, raw-deflated with the
  preset dictionary :data:`ZDICT_V1` (Celery's recurring header names and body
  skeleton), so even a 300-byte message shrinks by half.  See :func:`deflate`.
- ``{``...: the original form (full header set as JSON, then the body), still
  decoded as it was written.

BODY is the serialized body, untouched, so any serializer (json, pickle,
msgpack) and kombu compression round-trip.  The poller reads only the meta
(for routing); workers rebuild a kombu message from the whole envelope.
"""
from __future__ import annotations

import copy
import json
import re
import zlib
from dataclasses import dataclass, field
from json.encoder import c_make_encoder, encode_basestring, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any
from collections.abc import Callable

from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.compression import compress, decompress
from kombu.serialization import dumps, loads, registry
from kombu.utils import json as kombu_json

COMPACT = b"\x01"
DEFLATED = b"\x02"
JSON_TYPE, JSON_ENCODING = "application/json", "utf-8"

#: Stands for "the task's own id" among the defaults below.
_TASK_ID = object()
#: Headers Celery's protocol 2 always sets, with the value they have unless the
#: caller chose otherwise (celery/app/amqp.py ``as_task_v2``).
HEADER_DEFAULTS: dict[str, Any] = {
    "lang": "py", "id": _TASK_ID, "root_id": _TASK_ID, "shadow": None, "expires": None, "group": None,
    "group_index": None, "retries": 0, "timelimit": [None, None], "parent_id": None, "argsrepr": "()",
    "kwargsrepr": "{}", "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
}
PROPERTY_DEFAULTS: dict[str, Any] = {"correlation_id": _TASK_ID}

#: Preset dictionary of the deflated form, version 1: strings that recur in
#: compact metas and Celery bodies, the most frequent last.  NEVER CHANGE IT:
#: stored messages can only be inflated with these exact bytes (a new
#: dictionary needs a new first byte).
ZDICT_V1 = (
    b'application/x-python-serializebinaryapplication/x-msgpackapplication/x-yaml'
    b'"shadow":"","stamped_headers":["],"stamps":{"},"ignore_result":true,"replaced_task_nesting":1,'
    b'"lang":"py","timelimit":[null,null],"a":["'
    b'"parent_id":"","root_id":"","retries":1,"kwargsrepr":"{\'\': ","expires":"2026-11-29T00:00:00.000000+00:00",'
    b'{"task": "tasks.", "args": [], "kwargs": {}, "options": {"countdown": , "task_id": "", "reply_to": "",'
    b' "group_id": "", "group_index": 0, "root_id": "", "parent_id": ""}, "subtask_type": null, "immutable": false,'
    b' "chord_size": null}'
    b'"group":"","group_index":0,'
    b'{"id":"","q":"celery","h":{"task":"tasks.","argsrepr":"(, )","origin":"gen@"},"p":{"reply_to":""}}\n'
    b'[[], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
)


class EnvelopeError(ValueError):
    """Stored bytes are not a valid celery-delayed envelope."""


def header_ms(headers: dict, name: str) -> int | None:
    """A time header (``eta``/``expires``) in ms since the epoch.

    Celery's worker (``Request``) reads it with ``maybe_make_aware(value,
    conf.timezone)``: a naive time is UTC whatever ``enable_utc``/``timezone``
    say, an aware one is taken as it is.  The zone only names the same instant
    differently, so it is not looked up (a settings lookup costs more than the parse).
    """
    value = headers.get(name) if isinstance(headers, dict) else None
    if not value:
        return None
    try:
        when = maybe_make_aware(maybe_iso8601(value))
    except (TypeError, ValueError) as exc:
        raise EnvelopeError(f"{name} {value!r} is not an ISO 8601 time: {exc}") from None
    return int(when.timestamp() * 1000)


@dataclass
class Envelope:
    """One task message as Celery built it, plus the queue it was routed to."""

    task_id: str
    queue: str
    headers: dict[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    properties: dict[str, Any] = field(default_factory=dict)
    exchange: str = ""
    routing_key: str = ""

    @property
    def task_name(self) -> str:
        return self.headers.get("task", "")

    def embed(self, accept: set[str] | None) -> dict[str, Any]:
        """What protocol 2 bodies carry beside the arguments: ``callbacks``, ``errbacks``,
        ``chain`` and ``chord`` (a worker's request holds them).  Raises what kombu
        raises for a body it cannot load, or a content type not in ``accept``."""
        body = decompress(self.body, self.headers["compression"]) if self.headers.get("compression") else self.body
        decoded = loads(body, self.content_type, self.content_encoding, accept=accept)
        return decoded[2] if isinstance(decoded, (list, tuple)) and len(decoded) == 3 else {}

    def encode(self) -> bytes:
        """The compact form (see the module doc); :func:`deflate` may shrink it further.

        Raises :class:`EnvelopeError` when a header or property is not JSON data.
        """
        headers, absent = _omit_defaults(self.headers, HEADER_DEFAULTS, self.task_id)
        properties, absent_properties = _omit_defaults(self.properties, PROPERTY_DEFAULTS, self.task_id)
        headers.pop("eta", None)
        meta: dict[str, Any] = {"id": self.task_id, "q": self.queue}
        for key, value, default in (("h", headers, {}), ("p", properties, {}), ("a", absent + absent_properties, []),
                                    ("ct", self.content_type, JSON_TYPE), ("ce", self.content_encoding, JSON_ENCODING),
                                    ("x", self.exchange, ""), ("rk", self.routing_key or self.queue, self.queue)):
            if value != default:
                meta[key] = value
        try:
            line = json.dumps(meta, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EnvelopeError(f"task {self.task_id}: a header or property is not JSON data: {exc}") from None
        return COMPACT + line.encode() + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> Envelope:
        """Parse any stored form; raise :class:`EnvelopeError` naming what is wrong."""
        meta, body, compact = _parse(data)
        task_id, queue = meta["id"], meta["q"]
        if not compact:
            return cls._from_original(meta, body)
        absent = _field(meta, "a", list, [])
        return cls(task_id=task_id, queue=queue, body=body,
                   headers=_restore_defaults(_field(meta, "h", dict, {}), HEADER_DEFAULTS, absent, task_id),
                   properties=_restore_defaults(_field(meta, "p", dict, {}), PROPERTY_DEFAULTS, absent, task_id),
                   content_type=_field(meta, "ct", str, JSON_TYPE),
                   content_encoding=_field(meta, "ce", str, JSON_ENCODING),
                   exchange=_field(meta, "x", str, ""), routing_key=_field(meta, "rk", str, queue))

    @classmethod
    def _from_original(cls, meta: dict[str, Any], body: bytes) -> Envelope:
        if not isinstance(meta.get("h"), dict):
            raise EnvelopeError("envelope headers are not an object")
        try:
            return cls(task_id=meta["id"], queue=meta["q"], headers=meta["h"], body=body,
                       content_type=meta["ct"], content_encoding=meta["ce"],
                       properties=meta.get("p", {}), exchange=meta.get("x", ""),
                       routing_key=meta.get("rk", meta["q"]))
        except KeyError as exc:
            raise EnvelopeError(f"envelope meta lacks field {exc}") from None


def deflate(frame: bytes, min_bytes: int) -> bytes:
    """A compact envelope of at least ``min_bytes``, deflated when that makes it smaller.

    Raw deflate (no zlib header or checksum: Redis and Kafka keep the bytes
    intact) primed with :data:`ZDICT_V1`; a small hash table (``memLevel`` 2)
    keeps each call near 10 µs.  Other forms are returned unchanged.
    """
    if len(frame) < min_bytes or frame[:1] != COMPACT:
        return frame
    packer = zlib.compressobj(6, zlib.DEFLATED, -15, 4, zlib.Z_DEFAULT_STRATEGY, ZDICT_V1)
    packed = DEFLATED + packer.compress(memoryview(frame)[1:]) + packer.flush()
    return packed if len(packed) < len(frame) else frame


def inflate(data: bytes) -> bytes:
    """The compact envelope :func:`deflate` made ``data`` from (other forms unchanged)."""
    return COMPACT + _inflate(data[1:]) if data[:1] == DEFLATED else data


def decode_meta(data: bytes) -> dict[str, Any]:
    """The meta of an envelope, with at least ``id`` and ``q``: enough to route it."""
    return _parse(data)[0]


def stored_headers(data: bytes) -> dict[str, Any]:
    """An envelope's headers as stored, without the defaults a compact one leaves out (cheaper than
    :meth:`Envelope.decode`): enough to read headers that have no default."""
    headers = decode_meta(data).get("h", {})
    if not isinstance(headers, dict):
        raise EnvelopeError("envelope headers are not an object")
    return headers


#: How :meth:`Envelope.encode` starts a compact envelope: the id, then the queue.
_ROUTE = re.compile(rb'\x01\{"id":"[^"\\]*(?:\\.[^"\\]*)*","q":"([A-Za-z0-9._-]+)"[,}]')


def queue_of(data: bytes) -> str:
    """The queue of an envelope, which is all the poller routes by.

    It is read from the first bytes of the compact form without parsing the whole
    meta, which at dispatch rates was the poller's largest cost per task.  Other
    forms, and queue names that JSON escapes, go through :func:`decode_meta`.
    """
    match = _ROUTE.match(data) if isinstance(data, bytes) else None
    return match[1].decode() if match else decode_meta(data)["q"]


def _parse(data: bytes) -> tuple[dict[str, Any], bytes, bool]:
    """``(meta, body, compact)`` of any stored form; defaults are not restored here."""
    if not isinstance(data, (bytes, bytearray)):
        raise EnvelopeError(f"envelope must be bytes, got {type(data).__name__}")
    kind = data[:1]
    text = _inflate(data[1:]) if kind == DEFLATED else data[1:] if kind == COMPACT else data
    end = text.find(b"\n")
    if end < 0:
        raise EnvelopeError("envelope has no meta line")
    try:
        meta = json.loads(text[:end])
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise EnvelopeError(f"envelope meta is not JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("q"), str) or not isinstance(meta.get("id"), str):
        raise EnvelopeError("envelope meta lacks a task id or queue")
    return meta, bytes(text[end + 1:]), kind in (COMPACT, DEFLATED)


def _inflate(data: bytes) -> bytes:
    unpacker = zlib.decompressobj(-15, zdict=ZDICT_V1)
    try:
        text = unpacker.decompress(data) + unpacker.flush()
    except zlib.error as exc:
        raise EnvelopeError(f"deflated envelope is damaged: {exc}") from None
    if not unpacker.eof:
        raise EnvelopeError("deflated envelope is truncated")
    return text


def _omit_defaults(values: dict[str, Any], defaults: dict[str, Any], task_id: str) -> tuple[dict[str, Any], list[str]]:
    """``values`` without the entries equal (same type, same value) to their default,
    and the names of defaults ``values`` lacks (so decoding does not invent them)."""
    kept = {k: v for k, v in values.items()
            if k not in defaults or not _is_default(v, defaults[k], task_id)}
    return kept, [k for k in defaults if k not in values]


def _restore_defaults(values: dict[str, Any], defaults: dict[str, Any], absent: list,
                      task_id: str) -> dict[str, Any]:
    restored = {k: task_id if d is _TASK_ID else copy.copy(d) for k, d in defaults.items() if k not in absent}
    restored.update(values)
    return restored


def _is_default(value: Any, default: Any, task_id: str) -> bool:
    if default is _TASK_ID:
        return value == task_id
    return type(value) is type(default) and value == default


def _field(meta: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = meta.get(key, default)
    if not isinstance(value, kind):
        raise EnvelopeError(f"envelope meta field {key!r} is not a {kind.__name__}")
    return value


def serialize(body: Any, serializer: str | None, compression: str | None,
              headers: dict[str, Any]) -> tuple[bytes, str, str]:
    """Serialize a task body exactly as kombu's producer would publish it.

    Returns ``(data, content_type, content_encoding)``; when compressing, records
    the method in ``headers["compression"]`` as kombu does.
    """
    content_type, content_encoding, data = dumps(body, serializer=serializer)
    if isinstance(data, str):
        data = data.encode(content_encoding or "utf-8")
    if compression:
        data, headers["compression"] = compress(data, compression)
    return data, content_type, content_encoding


def json_encoder() -> Callable[[Any], str] | None:
    """kombu's JSON serializer (for a list or dict), without an encoder built per call
    (``kombu.utils.json.dumps`` calls ``json.dumps(cls=JSONEncoder)``, which makes a C encoder per
    call: the same output), or None when another serializer is registered.  Without the
    circular-reference check: a cycle raises RecursionError, not ValueError."""
    if registry._encoders["json"].encoder is not kombu_json.dumps:
        return None
    encoder = kombu_json.JSONEncoder()
    if c_make_encoder is None or encoder.indent is not None:
        return encoder.encode
    encode = c_make_encoder(None, encoder.default, encode_basestring_ascii if encoder.ensure_ascii else
                            encode_basestring, None, encoder.key_separator, encoder.item_separator,
                            encoder.sort_keys, encoder.skipkeys, encoder.allow_nan)
    return lambda value: "".join(encode(value, 0))


def format_of(text: str, placeholders: dict[str, str]) -> str:
    """JSON ``text`` as a ``str.format`` string: a field named ``name`` where it holds ``placeholders[name]``
    (the JSON of a string value, there once), its other braces doubled.  ``format_map`` with the JSON of
    values gives the JSON of the same data holding those values in place of the placeholders: a
    template's per-task values filled in by one call, not a Python loop over its pieces."""
    marks = sorted((text.index(json), name, len(json)) for name, json in placeholders.items())
    parts, start = [], 0
    for at, name, width in marks:
        parts += [_literal(text[start:at]), "{", name, "}"]
        start = at + width
    parts.append(_literal(text[start:]))
    return "".join(parts)


def _literal(text: str) -> str:
    """``text`` as ``str.format`` writes it, verbatim."""
    return text.replace("{", "{{").replace("}", "}}")


# -- headers of celery-delayed's own, and the attempt a message is -------------------------------
#: The header naming a task's replace-by-key key: at most one task per key is scheduled.
KEY_HEADER = "delayed_key"
#: ``"replace"`` (the default: a new task replaces the scheduled one) or ``"keep"`` (the scheduled one
#: stays, the new one is dropped).
KEY_MODE_HEADER = "delayed_key_mode"
KEY_MODES = ("replace", "keep")


def executing(request: Any, task_id: str) -> bool:
    """Whether ``request`` (a task's ``self.request``) is ``task_id`` running in a worker's pool:
    not a direct call or an eager one (``apply``), nor the worker's main process recording the
    failure of a task it lost or timed out (Celery pushes that request as a direct call's)."""
    return bool(request is not None and request.id == task_id and not request.called_directly
                and not request.is_eager)


#: Attempts a task id may retry within one replacement level (see :func:`attempt_of`).
NESTING_STEP = 1_000_000


def attempt_of(headers: dict) -> int:
    """The attempt number of a message, ordered by (``replaced_task_nesting``, ``retries``): a task
    that ``Task.replace``-s itself keeps its id and starts ``retries`` over at 0, one nesting level
    deeper, so its replacement comes after every attempt of the task it replaced (0 for a header
    absent or odd)."""
    fields = (headers.get(name) if isinstance(headers, dict) else None for name in ("replaced_task_nesting", "retries"))
    nesting, retries = (value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
                        for value in fields)
    return nesting * NESTING_STEP + min(retries, NESTING_STEP - 1)
