"""The compact and deflated stored forms: smaller, and still exactly what Celery built."""
from __future__ import annotations

import json
import pickle
import random
import zlib

import pytest
from celery import Celery
from kombu.serialization import dumps

from celery_delayed.envelope import (COMPACT, DEFLATED, ZDICT_V1, Envelope, EnvelopeError, decode_meta, deflate,
    serialize)

TASK_ID = "0b6c7f9e-2a51-4c8e-9a57-3f0e8f0c2d11"


def celery_message(**options) -> tuple[dict, dict, tuple]:
    """Headers, properties and body as Celery 5 builds them for ``tasks.demo.add(2, 2)``."""
    app = Celery("t", set_as_current=False)
    headers, properties, body, _ = app.amqp.create_task_message(
        TASK_ID, "tasks.demo.add", (2, 2), {}, countdown=60, **options)
    return headers, properties, body


def envelope_of(headers: dict, properties: dict, body: tuple, serializer: str = "json") -> Envelope:
    data, content_type, content_encoding = serialize(body, serializer, None, headers)
    return Envelope(task_id=TASK_ID, queue="celery", headers=headers, body=data, content_type=content_type,
                    content_encoding=content_encoding,
                    properties={k: v for k, v in properties.items() if v not in (None, "")})


def test_celery_headers_come_back_exactly_but_the_eta():
    headers, properties, body = celery_message()
    stored = envelope_of(headers, properties, body).encode()
    back = Envelope.decode(stored)
    assert back.headers == {k: v for k, v in headers.items() if k != "eta"}
    assert back.properties == {"correlation_id": TASK_ID}
    assert b"lang" not in stored and b"root_id" not in stored and stored.count(TASK_ID.encode()) == 1


def test_values_that_differ_from_celerys_defaults_are_kept():
    headers, properties, body = celery_message(retries=3, root_id="root", parent_id="parent", group_id="g",
                                               group_index=2, time_limit=10, expires=3600)
    back = Envelope.decode(envelope_of(headers, properties, body).encode())
    assert back.headers == {k: v for k, v in headers.items() if k != "eta"}
    assert (back.headers["retries"], back.headers["root_id"], back.headers["timelimit"]) == (3, "root", [10, None])


def test_defaults_a_message_lacked_are_not_invented():
    envelope = Envelope(task_id="x", queue="q", headers={"task": "t", "retries": False}, body=b"[]",
                        content_type="application/json", content_encoding="utf-8")
    back = Envelope.decode(envelope.encode())
    assert back.headers == {"task": "t", "retries": False}  # False is not the default 0
    assert back.properties == {}


@pytest.mark.parametrize("serializer", ["json", "pickle", "msgpack"])
def test_body_bytes_are_kombus_own(serializer):
    headers, properties, body = celery_message()
    envelope = envelope_of(headers, properties, body, serializer)
    back = Envelope.decode(deflate(envelope.encode(), 0))
    content_type, content_encoding, expected = dumps(body, serializer=serializer)
    assert back.body == (expected.encode() if isinstance(expected, str) else expected)
    assert (back.content_type, back.content_encoding) == (content_type, content_encoding)


def test_deflate_shrinks_a_real_message_by_more_than_half():
    headers, properties, body = celery_message()
    frame = envelope_of(headers, {**properties, "reply_to": "5f0c9a1e-3b2d-3c4e-8f6a-7b8c9d0e1f2a"}, body).encode()
    packed = deflate(frame, 128)
    assert packed[:1] == DEFLATED and len(packed) < len(frame) / 2 < 150
    assert Envelope.decode(packed) == Envelope.decode(frame)
    assert decode_meta(packed)["q"] == "celery"


def test_deflate_leaves_short_incompressible_and_other_forms_alone():
    frame = Envelope(task_id="x", queue="q", headers={}, body=b"[]", content_type="application/json",
                     content_encoding="utf-8").encode()
    assert deflate(frame, len(frame) + 1) == frame
    noise = COMPACT + b'{"id":"x","q":"q"}\n' + random.Random(1).randbytes(1000)
    assert deflate(noise, 0) == noise  # deflating would not make it smaller
    original = b'{"id":"x","q":"q","h":{},"ct":"a","ce":"b"}\nbody'
    assert deflate(original, 0) == original


def test_the_original_form_still_decodes():
    stored = (b'{"id":"abc","q":"celery","h":{"lang":"py","task":"t.add","id":"abc","eta":"2030-01-01T00:00:00+00:00",'
              b'"retries":0},"ct":"application/json","ce":"utf-8","p":{"correlation_id":"abc"}}\n[[2, 2], {}, {}]')
    back = Envelope.decode(stored)
    assert back.headers["eta"] == "2030-01-01T00:00:00+00:00" and back.headers["retries"] == 0
    assert (back.task_id, back.queue, back.body, back.routing_key) == ("abc", "celery", b"[[2, 2], {}, {}]", "celery")


@pytest.mark.parametrize("data, words", [
    (DEFLATED + b"\xff\xfe garbage", "deflated envelope is damaged"),
    (DEFLATED + zlib.compressobj(6, zlib.DEFLATED, -15, 8, 0, ZDICT_V1).compress(b'{"id":"x","q":"q"}\nbody'),
     "truncated"),
    (COMPACT + b'{"id":"x","q":"q","h":[]}\nbody', "'h' is not a dict"),
    (COMPACT + b'{"id":"x","q":"q","ct":1}\nbody', "'ct' is not a str"),
    (COMPACT + b'{"id":"x"}\nbody', "lacks a task id or queue"),
])
def test_damaged_compact_forms_are_named(data, words):
    with pytest.raises(EnvelopeError, match=words):
        Envelope.decode(data)


def test_headers_that_are_not_json_are_refused_by_name():
    envelope = Envelope(task_id="x", queue="q", headers={"task": "t", "when": object()}, body=b"",
                        content_type="application/json", content_encoding="utf-8")
    with pytest.raises(EnvelopeError, match="task x: a header or property is not JSON data"):
        envelope.encode()


def test_the_preset_dictionary_never_changes():
    # Every deflated message ever stored needs these exact bytes to be read again.
    assert (len(ZDICT_V1), zlib.crc32(ZDICT_V1)) == (751, 1756517972)


def test_binary_bodies_survive_deflate():
    body = pickle.dumps(((b"\n\x00", "x\ny"), {}, {}))
    frame = Envelope(task_id="x", queue="q", headers={}, body=body, content_type="application/x-python-serialize",
                     content_encoding="binary").encode()
    assert Envelope.decode(deflate(frame, 0)).body == body
    assert json.loads(frame[1:frame.index(b"\n")])["ct"] == "application/x-python-serialize"


@pytest.mark.parametrize("queue, lane", [("mail", "mail"), ("q" * 255, "q" * 255), ("q" * 256, ""),
                                         ("é-queue", "é-queue")])
def test_a_stored_message_records_its_bucket_and_its_queues_lane_and_gives_both_back(queue, lane):
    from celery_delayed.store.layout import bucket_of, lane_of, parse_stored, stored_message

    envelope = Envelope(task_id=TASK_ID, queue=queue, headers={"task": "t", "id": TASK_ID}, body=b"[]",
                        content_type="application/json", content_encoding="utf-8").encode()
    due = 1_800_000_123_456
    assert lane_of(envelope) == lane
    assert parse_stored(stored_message(due, envelope)) == (bucket_of(due), lane, envelope)


def test_bytes_that_are_no_envelope_are_stored_in_lane_nothing_and_given_back_whole():
    from celery_delayed.store.layout import parse_stored, stored_message

    assert parse_stored(stored_message(10_000, b"garbage")) == (10, "", b"garbage")


@pytest.mark.parametrize("data", [b"", b"\0", b"\0\0", b"\0\xff\xfe", b"\0\x01a{}", b"\0\x03abc\x01{}\n"])
def test_bytes_led_by_a_nul_are_given_back_whole_not_read_as_a_lane_head(data):
    from celery_delayed.store.layout import parse_stored, stored_message

    assert parse_stored(stored_message(10_000, data)) == (10, "", data)


@pytest.mark.parametrize("data", [b"\0", b"\0\xff\xfe", b"\0\x09cut", b"\0\x02\xff"])
def test_a_lane_head_that_cannot_be_one_is_read_as_part_of_the_envelope(data):
    """As versions before the empty lane head stored an envelope led by a NUL: never an error."""
    from celery_delayed.store.layout import parse_stored

    assert parse_stored(b"\0\0\0\x0a" + data) == (10, "", data)
