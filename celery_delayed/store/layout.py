"""How a task sits in the store: its partition, its stored id, its lane, its time bucket, its due time.

Part of the stored layout (:meth:`.DelayedStore.check_layout`): every process
of a deployment must encode the same way.
"""
from __future__ import annotations

import functools
import struct
import zlib
from datetime import datetime, timezone

from celery_delayed.envelope import EnvelopeError, queue_of

#: Width of the time buckets (see :mod:`.delayed`).  Part of the stored
#: layout: every process of a deployment must use the same value.
BUCKET_SECONDS = 10
#: Version of the stored format (key names, message prefix, member encoding): part of the layout.
#: Format 2 added lanes; it reads a store of format 1 as it is (its tasks are lane "").
LAYOUT_FORMAT = 2
#: The formats a store may have been written in that this one reads as they are.
READS_FORMATS = (1, 2)
#: A stored message starts with its bucket's start, big-endian (Lua: struct '>I4').
_BUCKET = struct.Struct(">I")
#: Longest lane name (bytes): a queue whose name is longer shares lane "".
MAX_LANE = 255
#: The lane head of lane "" in front of an envelope starting with a NUL (see :func:`stored_message`).
_NO_LANE = b"\0\0"
#: Due times the store holds: from 1970 until the bucket start no longer fits 4 bytes (2106).
MAX_DUE_MS = 2**32 * 1000


def partition_of(task_id: str, partitions: int) -> int:
    """Stable partition of a task id (CRC-32, identical in every process and version)."""
    return zlib.crc32(task_id.encode()) % partitions


def member_of(task_id: str) -> bytes:
    """The stored form of a task id: the 16 bytes of a canonical (lower-case, hyphenated) UUID,
    else its UTF-8, escaped by a leading NUL when it could be mistaken for one (16 bytes
    long, or starting with NUL) — so every id has exactly one form and back."""
    if len(task_id) == 36 and task_id[8] == task_id[13] == task_id[18] == task_id[23] == "-":
        digits = task_id.replace("-", "")
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raw = b""
        if len(raw) == 16 and raw.hex() == digits:
            return raw
    encoded = task_id.encode()
    return b"\0" + encoded if len(encoded) == 16 or encoded[:1] == b"\0" else encoded


def task_id_of(member: bytes) -> str:
    """The task id of a stored member (the inverse of :func:`member_of`)."""
    if len(member) == 16:
        raw = member.hex()
        return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"
    return (member[1:] if member[:1] == b"\0" else member).decode()


def lane_of(envelope: bytes) -> str:
    """The lane (``lua/_buckets.lua``) of a task: its queue's name; "" when that is too long or
    ``envelope`` is none (dispatch dead-letters it), as lanes only keep queues apart."""
    try:
        queue = queue_of(envelope)
    except EnvelopeError:
        return ""
    return queue if _lane_head(queue) else ""


@functools.lru_cache(maxsize=4096)
def _lane_head(queue: str) -> bytes:
    """What a stored message holds of a lane: a NUL, the lane's length (1 byte) and its name."""
    lane = queue.encode()
    return b"\0" + bytes((len(lane),)) + lane if 0 < len(lane) <= MAX_LANE else b""


def stored_message(due_ms: int, envelope: bytes, queue: str | None = None) -> bytes:
    """What the store keeps of a task: its bucket's start, its lane (:func:`_lane_head`) and its envelope.

    ``queue`` is the envelope's queue when the caller knows it: the lane is then not read from the
    envelope (inflating a deflated one cost the bulk write more than the rest of its work per task).
    An envelope starting with a NUL (none this package writes does, but the store takes any bytes)
    gets an empty lane head in lane "": its NUL would otherwise be read as one, the envelope cut."""
    head = _lane_head(lane_of(envelope) if queue is None else queue) \
        or (_NO_LANE if envelope[:1] == b"\0" else b"")
    return _BUCKET.pack(bucket_of(due_ms)) + head + envelope


def parse_stored(stored: bytes) -> tuple[int, str, bytes]:
    """``(bucket start, lane, envelope)`` of a stored message (the inverse of :func:`stored_message`).

    Never raises for what the store holds: a lane head that cannot be one (cut short, or not UTF-8:
    an envelope starting with a NUL, stored by a version that did not yet give it an empty head) is
    read as part of the envelope, which dispatch then dead-letters as undecodable, bytes and all."""
    start = _BUCKET.unpack_from(stored)[0]
    end = 6 + stored[5] if stored[4:5] == b"\0" and len(stored) > 5 else None
    if end is not None and end <= len(stored):
        try:
            return start, stored[6:end].decode(), stored[end:]
        except UnicodeDecodeError:
            pass
    return start, "", stored[4:]


def bucket_of(due_ms: int) -> int:
    """Start (s since the epoch) of the time bucket holding a due time."""
    return due_ms // 1000 // BUCKET_SECONDS * BUCKET_SECONDS


def due_ms_of(when: datetime | int) -> int:
    """A due time in ms since the epoch: ``int`` ms as is, a datetime by Celery's rule (naive = UTC)."""
    if isinstance(when, datetime):
        aware = when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
        return int(aware.timestamp() * 1000)
    if isinstance(when, int) and not isinstance(when, bool):
        return when
    raise TypeError(f"a due time must be a datetime or int ms since the epoch, got {type(when).__name__}")


def iso_of(ms: int | None) -> str | None:
    """An ms timestamp as an ISO 8601 UTC time (None stays None)."""
    return None if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")
