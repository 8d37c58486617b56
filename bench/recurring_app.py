"""The recurring benchmark's ``celery beat`` app (``celery -A bench.recurring_app beat -S ...``): N
``beat_schedule`` entries, and beat's schedulers recording what they send (bench.recurring).

``RECURRING_N`` entries ``s<i>`` each run ``recurring.noop(i)`` by ``crontab(minute=...)`` as
:func:`minutes_of` gives (every minute, or spread over ``RECURRING_SPREAD`` minutes), sent to the Redis
broker ``RECURRING_BROKER``; RedBeat keeps its entries in ``RECURRING_REDBEAT``.  Each send is appended
to ``RECURRING_SENDS`` as ``<i> <nominal ms> <sent ms>``: the nominal time is the first time of the
entry's crontab after its last run (beat's own notion of when it is due; ``-`` for a RedBeat entry that
never ran, which RedBeat sends at once), the sent time when ``apply_async`` returned (the broker has it).
A line ``ready <ms>`` is written once the scheduler has set its schedule up.
"""
from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import crontab

#: Minute of the hour of each of the 60 / spread runs of an entry (``spread`` divides 60).
MINUTE = "{}-59/{}"


def minutes_of(index: int, spread: int) -> str:
    """The ``crontab(minute=...)`` of entry ``index``: every minute, or every ``spread`` minutes from
    minute ``index % spread`` (N entries spread evenly over ``spread`` minutes)."""
    return "*" if spread == 1 else MINUTE.format(index % spread, spread)


def create_app() -> Celery:
    app = Celery("recurring_bench", set_as_current=False)
    n, spread = int(os.environ.get("RECURRING_N", "0")), int(os.environ.get("RECURRING_SPREAD", "1"))
    app.conf.update(broker_url=os.environ.get("RECURRING_BROKER", "memory://"), timezone="UTC",
                    task_ignore_result=True, redbeat_redis_url=os.environ.get("RECURRING_REDBEAT"),
                    redbeat_key_prefix="rbbench",
                    beat_schedule={f"s{i}": {"task": "recurring.noop", "args": (i,),
                                             "schedule": crontab(minute=minutes_of(i, spread))} for i in range(n)})
    app.task(name="recurring.noop")(noop)
    return app


def noop(index: int) -> None:
    """What each entry runs (no worker runs it here: the benchmark measures the sends)."""


class Recording:
    """Mixed into a beat scheduler: each send appended to ``RECURRING_SENDS`` (see the module)."""

    _sends: Any = None

    def setup_schedule(self) -> None:
        super().setup_schedule()  # type: ignore[misc]
        self._record(f"ready {time.time() * 1000:.0f}")

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        last = entry.last_run_at
        nominal = "-" if last is None else round(entry.schedule.now().timestamp() + _remaining_s(entry)) * 1000
        result = super().apply_async(entry, producer, advance, **kwargs)  # type: ignore[misc]
        self._record(f"{entry.name[1:]} {nominal} {time.time() * 1000:.0f}")
        return result

    def _record(self, line: str) -> None:
        if self._sends is None:
            self._sends = open(os.environ["RECURRING_SENDS"], "a", buffering=1)  # noqa: SIM115 (for the process's life)
        self._sends.write(line + "\n")


def _remaining_s(entry: Any) -> float:
    """Seconds from now to the first time of the entry's crontab after its last run (negative: overdue;
    rounded by the caller to the whole second a crontab time is: two clock reads apart)."""
    return entry.schedule.remaining_estimate(entry.last_run_at).total_seconds()


class RecordingPersistentScheduler(Recording, PersistentScheduler):
    """``celery beat``'s default scheduler (a shelve file), recording its sends."""


def _redbeat() -> type:
    from redbeat import RedBeatScheduler  # installed by the dev extra; only the redbeat run imports it

    return type("RecordingRedBeatScheduler", (Recording, RedBeatScheduler), {})


app = create_app()
if os.environ.get("RECURRING_SYSTEM") == "redbeat":
    RecordingRedBeatScheduler = _redbeat()
