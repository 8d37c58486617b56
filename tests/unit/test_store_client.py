"""Pure logic of the store API and the client: due times, cursors, item checks, stored ids."""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from kombu.message import Message
from redis.crc import key_slot

import celery_delayed
from celery_delayed.client.intercept import DelayedPublishError
from celery_delayed.store.delayed import _checked_due_ms
from celery_delayed.store.inspection import cursor_after, parse_cursor
from celery_delayed.store.keys import Keys
from celery_delayed.store.layout import due_ms_of, member_of, task_id_of


def test_due_times_naive_is_utc():
    aware = datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    assert due_ms_of(aware) == int(aware.timestamp() * 1000)
    assert due_ms_of(datetime(2030, 1, 1, 10)) == due_ms_of(aware)
    assert due_ms_of(1_900_000_000_000) == 1_900_000_000_000
    with pytest.raises(TypeError, match="datetime or int ms"):
        due_ms_of("tomorrow")


@pytest.mark.parametrize("conf", [{"enable_utc": True}, {"enable_utc": False, "timezone": "America/New_York"},
                                  {"enable_utc": True, "timezone": "Asia/Kolkata"}])
@pytest.mark.parametrize("eta", [datetime(2030, 6, 1, 8, 30), datetime(2030, 6, 1, 8, 30, tzinfo=timezone.utc),
                                 datetime(2030, 6, 1, 8, 30, tzinfo=timezone(timedelta(hours=-3)))])
def test_the_client_reads_an_eta_as_a_stock_worker_does(conf, eta):
    """The due time equals the ETA a Celery worker's Request computes from the same message."""
    from celery.worker.request import Request

    app = celery_delayed.install(Celery("t", set_as_current=False))
    app.conf.update(conf)
    headers, properties, body, _ = app.amqp.create_task_message("id-1", "t.add", (1, 2), {}, eta=eta)
    message = Message(body=b'[[1, 2], {}, {}]', headers=headers, content_type="application/json",
                      content_encoding="utf-8", properties=properties, delivery_info={})
    request = Request(message, app=app, task=app.tasks["celery.backend_cleanup"])
    assert app.amqp.due_ms(headers) == int(request.eta.timestamp() * 1000)


def test_a_malformed_eta_is_a_clear_error():
    app = celery_delayed.install(Celery("t", set_as_current=False))
    with pytest.raises(DelayedPublishError, match="eta 'tomorrow' is not an ISO 8601 time"):
        app.amqp.due_ms({"eta": "tomorrow"})


@pytest.mark.parametrize("item, words", [
    (("", 1, b"\x01x"), "item 7: task id must be a non-empty str"),
    (("a", "soon", b"\x01x"), r"item 7 \(a\): due time must be ms"),
    (("a", float("nan"), b"\x01x"), "due time must be ms"),
    (("a", True, b"\x01x"), "due time must be ms"),
    (("a", 1, "text"), "message must be bytes, got str"),
    (("\0a", 1, b"\x01x"), "task id must be a non-empty str not starting with NUL"),
    (("a", -1, b"\x01x"), r"item 7 \(a\): due time must be between 1970 and 2106"),
    (("a", 2**32 * 1000, b"\x01x"), "due time must be between 1970 and 2106"),
])
def test_bad_items_are_named(item, words):
    with pytest.raises(ValueError, match=words):
        _checked_due_ms(*item, index=7)


def test_a_queue_given_that_is_not_a_str_is_named():
    with pytest.raises(ValueError, match=r"item 7 \(a\): queue must be a str, got bytes"):
        _checked_due_ms("a", 1, b"\x01x", 7, b"q")


def test_float_due_times_are_accepted():
    assert _checked_due_ms("a", 1.9e12, b"\x02z", 0) == 1_900_000_000_000


def test_a_cursor_is_the_last_tasks_due_time_and_stored_id():
    entry = (7, b"\x00\x01id", 3)
    assert cursor_after(entry) == "7:0001" + b"id".hex()
    assert parse_cursor(cursor_after(entry)) == (7, b"\x00\x01id")
    assert parse_cursor(None) == (None, b"") and parse_cursor("9:") == (9, b"")  # from due 9 on


@pytest.mark.parametrize("cursor", ["", "x:ab", "5:1=2", "5:zz", ":00"])
def test_bad_cursors_are_refused(cursor):
    with pytest.raises(ValueError, match="not a cursor of upcoming"):
        parse_cursor(cursor)


IDS = [str(uuid.uuid4()), "00000000-0000-0000-0000-000000000000", str(uuid.uuid4()).upper(), "sixteen-chars-id",
       "\0" + "x" * 15, "\0\0abc", "a", "12345678-1234-1234-1234-12345678901 ", "12345678-1234-1234-1234 12345678901",
       "g2345678-1234-1234-1234-123456789012", "ünïcödé-task-id", "\0sixteen-chars-id"]


def test_stored_ids_are_16_bytes_only_for_canonical_uuids_and_always_round_trip():
    members = [member_of(task_id) for task_id in IDS]
    assert [task_id_of(m) for m in members] == IDS
    assert len(set(members)) == len(IDS)  # one form per id: no two ids share a member
    assert [len(m) == 16 for m in members] == [True, True] + [False] * (len(IDS) - 2)
    assert member_of(IDS[0]) == uuid.UUID(IDS[0]).bytes


@pytest.mark.parametrize("task_id", ["760d8386-0bf1-44ec-b7b1-88e13ad30a90", "}x{", "{a}b", "}", "plain"])
def test_a_task_ids_run_claim_and_records_share_one_cluster_slot(task_id):
    slots = {key_slot(Keys("cd").task(kind, task_id).encode()) for kind in ("run", "revoked", "done")}
    assert len(slots) == 1
    assert Keys("cd").run(task_id).endswith(task_id)
