"""Recurring schedules' rules: crontab in IANA zones across DST changes, absolute intervals.

Each DST case is a fixed instant checked against the zone's real transition (``zoneinfo``): a wall
time a spring-forward skips runs at the first instant after the gap; a wall time a fall-back repeats
runs once, the first time.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule, solar

from celery_delayed.recurring.rules import Cron, Every, rule_data, rule_from_data, rule_of


def ms(iso: str) -> int:
    """An ISO instant with its offset, in ms since the epoch."""
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


def runs(rule, after: str, n: int) -> list[str]:
    """The next ``n`` instants of ``rule`` after ``after``, as UTC ISO strings."""
    found, at = [], ms(after)
    for _ in range(n):
        at = rule.next_after(at)
        found.append(datetime.fromtimestamp(at / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M"))
    return found


@pytest.mark.parametrize("zone, spec, after, expected", [
    # Paris, 2026-03-29 02:00 CET -> 03:00 CEST: 02:30 does not exist, it runs at 03:00 CEST (01:00Z)
    ("Europe/Paris", crontab(minute=30, hour=2), "2026-03-28T12:00+01:00",
     ["2026-03-29T01:00", "2026-03-30T00:30", "2026-03-31T00:30"]),
    # Paris, 2026-10-25 03:00 CEST -> 02:00 CET: 02:30 happens twice, runs once (CEST, 00:30Z)
    ("Europe/Paris", crontab(minute=30, hour=2), "2026-10-24T12:00+02:00",
     ["2026-10-25T00:30", "2026-10-26T01:30"]),
    # ...and every half hour of hour 2: the repeated hour's second pass is not run again
    ("Europe/Paris", crontab(minute="0,30", hour=2), "2026-10-25T01:50+02:00",
     ["2026-10-25T00:00", "2026-10-25T00:30", "2026-10-26T01:00"]),
    # New York, 2026-03-08 02:00 EST -> 03:00 EDT: 02:15 runs at 03:00 EDT (07:00Z)
    ("America/New_York", crontab(minute=15, hour=2), "2026-03-07T12:00-05:00",
     ["2026-03-08T07:00", "2026-03-09T06:15"]),
    # New York, 2026-11-01 02:00 EDT -> 01:00 EST: 01:30 runs once, EDT (05:30Z), not again in EST
    ("America/New_York", crontab(minute=30, hour=1), "2026-10-31T12:00-04:00",
     ["2026-11-01T05:30", "2026-11-02T06:30"]),
    # Lord Howe, 2026-10-04 02:00 +10:30 -> 02:30 +11: 02:00 and 02:15 run once, at 02:30 (merged with it)
    ("Australia/Lord_Howe", crontab(minute="*/15"), "2026-10-04T01:40+10:30",
     ["2026-10-03T15:15", "2026-10-03T15:30", "2026-10-03T15:45"]),
    # Lord Howe, 2026-04-05 02:00 +11 -> 01:30 +10:30: 01:30 and 01:45 run once, the first time
    ("Australia/Lord_Howe", crontab(minute="*/15"), "2026-04-05T01:20+11:00",
     ["2026-04-04T14:30", "2026-04-04T14:45", "2026-04-04T15:30", "2026-04-04T15:45"]),
    # Tokyo has no DST: 02:30 JST every day, 24 h apart across Europe's and America's changes
    ("Asia/Tokyo", crontab(minute=30, hour=2), "2026-03-28T00:00+09:00",
     ["2026-03-27T17:30", "2026-03-28T17:30", "2026-03-29T17:30"]),
])
def test_crontab_across_dst(zone, spec, after, expected):
    assert runs(rule_of(spec, zone), after, len(expected)) == expected


def test_a_run_of_the_fall_back_second_pass_is_not_run_again_when_asked_from_within_it():
    # asked at 02:10 CET (the second 02:10), the next 02:30 is not the second 02:30 but the next day's
    rule = rule_of(crontab(minute=30, hour=2), "Europe/Paris")
    assert runs(rule, "2026-10-25T02:10+01:00", 1) == ["2026-10-26T01:30"]


def test_day_of_month_and_day_of_week_must_both_match_as_in_celery():
    rule = rule_of(crontab(minute=0, hour=9, day_of_month=1, day_of_week="mon"), "UTC")
    assert runs(rule, "2026-01-01T00:00+00:00", 2) == ["2026-06-01T09:00", "2027-02-01T09:00"]


def test_a_crontab_that_matches_nothing_for_years_has_no_next_time():
    leap_monday = rule_of(crontab(minute=0, hour=0, day_of_month=29, month_of_year=2, day_of_week="mon"), "UTC")
    with pytest.raises(ValueError, match="matches no time"):
        leap_monday.next_after(ms("2026-01-01T00:00+00:00"))  # next: 2044


@pytest.mark.parametrize("spec", [2, 2.0, timedelta(seconds=2), schedule(timedelta(seconds=2))])
def test_intervals_are_absolute_multiples_from_the_anchor(spec):
    rule = rule_of(spec)
    assert rule == Every(2000, 0)
    assert [rule.next_after(t) for t in (0, 1999, 2000, 2001)] == [2000, 2000, 4000, 4000]
    assert Every(2000, 10_000).next_after(5) == 10_000


def test_intervals_ignore_dst():
    rule = rule_of(timedelta(hours=1))
    assert runs(rule, "2026-03-29T00:30+01:00", 3) == ["2026-03-29T00:00", "2026-03-29T01:00", "2026-03-29T02:00"]


def test_solar_is_refused_naming_it():
    with pytest.raises(ValueError, match="solar"):
        rule_of(solar.__new__(solar))  # (a real one needs the ephem package)


@pytest.mark.parametrize("spec", [0, -1, "every day", True])
def test_what_is_no_schedule_is_refused(spec):
    with pytest.raises(ValueError):
        rule_of(spec)


@pytest.mark.parametrize("rule", [rule_of(crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), "Europe/Paris"),
                                  rule_of(crontab()), Every(2000, 123)])
def test_a_rule_is_stored_as_plain_data(rule):
    data = rule_data(rule)
    assert all(isinstance(v, (str, int)) for v in data.values())
    assert rule_from_data(data) == rule
    if isinstance(rule, Cron):
        assert data["cron"].split()[0] in ("*", "0,15,30,45")


def test_a_stored_crontab_is_parsed_once_and_its_times_memoized():
    """A poller reads thousands of definitions of one rule: one shared rule, its next times computed once
    (and the same as computed afresh)."""
    data = {"cron": "*/5 * * * *", "tz": "Europe/Paris"}
    rule = rule_from_data(data)
    assert rule_from_data(dict(data)) is rule
    after = ms("2026-03-29T01:58+01:00")
    assert rule.next_after(after) == rule.next_after(after) == rule._next_after(after) == ms("2026-03-29T03:00+02:00")
