"""Dead-letter records without servers: framing, damaged records, what operators are shown."""
import json

import pytest

from celery_delayed.envelope import Envelope
from celery_delayed.ops.cli import _age, _shorten
from celery_delayed.store.dlq import PREVIEW_BYTES, DeadLetter, DeadLetterError


def letter(**kw) -> DeadLetter:
    return DeadLetter(**{"task_id": "t1", "reason": "boom", "source": "worker", "attempts": 2,
                         "timestamp": 1_700_000_000.25, **kw})


def test_round_trip_keeps_binary_messages_and_multiline_text():
    original = letter(message=b"\n\x00\x80meta-like line\n{\"x\": 1}\n", traceback="Traceback:\n  line 1\nKeyError",
                      reason="réessai échoué\nsecond line")
    data = original.encode()
    assert data.count(b"\n") == 1 + original.message.count(b"\n")  # the meta is exactly one line
    assert DeadLetter.decode(data) == original


def test_empty_message_round_trips():
    assert DeadLetter.decode(letter().encode()) == letter()


def test_fields_unknown_to_this_version_are_ignored():
    meta = {**json.loads(letter().encode().split(b"\n")[0]), "added_later": [1], "message": "not from meta"}
    back = DeadLetter.decode(json.dumps(meta).encode() + b"\nbytes")
    assert back == letter(message=b"bytes")


@pytest.mark.parametrize("data, why", [
    (b"no newline at all", "no meta line"),
    (b"\x80\x81\nbody", "damaged"),
    (b"[1, 2]\nbody", "damaged"),
    (b'{"reason": "r", "source": "poller"}\nbody', "damaged"),  # no task id
])
def test_damaged_records_raise_a_clear_error(data, why):
    with pytest.raises(DeadLetterError, match=why):
        DeadLetter.decode(data)


def test_describe_decodes_the_envelope():
    envelope = Envelope(task_id="t1", queue="q", headers={"task": "tasks.demo.add", "argsrepr": "(1, 1)"},
                        body=b"[[1, 1], {}, {}]", content_type="application/json", content_encoding="utf-8")
    info = letter(message=envelope.encode()).describe()
    assert (info["task"], info["queue"], info["headers"]["argsrepr"]) == ("tasks.demo.add", "q", "(1, 1)")
    assert info["attempts"] == 2 and info["message_bytes"] == len(envelope.encode())
    assert "message" not in info and "message_error" not in info
    json.dumps(info)


def test_describe_explains_an_undecodable_message():
    info = letter(message=b"\x80" * 1000).describe()
    assert info["task"] == "?" and info["headers"] is None
    assert info["message_error"] == "envelope has no meta line"
    assert info["message_preview"] == repr(b"\x80" * PREVIEW_BYTES)
    json.dumps(info)


def test_cli_shortens_reasons_and_ages():
    assert _shorten("  short\nsecond line") == "short"
    assert _shorten("x" * 100, width=10) == "x" * 9 + "…"
    assert [_age(s) for s in (-1, 42, 300, 7200, 3 * 86400)] == ["0s", "42s", "5m", "2h", "3d"]
