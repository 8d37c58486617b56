"""Recurring schedules' options, pure: start and end, deterministic jitter, and what each misfire policy
runs of a late occurrence (fixed clocks, no servers)."""
from __future__ import annotations

import base64
import json
from dataclasses import replace

import pytest
from celery.schedules import crontab

from celery_delayed.envelope import Envelope
from celery_delayed.recurring.definitions import Definition, UnreadableDefinition
from celery_delayed.recurring.occurrences import TEMPLATE_ID
from celery_delayed.recurring.policy import Misfire, Options, count_between
from celery_delayed.recurring.rules import Every, rule_of

EVERY_2S = Every(2000)
GRACE = 5000


def test_a_late_occurrence_within_the_grace_runs_whatever_the_policy():
    """A poller's crash delays an occurrence by up to the grace: it still runs, the chain goes on."""
    for options in (Options(misfire="skip"), Options(), Options(misfire="all", catch_up_ms=1000)):
        assert options.misfire_of(EVERY_2S, "s", 10_000, 14_000, GRACE).runs


@pytest.mark.parametrize("options, expected", [
    # skip: the missed occurrence and the times after it never run; the chain goes on after now
    (Options(misfire="skip"), Misfire(runs=False, after_ms=30_500, missed=11)),
    # once (the default): the late occurrence runs, for all of them; the chain goes on after now
    (Options(), Misfire(runs=True, after_ms=30_500, missed=10)),
    # all: each time within the window (after 22_500) runs; 10 s to 22 s are older: missed
    (Options(misfire="all", catch_up_ms=8000), Misfire(runs=False, after_ms=22_500, missed=7)),
    (Options(misfire="all", catch_up_ms=60_000), Misfire(runs=True, after_ms=10_000, missed=0)),
])
def test_after_an_outage_each_policy_runs_what_it_promises(options, expected):
    """The occurrence at 10 s (every 2 s) dispatched at 30.5 s: 10 s, 12 s, ... 30 s are late."""
    assert options.misfire_of(EVERY_2S, "s", 10_000, 30_500, GRACE) == expected


def test_all_replays_each_missed_time_of_the_window_one_after_the_other():
    options, now, nominal, ran = Options(misfire="all", catch_up_ms=8000), 30_500, 10_000, []
    while nominal <= now:
        misfire = options.misfire_of(EVERY_2S, "s", nominal, now, GRACE)
        ran += [nominal] if misfire.runs else []
        nominal = EVERY_2S.next_after(misfire.after_ms)
    assert ran == [24_000, 26_000, 28_000, 30_000]


def test_start_and_end_bound_the_chain():
    options = Options(start_ms=9_000, end_ms=20_000)
    assert options.first(EVERY_2S, 1_000) == 10_000
    assert options.first(EVERY_2S, 10_000) == 12_000
    assert Options(start_ms=10_000).first(EVERY_2S, 1_000) == 10_000  # the start itself, on the rule
    assert options.within(20_000) == 20_000 and options.within(22_000) is None
    assert options.first(EVERY_2S, 20_000) is None


def test_jitter_is_derived_from_the_schedule_and_time_so_a_copy_is_due_at_the_same_time():
    options = Options(jitter_ms=1000)
    dues = [options.due_ms("s", n) for n in range(0, 200_000, 2000)]
    assert dues == [options.due_ms("s", n) for n in range(0, 200_000, 2000)]
    offsets = [due - n for due, n in zip(dues, range(0, 200_000, 2000))]
    assert all(0 <= o <= 1000 for o in offsets) and len(set(offsets)) > 50
    assert options.due_ms("t", 0) != options.due_ms("s", 0) or options.due_ms("t", 2000) != dues[1]
    assert Options().due_ms("s", 2000) == 2000


def test_missed_times_are_counted_by_arithmetic_for_intervals_and_one_by_one_for_crontabs():
    assert count_between(EVERY_2S, 10_000, 30_500) == 10
    assert count_between(Every(2000, anchor_ms=5000), 0, 9_000) == 3  # 5 s, 7 s, 9 s
    assert count_between(EVERY_2S, 30_000, 10_000) == 0
    hourly = rule_of(crontab(minute=0), "Europe/Paris")
    assert count_between(hourly, 0, 24 * 3600_000) == 24


@pytest.mark.parametrize("bad, message", [
    ({"misfire": "sometimes"}, "misfire must be one of skip, once, all"),
    ({"misfire": "all"}, "misfire='all' needs a catch_up window"),
    ({"jitter_ms": -1}, "jitter and catch_up must be >= 0"),
    ({"start_ms": 10, "end_ms": 10}, "end must be after its start"),
])
def test_bad_options_are_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message):
        Options(**bad)


def test_only_options_that_are_not_defaults_are_stored():
    assert Options().data() == {}
    options = Options(misfire="all", catch_up_ms=60_000, overlap=False)
    assert options.data() == {"misfire": "all", "catch_up_ms": 60_000, "overlap": False}
    assert Options(misfire="skip").data() == {"misfire": "skip"}
    assert Options.of(options.data()) == options


def test_a_definition_stores_its_options_and_states_only_when_not_defaults():
    """Redis bytes per schedule: a plain schedule stores no option, pause or last-run field."""
    template = Envelope(task_id="t", queue="q", headers={"task": "tasks.demo.add"}, body=b"[[], {}, {}]",
                        content_type="application/json", content_encoding="utf-8").encode()
    plain = Definition("s", {"every_ms": 1000, "anchor_ms": 0}, template, "api", 1, 5000)
    head, _, stored_template = plain.encode().partition(b"\n")
    assert json.loads(head) == [1, 5000, {"every_ms": 1000, "anchor_ms": 0}, "api"]
    ended = replace(plain, pending_ms=None, options={"misfire": "once"}, paused=True, last_ms=4000)
    assert Definition.decode("s", ended.encode()) == ended and ended.pending_id is None
    first = {"rule": plain.rule, "template": base64.b64encode(template).decode(), "origin": "api", "version": 1,
             "pending_ms": 5000}
    for corrupt in (b'{"rule":', b"[1, 2]", b"[1, 5000]\n" + stored_template,
                    json.dumps({**first, "template": None}).encode(),
                    head.replace(b'"api"', b'"api",{"options":{"misfire":"never"}}') + b"\n" + stored_template,
                    head.replace(b"5000", b'"abc"') + b"\n" + stored_template,
                    head + b"\n\x02damaged"):
        with pytest.raises(UnreadableDefinition, match="recurring schedule 's' is unreadable in the store"):
            Definition.decode("s", corrupt)


def test_a_definition_stores_its_template_deflated_and_reads_the_first_format_too():
    """The template as stored tasks are (deflated: a fraction of its base64), and a definition written
    by the first release (one JSON object, the template in base64) still reads the same."""
    template = Envelope(task_id=TEMPLATE_ID, queue="celery", headers={"task": "tasks.digest", "argsrepr": "(42,)"},
                        body=b'[[42], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]',
                        content_type="application/json", content_encoding="utf-8").encode()
    definition = Definition("s", {"cron": "0 7 * * *", "tz": "Europe/Paris"}, template, "api", 3, 5000,
                            {"misfire": "skip"}, last_ms=4000)
    stored = definition.encode()
    assert len(stored) < len(template) and Definition.decode("s", stored) == definition
    first = json.dumps({"rule": definition.rule, "template": base64.b64encode(template).decode(), "origin": "api",
                        "version": 3, "pending_ms": 5000, "options": {"misfire": "skip"}, "last_ms": 4000})
    assert Definition.decode("s", first.encode()) == definition
