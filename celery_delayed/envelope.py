"""The stored form of a task message: exactly what Celery built, compactly framed.

An envelope is ``META_JSON + b"\\n" + BODY``: ``META_JSON`` is one line of
compact JSON (JSON escapes newlines inside strings) holding the queue, headers,
properties and content type/encoding; ``BODY`` is the serialized body bytes,
untouched, so any serializer (json, pickle, msgpack) and compression round-trips.
The poller reads only the meta line (for routing); workers rebuild a kombu
message from the whole envelope.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kombu.compression import compress
from kombu.serialization import dumps

# Headers Celery fills that the worker does not need to run the task.  They
# are dropped to keep each stored task small (see MEASURED.md: every byte of
# a 10M-task store counts).  ``argsrepr``/``kwargsrepr`` stay: Flower shows them.
_DROPPED_EMPTY = ("shadow", "group", "group_index", "parent_id", "stamped_headers", "stamps",
                  "replaced_task_nesting", "ignore_result")


class EnvelopeError(ValueError):
    """Stored bytes are not a valid celery-delayed envelope."""


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

    def encode(self) -> bytes:
        """Frame the envelope for storage and for the Kafka record value."""
        headers = {k: v for k, v in self.headers.items()
                   if not (k in _DROPPED_EMPTY and v in (None, False, 0, [], {}))}
        meta = {"id": self.task_id, "q": self.queue, "h": headers, "ct": self.content_type,
                "ce": self.content_encoding}
        if self.properties:
            meta["p"] = self.properties
        if self.exchange:
            meta["x"] = self.exchange
        if self.routing_key and self.routing_key != self.queue:
            meta["rk"] = self.routing_key
        return json.dumps(meta, separators=(",", ":"), default=str).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> "Envelope":
        """Parse a framed envelope; raise :class:`EnvelopeError` naming what is wrong."""
        meta = decode_meta(data)
        body = data[data.index(b"\n") + 1:]
        if not isinstance(meta.get("h"), dict):
            raise EnvelopeError("envelope headers are not an object")
        try:
            return cls(task_id=meta["id"], queue=meta["q"], headers=meta["h"], body=body,
                       content_type=meta["ct"], content_encoding=meta["ce"],
                       properties=meta.get("p", {}), exchange=meta.get("x", ""),
                       routing_key=meta.get("rk", meta["q"]))
        except (KeyError, TypeError) as exc:
            raise EnvelopeError(f"envelope meta lacks field {exc}") from None


def decode_meta(data: bytes) -> dict[str, Any]:
    """Only the meta line of an envelope: enough to route it without the body."""
    if not isinstance(data, (bytes, bytearray)):
        raise EnvelopeError(f"envelope must be bytes, got {type(data).__name__}")
    end = data.find(b"\n")
    if end < 0:
        raise EnvelopeError("envelope has no meta line")
    try:
        meta = json.loads(data[:end])
    except ValueError as exc:
        raise EnvelopeError(f"envelope meta is not JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("q"), str) or not isinstance(meta.get("id"), str):
        raise EnvelopeError("envelope meta lacks a task id or queue")
    return meta


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
