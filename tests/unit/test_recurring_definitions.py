"""A stored definition read and written again: its template is not deflated again (a poller writes one
per occurrence), unless it changed; an occurrence's id, computed without ``uuid``, is still its uuid5."""
from __future__ import annotations

import enum
import uuid
from dataclasses import replace

import pytest

from celery_delayed.envelope import Envelope, deflate
from celery_delayed.recurring import definitions
from celery_delayed.recurring.definitions import Definition
from celery_delayed.recurring.occurrences import NAMESPACE, occurrence_id
from celery_delayed.recurring.policy import Options

TEMPLATE = Envelope(task_id="t", queue="q", headers={"task": "tasks.demo.add", "argsrepr": "(1, 2)" * 40},
                    body=b"[[1, 2], {}, {}]" * 20,
                    content_type="application/json", content_encoding="utf-8").encode()


def test_a_read_definition_is_written_again_with_its_stored_template(monkeypatch):
    stored = Definition("s", {"every_ms": 1000, "anchor_ms": 0}, TEMPLATE, "api", 3, 5000).encode()
    held = Definition.decode("s", stored)
    assert held.template == TEMPLATE and held.encode() == stored
    deflated = stored.partition(b"\n")[2]
    assert held.stored_template == (held.template, deflated)
    moved = replace(held, pending_ms=6000)
    monkeypatch.setattr(definitions, "deflate", None)  # not deflated again: the bytes read are written
    assert moved.encode().partition(b"\n")[2] == deflated
    assert Definition.decode("s", moved.encode()) == moved


def test_a_changed_template_is_deflated_afresh():
    held = Definition.decode("s", Definition("s", {"every_ms": 1000, "anchor_ms": 0}, TEMPLATE, "api", 3,
                                             5000).encode())
    other = Envelope(task_id="t", queue="q2", headers={"task": "tasks.demo.mul"}, body=b"[[], {}, {}]",
                     content_type="application/json", content_encoding="utf-8").encode()
    changed = replace(held, template=other, version=4)
    assert changed.encode().partition(b"\n")[2] == deflate(other, 0)
    assert Definition.decode("s", changed.encode()).template == other


@pytest.mark.parametrize("schedule_id", ["s", "bench:7", "ünïcode/日本", "a\nb", "x" * 300])
@pytest.mark.parametrize("run_now", [False, True])
def test_an_occurrence_id_is_uuid5_of_its_schedule_and_time(schedule_id, run_now):
    """The ids of occurrences already stored must not change: each is ``uuid.uuid5``'s."""
    for nominal_ms in (0, 1, 1_796_659_560_000, 2**42 - 1):
        name = f"{schedule_id}\0{nominal_ms}" + ("\0now" if run_now else "")
        assert occurrence_id(schedule_id, nominal_ms, run_now) == str(uuid.uuid5(NAMESPACE, name))


def test_a_str_enum_schedule_id_derives_what_its_value_does():
    """A ``str`` enum member formats as its name (``Job.nightly``) on Python 3.11 (as its value on 3.10),
    while the store and an occurrence's header hold its value: its occurrence ids and jitter are its value's."""
    job = enum.Enum("Job", {"nightly": "nightly"}, type=str).nightly
    assert occurrence_id(job, 60_000) == occurrence_id("nightly", 60_000)
    assert Options(jitter_ms=10**9).due_ms(job, 60_000) == Options(jitter_ms=10**9).due_ms("nightly", 60_000)
