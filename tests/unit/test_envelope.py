import json
import pickle
from json.encoder import encode_basestring_ascii

import pytest

from celery_delayed.envelope import Envelope, EnvelopeError, decode_meta, format_of, queue_of
from celery_delayed.store.layout import partition_of


def make(body=b'[[2, 2], {}, {}]', **kw):
    headers = {"task": "t.add", "id": "abc", "eta": "2030-01-01T00:00:00+00:00", "shadow": None,
               "group": None, "retries": 0, "argsrepr": "(2, 2)"}
    return Envelope(task_id="abc", queue="celery", headers=headers, body=body,
                    content_type="application/json", content_encoding="utf-8", **kw)


def test_round_trip_keeps_body_bytes_and_headers_but_the_eta():
    env = make(properties={"correlation_id": "abc"}, exchange="ex", routing_key="rk")
    back = Envelope.decode(env.encode())
    assert back.body == env.body
    assert "eta" not in back.headers  # the store's score is the due time; a worker must not wait again
    assert back.headers == {k: v for k, v in env.headers.items() if k != "eta"}
    assert (back.exchange, back.routing_key, back.properties) == ("ex", "rk", {"correlation_id": "abc"})


def test_binary_bodies_with_newlines_round_trip():
    body = pickle.dumps(((b"\n\x00", "x\ny"), {}, {}))
    assert Envelope.decode(make(body=body).encode()).body == body


def test_routing_key_defaults_to_queue():
    assert Envelope.decode(make().encode()).routing_key == "celery"


@pytest.mark.parametrize("data, words", [
    (b"no newline", "no meta line"),
    (b"{not json\nbody", "not JSON"),
    (b'{"id": "x"}\nbody', "lacks a task id or queue"),
    (b'{"id": "x", "q": "c", "h": [1]}\nbody', "headers are not an object"),
    ("text", "must be bytes"),
])
def test_bad_envelopes_are_named(data, words):
    with pytest.raises(EnvelopeError, match=words):
        Envelope.decode(data)


def test_meta_only_decoding():
    assert decode_meta(make().encode())["q"] == "celery"


@pytest.mark.parametrize("task_id, queue", [("abc", "celery"), ('a"b\\c\u00e9', "q.1-x_y"), ("x", "é"),
                                            ("x", 'a"b'), ("", "celery")])
def test_the_route_read_from_the_first_bytes_is_the_metas_queue(task_id, queue):
    frame = Envelope(task_id=task_id, queue=queue, headers={"task": "t", "id": task_id}, body=b"[]",
                     content_type="application/json", content_encoding="utf-8").encode()
    assert queue_of(frame) == decode_meta(frame)["q"] == queue
    assert queue_of(frame[:1] + frame[1:].replace(b'"q":', b'"h":{},"q":', 1)) == queue  # not first: parsed


@pytest.mark.parametrize("data", [b"\x01{\"id\":\"x\"", b"\x01not json\n", b"", b"\x01{\"id\":1,\"q\":\"celery\"}\n"])
def test_an_envelope_without_a_route_is_an_envelope_error(data):
    with pytest.raises(EnvelopeError):
        queue_of(data)


def test_partition_is_stable_and_spread():
    assert partition_of("abc", 16) == partition_of("abc", 16)
    assert partition_of("5f1c-uuid", 1) == 0
    seen = {partition_of(f"id-{i}", 8) for i in range(200)}
    assert seen == set(range(8))


def test_meta_nested_deeper_than_the_parser_goes_is_an_envelope_error():
    deep = b"\x01" + b'{"id":"x","q":"celery","h":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n{}"
    with pytest.raises(EnvelopeError, match="envelope meta is not JSON"):
        decode_meta(deep)
    with pytest.raises(EnvelopeError, match="envelope meta is not JSON"):
        Envelope.decode(deep)


def test_format_of_fills_placeholders_with_json_values_and_keeps_every_other_brace():
    """A template's JSON with braces of its own (objects, and a "{x}" in a string) made a format string:
    filled with the JSON of values it is the JSON of the same data holding them, each placeholder
    wherever it is (out of name order)."""
    data = {"b": "\0b\0", "h": {"x": "{x} }{", "n": [1, {}]}, "a": "\0a\0", "z": None}
    text = json.dumps(data)
    frame = format_of(text, {name: encode_basestring_ascii(f"\0{name}\0") for name in ("a", "b")})
    values = {"a": "é \"quoted\" {a}", "b": "plain"}
    filled = frame.format_map({name: encode_basestring_ascii(value) for name, value in values.items()})
    assert filled == json.dumps({**data, **values}) and json.loads(filled) == {**data, **values}
