"""What operators type for times, shifts and filters (celery_delayed.ops.browse)."""
from datetime import datetime, timezone

import pytest

from celery_delayed.ops.browse import Filter, parse_move, parse_seconds, parse_when

NOW = 1_800_000_000_000
JAN_15 = int(datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp() * 1000)


@pytest.mark.parametrize("text, expected", [
    ("", None), (None, None), ("now", NOW), ("now+10m", NOW + 600_000), ("now - 2h", NOW - 7_200_000),
    ("1800000000123", 1_800_000_000_123), ("2027-01-15T08:00:00Z", JAN_15), ("2027-01-15T08:00", JAN_15),
    ("2027-01-15T09:00+01:00", JAN_15),
])
def test_times_are_iso_ms_or_relative_to_now_and_naive_means_utc(text, expected):
    assert parse_when(text, NOW) == expected


@pytest.mark.parametrize("text, seconds", [("90", 90), ("+90s", 90), ("-10m", -600), ("2h", 7200), ("1d", 86400)])
def test_shifts(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("bad, message", [("yesterday", "not a time: 'yesterday'"), ("now+soon", "not a duration")])
def test_what_is_not_a_time_is_named(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_when(bad, NOW)


@pytest.mark.parametrize("eta, shift, expected", [
    ("now+1m", None, (NOW + 60_000, None)), (None, "-1h", (None, -3_600_000)), ("now", "", (NOW, None)),
    ("", " 90 ", (None, 90_000)),
])
def test_a_move_is_a_new_due_time_or_a_shift(eta, shift, expected):
    assert parse_move(eta, shift, NOW) == expected


@pytest.mark.parametrize("eta, shift", [("now", "1m"), (None, None), ("", " ")])
def test_a_move_needs_exactly_one_of_a_time_and_a_shift(eta, shift):
    with pytest.raises(ValueError, match="a new due time .* or a shift .*, not both"):
        parse_move(eta, shift, NOW)


def test_a_filter_matches_on_every_field_given_and_refuses_an_empty_window():
    item = {"task": "app.mail", "queue": "mail", "task_id": "order-42"}
    assert Filter(task="app.mail", queue="mail", id_prefix="order-").matches(item)
    assert not Filter(task="app.mail", queue="web").matches(item)
    assert Filter().is_empty() and not Filter(due_after=0).is_empty()
    with pytest.raises(ValueError, match="empty due window"):
        Filter(due_after=NOW, due_before=NOW)
