"""When a schedule runs: the next nominal time after an instant, for Celery's ``crontab`` in an IANA
zone and for absolute intervals.  Pure: no clock, no Redis.

A rule is stored as plain data (:func:`rule_data`, :func:`rule_from_data`), never pickled:
``{"cron": "m h dom mon dow", "tz": "Europe/Paris"}`` or ``{"every_ms": 2000, "anchor_ms": 0}``.

DST (wall-clock rules only; intervals are absolute time and ignore it):

- a wall time that a spring-forward skips runs at the first instant after the gap (all the skipped
  wall times of one gap are that one run, merged with a run due at that instant);
- a wall time that a fall-back repeats runs once, the first time (``fold=0``).

As Celery's ``crontab``, a day must match both ``day_of_month`` and ``day_of_week`` (0 = Sunday).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab, schedule, solar

#: How far ahead a cron rule is searched (years): a rule that matches no day within it (Feb 30) is refused.
HORIZON_YEARS = 8


@dataclass(frozen=True)
class Cron:
    """A crontab's parsed fields (sets, as ``celery.schedules.crontab`` holds them) in zone ``tz``."""

    minute: frozenset[int]
    hour: frozenset[int]
    day_of_month: frozenset[int]
    month_of_year: frozenset[int]
    day_of_week: frozenset[int]  # 0 = Sunday
    tz: str

    def next_after(self, after_ms: int) -> int:
        """The first instant (ms) after ``after_ms`` whose wall time in :attr:`tz` matches, by the DST rule.
        Memoized (:func:`_cron_next_after`): a poller asks it of thousands of schedules of one rule at
        one nominal time, or at one claim's instant."""
        return _cron_next_after(self, after_ms)

    def _next_after(self, after_ms: int) -> int:
        zone = ZoneInfo(self.tz)
        start = datetime.fromtimestamp(after_ms // 1000, zone).replace(tzinfo=None, second=0, fold=0)
        for wall in self._walls(start):
            instant = _instant(wall, zone)
            if instant > after_ms:  # walls of a repeated hour's second pass come out earlier: already past
                return instant
        raise ValueError(f"crontab {self.spec()} matches no time within {HORIZON_YEARS} years")

    def _walls(self, start: datetime) -> Iterator[datetime]:
        """Matching wall times from ``start`` (naive, whole minute) on, in order."""
        hours, minutes = sorted(self.hour), sorted(self.minute)
        day = start.date()
        for _ in range(366 * HORIZON_YEARS):
            if (day.month in self.month_of_year and day.day in self.day_of_month
                    and day.isoweekday() % 7 in self.day_of_week):
                first_day = day == start.date()
                for hour in hours[bisect.bisect_left(hours, start.hour):] if first_day else hours:
                    same_hour = first_day and hour == start.hour
                    for minute in minutes[bisect.bisect_left(minutes, start.minute):] if same_hour else minutes:
                        yield datetime(day.year, day.month, day.day, hour, minute)
            day += timedelta(days=1)

    def spec(self) -> str:
        """``"m h dom mon dow"``, each field a comma list (``*`` when it is every value)."""
        fields = ((self.minute, 60), (self.hour, 24), (self.day_of_month, 31), (self.month_of_year, 12),
                  (self.day_of_week, 7))
        return " ".join("*" if len(values) == size else ",".join(map(str, sorted(values))) for values, size in fields)


@dataclass(frozen=True)
class Every:
    """Every ``every_ms``, at ``anchor_ms`` + k * ``every_ms`` (absolute time: no zone, no DST)."""

    every_ms: int
    anchor_ms: int = 0

    def next_after(self, after_ms: int) -> int:
        if after_ms < self.anchor_ms:
            return self.anchor_ms
        return self.anchor_ms + ((after_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms


Rule = Cron | Every


def rule_of(spec: Any, tz: str = "UTC", anchor_ms: int = 0) -> Rule:
    """The rule of a ``beat_schedule`` entry's ``schedule``: a ``crontab`` (evaluated in ``tz``, an IANA
    zone: the app's ``timezone``), a ``schedule``, a ``timedelta`` or a number of seconds (intervals
    from ``anchor_ms``).  ``solar`` and other classes are refused."""
    if isinstance(spec, solar):
        raise ValueError("solar schedules are not supported by celery-delayed's recurring schedules")
    if isinstance(spec, crontab):
        ZoneInfo(tz)  # an unknown zone fails here, not at dispatch
        return Cron(frozenset(spec.minute), frozenset(spec.hour), frozenset(spec.day_of_month),
                    frozenset(spec.month_of_year), frozenset(spec.day_of_week), tz)
    if isinstance(spec, schedule):
        spec = spec.run_every
    seconds = spec.total_seconds() if isinstance(spec, timedelta) else spec
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0.001:
        raise ValueError(f"a schedule must be a crontab, a schedule, a timedelta or seconds >= 0.001, got {spec!r}")
    return Every(round(seconds * 1000), anchor_ms)


def rule_data(rule: Rule) -> dict[str, Any]:
    """The plain data a rule is stored as."""
    if isinstance(rule, Cron):
        return {"cron": rule.spec(), "tz": rule.tz}
    return {"every_ms": rule.every_ms, "anchor_ms": rule.anchor_ms}


def rule_from_data(data: dict[str, Any]) -> Rule:
    """The rule :func:`rule_data` stored.  A crontab's is parsed once per (spec, zone) (:func:`_cron`):
    parsing one (Celery's ``crontab``) was a fifth of a poller's work per occurrence."""
    if "cron" in data:
        return _cron(data["cron"], data["tz"])
    return Every(int(data["every_ms"]), int(data["anchor_ms"]))


@functools.lru_cache(maxsize=1024)
def _cron(spec: str, tz: str) -> Rule:
    """The rule of a stored crontab spec in zone ``tz`` (a rule is immutable: one is shared)."""
    return rule_of(crontab.from_string(spec), tz)


@functools.lru_cache(maxsize=4096)
def _cron_next_after(rule: Cron, after_ms: int) -> int:
    """:meth:`Cron.next_after`, memoized (an error, a rule matching no time, is raised each time)."""
    return rule._next_after(after_ms)


def _instant(wall: datetime, zone: ZoneInfo) -> int:
    """The instant (ms) a wall time names in ``zone``: the first one when it is repeated, the end of
    the gap when a spring-forward skips it."""
    first = wall.replace(tzinfo=zone, fold=0)
    utc = first.astimezone(timezone.utc)
    if utc.astimezone(zone).replace(tzinfo=None) == wall:
        return _ms(utc)
    # in a gap: fold=0 reads it with the offset before (an instant after the transition), fold=1 with the
    # one after (an instant before it); the transition is the first second between them on the new offset
    lo, hi = _ms(wall.replace(tzinfo=zone, fold=1).astimezone(timezone.utc)) // 1000, _ms(utc) // 1000
    before = first.utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == before:
            lo = mid
        else:
            hi = mid
    return hi * 1000


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _ms(when: datetime) -> int:
    return int((when - _EPOCH) // timedelta(milliseconds=1))

