"""``celery -A tasks delayed status|show|cancel|upcoming`` as a user runs them (real subprocesses)."""
from __future__ import annotations

import json
import time

import pytest
from celery import states

from celery_delayed import store_of
from tasks import create_app

from .support import envelopes
from .test_cli import celery

pytestmark = pytest.mark.cluster_too


def now_ms() -> int:
    return int(time.time() * 1000)


def test_status_shows_overdue_tasks_their_age_and_the_next_due_time(overrides):
    store = store_of(create_app(**overrides))
    now = now_ms()
    store.schedule_many(envelopes(3, "q", now - 90_000, prefix="late"))
    store.schedule_many(envelopes(2, "q", now + 600_000, prefix="later"))

    rows = json.loads(celery(overrides, "delayed", "status", "--json").stdout)["partitions"]
    assert sum(r["overdue"] for r in rows) == 3 and sum(r["scheduled"] for r in rows) == 5
    assert 89 < max(r["oldest_overdue_s"] or 0 for r in rows) < 120
    assert min(r["upcoming_due_ms"] or 1 << 62 for r in rows) == now + 600_000

    done = celery(overrides, "delayed", "status")
    assert done.returncode == 0, done.stderr
    total = next(line for line in done.stdout.splitlines() if "all" in line)
    assert [cell.strip() for cell in total.split("│")[1:7]] == ["all", "5", "0", "3", "0", "1m"]
    assert "in 9m" in total


def test_show_cancel_and_upcoming(overrides):
    app = create_app(**overrides)
    add = app.tasks["tasks.demo.add"]
    first = add.apply_async((1, 2), countdown=600)
    second = add.apply_async((3, 4), countdown=1200)

    shown = json.loads(celery(overrides, "delayed", "show", first.id, "--json").stdout)
    queue = app.conf.task_default_queue
    assert (shown["task"], shown["state"], shown["queue"]) == ("tasks.demo.add", "scheduled", queue)
    assert shown["headers"]["argsrepr"] == "(1, 2)"
    human = celery(overrides, "delayed", "show", first.id).stdout
    assert "tasks.demo.add" in human and "in 9m" in human

    page = json.loads(celery(overrides, "delayed", "upcoming", "--limit", "1", "--json").stdout)
    assert [i["task_id"] for i in page["items"]] == [first.id] and page["cursor"]
    rest = json.loads(celery(overrides, "delayed", "upcoming", "--after", page["cursor"], "--json").stdout)
    assert [i["task_id"] for i in rest["items"]] == [second.id] and rest["cursor"] is None
    listed = celery(overrides, "delayed", "upcoming", "--limit", "1")
    line, more = listed.stdout.splitlines()
    assert f"{first.id}  tasks.demo.add  queue={queue}" in line and "in 9m" in line
    assert more == f"next page: --after {page['cursor']}"

    done = celery(overrides, "delayed", "cancel", first.id)
    assert done.returncode == 0 and done.stdout.strip() == f"cancelled {first.id}"
    assert store_of(app).get(first.id) is None
    assert app.backend.get_task_meta(first.id)["status"] == states.REVOKED

    shown = celery(overrides, "delayed", "show", first.id)
    assert shown.returncode == 1 and f"task {first.id} was cancelled or revoked: it will not run" in shown.stderr
    missing = celery(overrides, "delayed", "cancel", first.id)
    assert missing.returncode == 1 and f"no scheduled task with id {first.id}" in missing.stderr
    bad = celery(overrides, "delayed", "upcoming", "--after", "nonsense")
    assert bad.returncode == 1 and "not a cursor of upcoming()" in bad.stderr


def test_an_unreachable_store_is_a_one_line_error(overrides):
    for command in (["status"], ["upcoming"], ["dlq", "list"], ["dlq", "show", "x"], ["dlq", "purge", "x"]):
        done = celery(overrides, "delayed", *command, DELAYED_REDIS_URL="redis://127.0.0.1:1/0")
        assert done.returncode == 1, command
        assert "delayed store at redis://127.0.0.1:1/0 unavailable" in done.stderr, (command, done.stderr)
        assert "Traceback" not in done.stderr, command


def test_bulk_cancel_by_filter_counts_asks_and_cancels_only_the_matches(overrides):
    store = store_of(create_app(**overrides))
    now = now_ms()
    store.schedule_many(envelopes(30, "q", now + 120_000, prefix="soon", task="app.report"))
    store.schedule_many(envelopes(20, "q", now + 3_600_000, prefix="late", task="app.report"))
    store.schedule_many(envelopes(10, "q", now + 120_000, prefix="other", task="app.bill"))
    selected = ("--task", "app.report", "--due-before", "now+10m")

    done = celery(overrides, "delayed", "cancel", *selected, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "30 scheduled tasks match task=app.report" in done.stdout and "nothing changed" in done.stdout
    done = celery(overrides, "delayed", "cancel", *selected, stdin="n\n")
    assert done.returncode == 1 and "This will cancel 30 scheduled tasks" in done.stdout
    assert sum(r["scheduled"] for r in store.counts()) == 60

    done = celery(overrides, "delayed", "cancel", *selected, "--yes")
    assert done.returncode == 0, done.stderr
    assert "cancelled 30, dispatching 0" in done.stdout
    assert store.get("soon-0") is None and store.get("late-0") and store.get("other-0")
    assert create_app(**overrides).AsyncResult("soon-7").state == states.REVOKED

    done = celery(overrides, "delayed", "cancel", "late-0", "--task", "app.report")
    assert done.returncode == 2 and "not several" in done.stderr


def test_reschedule_one_task_or_every_match_of_a_filter(overrides):
    store = store_of(create_app(**overrides))
    now = now_ms()
    store.schedule_many(envelopes(5, "mail", now + 120_000, prefix="mail"))
    store.schedule_many(envelopes(5, "web", now + 120_000, prefix="web"))

    done = celery(overrides, "delayed", "reschedule", "mail-0", "--eta", "2031-01-02T03:04:05")
    assert done.returncode == 0, done.stderr
    assert store.get("mail-0")["eta"] == "2031-01-02T03:04:05.000+00:00"
    done = celery(overrides, "delayed", "reschedule", "--queue", "web", "--shift", "1h", "-y")
    assert done.returncode == 0 and "moved 5, dispatching 0" in done.stdout, done.stderr
    assert store.get("web-3")["due_ms"] == now + 120_000 + 3_600_000 and store.get("mail-3")["due_ms"] == now + 120_000
    done = celery(overrides, "delayed", "reschedule", "--queue", "web")
    assert done.returncode == 2 and "give --eta or --shift" in done.stderr
    done = celery(overrides, "delayed", "reschedule", "nope", "--shift", "10m")
    assert done.returncode == 1 and "no scheduled task with id nope" in done.stderr
