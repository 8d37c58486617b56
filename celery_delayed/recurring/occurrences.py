"""An occurrence of a recurring schedule: its task id, derived from (schedule id, nominal time), and its
message, the schedule's template with that id and headers naming the schedule.

The derived id is a UUID version 5, so an occurrence written or dispatched twice is one task id, run
once by the worker; the poller tells a possible occurrence from an ordinary task by that version alone
(:func:`maybe_occurrence`), without decoding the message.
"""
from __future__ import annotations

import hashlib
import uuid

from celery_delayed.envelope import Envelope, deflate

#: The namespace of occurrence ids (a fixed, random UUID: never change it, ids would change).
NAMESPACE = uuid.UUID("5b0c7f9e-3d1a-4c6e-9a3f-1e2d4c6b8a01")
_NAMESPACE_BYTES = NAMESPACE.bytes
#: The task id a template is built with; each occurrence replaces it with its own.
TEMPLATE_ID = "00000000-0000-0000-0000-000000000000"
#: Headers of an occurrence's message: its schedule, nominal time (ms) and definition version.
SCHEDULE_HEADER, NOMINAL_HEADER, VERSION_HEADER = "delayed_schedule", "delayed_nominal", "delayed_version"
#: The version of a run-now occurrence: one extra run, out of its schedule's chain (versions start at 1).
RUN_NOW_VERSION = 0


def occurrence_id(schedule_id: str, nominal_ms: int, run_now: bool = False) -> str:
    """The task id of ``schedule_id``'s occurrence at ``nominal_ms``, the same wherever it is computed;
    a run-now occurrence's is another (never one of the chain's, at the same instant).  ``uuid.uuid5``'s
    string, computed without building a ``UUID`` (a poller computes one per occurrence: a quarter the time)."""
    # the id's characters, as the store and the occurrence's header hold them (a str enum formats as its name)
    name = schedule_id + f"\0{nominal_ms}" + ("\0now" if run_now else "")
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    digest[6] = digest[6] & 0x0F | 0x50  # version 5
    digest[8] = digest[8] & 0x3F | 0x80  # RFC 4122 variant
    hexa = digest.hex()
    return f"{hexa[:8]}-{hexa[8:12]}-{hexa[12:16]}-{hexa[16:20]}-{hexa[20:]}"


def maybe_occurrence(task_id: str) -> bool:
    """Whether ``task_id`` may be an occurrence's: a canonical UUID of version 5 (Celery's own ids are
    version 4).  One character compared: the poller asks it of every task it dispatches."""
    return len(task_id) == 36 and task_id[14] == "5"


def occurrence(template: Envelope, schedule_id: str, version: int, nominal_ms: int,
               compress_min_bytes: int) -> tuple[str, bytes]:
    """``(task id, stored message)`` of the occurrence at ``nominal_ms``: ``template`` (built with
    :data:`TEMPLATE_ID`) with the occurrence's id as its id, root id and correlation id (protocol 2
    keeps them out of the body, which is untouched), and the schedule's headers.  Version
    :data:`RUN_NOW_VERSION`: a run-now occurrence."""
    task_id = occurrence_id(schedule_id, nominal_ms, version == RUN_NOW_VERSION)
    headers = {**template.headers, "id": task_id, "root_id": task_id, SCHEDULE_HEADER: schedule_id,
               NOMINAL_HEADER: nominal_ms, VERSION_HEADER: version}
    message = Envelope(task_id=task_id, queue=template.queue, headers=headers, body=template.body,
                       content_type=template.content_type, content_encoding=template.content_encoding,
                       properties={**template.properties, "correlation_id": task_id},
                       exchange=template.exchange, routing_key=template.routing_key)
    return task_id, deflate(message.encode(), compress_min_bytes)
