"""A schedule's options and what they decide, pure (no clock, no Redis): when its chain starts and
ends, each occurrence's jitter, and whether a late occurrence runs and where the chain goes on.

An occurrence is *missed* when it is dispatched more than a grace after its due time (its nominal time
plus its jitter): every poller down, or the schedule paused.  The grace (:func:`grace_ms`) covers what
a poller's crash and failover delay an occurrence by, so an occurrence late only by that still runs.
The misfire policy then says what runs:

- ``once`` (default, as ``celery beat`` and the first release): the late occurrence runs, once for all
  the missed times; the chain goes on at the next time after now.  So no occurrence is ever dropped
  for being late: not even when a poller's replacement takes longer than the grace to come up;
- ``skip``: a missed occurrence does not run; the chain goes on at the next time after now;
- ``all``: each time within the ``catch_up`` window before now runs, one after the other (the chain
  goes on from the occurrence, or from the window's start); older times are missed.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from celery_delayed.recurring.rules import Every, Rule
from celery_delayed.settings import Settings
from celery_delayed.store.layout import MAX_DUE_MS

MISFIRE_POLICIES = ("skip", "once", "all")
#: Most missed times counted one by one for a crontab (an interval's are counted by arithmetic).
COUNT_LIMIT = 100_000


@dataclass(frozen=True)
class Options:
    """A schedule's options: its first and last instants (ms, None: unbounded), its jitter (ms), misfire
    policy and catch-up window (ms), and whether an occurrence may start while the previous one runs."""

    start_ms: int | None = None
    end_ms: int | None = None
    jitter_ms: int = 0
    misfire: str = "once"
    catch_up_ms: int = 0
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.misfire not in MISFIRE_POLICIES:
            raise ValueError(f"misfire must be one of {', '.join(MISFIRE_POLICIES)}, got {self.misfire!r}")
        if self.misfire == "all" and self.catch_up_ms <= 0:
            raise ValueError("misfire='all' needs a catch_up window (seconds > 0)")
        if not 0 <= self.jitter_ms < MAX_DUE_MS or not 0 <= self.catch_up_ms < MAX_DUE_MS:
            raise ValueError("jitter and catch_up must be >= 0 and less than the store's range (2106)")
        if not all(0 <= ms < MAX_DUE_MS for ms in (self.start_ms, self.end_ms) if ms is not None):
            raise ValueError("a schedule's start and end must be between 1970 and 2106")
        if None not in (self.start_ms, self.end_ms) and self.end_ms <= self.start_ms:  # type: ignore[operator]
            raise ValueError("a schedule's end must be after its start")

    def data(self) -> dict[str, Any]:
        """The options that are not defaults, as stored (a schedule with none stores nothing)."""
        default = Options()
        return {name: value for name, value in asdict(self).items() if value != getattr(default, name)}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Options:
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in known})

    def first(self, rule: Rule, now_ms: int) -> int | None:
        """The first nominal time of a chain started at ``now_ms``; None when it is past the end."""
        return self.within(rule.next_after(max(now_ms, (self.start_ms or 0) - 1)))

    def within(self, nominal_ms: int) -> int | None:
        """``nominal_ms``, or None when it is past the end."""
        return None if self.end_ms is not None and nominal_ms > self.end_ms else nominal_ms

    def due_ms(self, schedule_id: str, nominal_ms: int) -> int:
        """When the occurrence at ``nominal_ms`` is due: its time plus a jitter derived from (schedule id,
        nominal time), so a copy written or dispatched again is due at the same time."""
        if not self.jitter_ms:
            return nominal_ms
        # the id's characters, not its format (as occurrence_id)
        digest = hashlib.blake2b((schedule_id + f"\0{nominal_ms}").encode(), digest_size=8).digest()
        return nominal_ms + int.from_bytes(digest, "big") % (self.jitter_ms + 1)

    def misfire_of(self, rule: Rule, schedule_id: str, nominal_ms: int, now_ms: int, grace: int) -> Misfire:
        """What the occurrence at ``nominal_ms``, dispatched at ``now_ms``, does by the misfire policy."""
        missed = now_ms - self.due_ms(schedule_id, nominal_ms) > grace
        if self.misfire == "all":
            floor = now_ms - self.catch_up_ms
            runs, after = nominal_ms >= floor or not missed, max(nominal_ms, floor)
        else:
            runs, after = self.misfire == "once" or not missed, max(nominal_ms, now_ms)
        return Misfire(runs, after, count_between(rule, nominal_ms, after) + (0 if runs else 1))


@dataclass(frozen=True)
class Misfire:
    """Whether an occurrence runs, the instant its successor is the rule's next time after, and how many
    of the schedule's times (the occurrence's own included) are missed: never run."""

    runs: bool
    after_ms: int
    missed: int


def count_between(rule: Rule, after_ms: int, until_ms: int) -> int:
    """How many of the rule's times are in (``after_ms``, ``until_ms``] (a crontab's: at most
    :data:`COUNT_LIMIT`)."""
    if until_ms <= after_ms:
        return 0
    if isinstance(rule, Every):
        last, before = (until_ms - rule.anchor_ms) // rule.every_ms, (after_ms - rule.anchor_ms) // rule.every_ms
        return max(0, last - max(-1, before))
    count, at = 0, rule.next_after(after_ms)
    while at <= until_ms and count < COUNT_LIMIT:
        count, at = count + 1, rule.next_after(at)
    return count


def grace_ms(settings: Settings) -> int:
    """How late an occurrence may be dispatched and still not be missed: what a poller killed while
    dispatching it delays it by (the visibility timeout, a failover of its partition's leader, a sweep)."""
    return int((settings.visibility_timeout + 2 * settings.lease_ttl + settings.max_sleep) * 1000)
