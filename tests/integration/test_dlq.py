"""The dead-letter queue's operator side on the real Redis: read, requeue, purge, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from celery_delayed import store_of
from celery_delayed.envelope import Envelope
from celery_delayed.settings import Settings
from celery_delayed.store import dlq as dlq_module
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetterError, DeadLetters
from celery_delayed.store.records import remember_revoked
from tasks import create_app

from .support import ROOT, envelopes, environment, wait_for


GARBAGE = b"\x80not an envelope"
pytestmark = pytest.mark.cluster_too

TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'tasks.demo.add'"


@pytest.fixture
def letters(overrides) -> DeadLetters:
    return DeadLetters(DelayedStore(Settings.from_conf(overrides)))


def park(letters: DeadLetters, n: int, prefix: str = "task") -> dict[str, bytes]:
    """Park ``n`` valid ``tasks.demo.add`` messages as the worker would; task id -> message."""
    parked = {}
    for task_id, _, data in envelopes(n, "q", 0, prefix=prefix):
        letters.add(DeadLetter(task_id=task_id, reason="unknown task 'tasks.demo.add'", source="worker",
                               traceback=TRACEBACK, attempts=1, message=data))
        parked[task_id] = data
    return parked


def park_garbage(letters: DeadLetters, task_id: str = "poison") -> None:
    letters.add(DeadLetter(task_id=task_id, reason="undecodable stored message", source="poller", message=GARBAGE))


def redis_now_ms(store: DelayedStore) -> int:
    seconds, micros = store.redis.time()
    return seconds * 1000 + micros // 1000


class RecordingBackend:
    """A result backend that notes each forget, and whether the store already held the task then."""

    def __init__(self, store: DelayedStore) -> None:
        self.store = store
        self.forgotten: list[tuple[str, bool]] = []

    def forget(self, task_id: str) -> None:
        self.forgotten.append((task_id, self.store.get(task_id) is not None))


def dlq(overrides: dict, *args: str, answer: str = "") -> subprocess.CompletedProcess:
    """``celery -A tasks delayed dlq ARGS`` as an operator runs it, with ``answer`` on stdin."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "delayed", "dlq", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, input=answer,
                          env={**environment(overrides), "COLUMNS": "200"})


# -- the library ---------------------------------------------------------------
def test_add_list_get_count(letters):
    parked = park(letters, 3)
    time.sleep(0.01)  # the index is by Redis time in ms: the garbage is the newest
    park_garbage(letters)
    assert letters.count() == 4
    assert [x.task_id for x in letters.list()][0] == "poison"
    assert {x.task_id for x in letters.list()} == {*parked, "poison"}
    assert len(letters.list(limit=2)) == 2
    got = letters.get("task-1")
    assert (got.reason, got.source, got.traceback, got.attempts, got.message) == (
        "unknown task 'tasks.demo.add'", "worker", TRACEBACK, 1, parked["task-1"])
    assert abs(got.timestamp - time.time()) < 60
    assert letters.get("nope") is None


def test_requeue_schedules_the_same_id_and_bytes_due_now_then_drops_the_record(letters):
    parked = park(letters, 2)
    store = letters.store
    backend = RecordingBackend(store)
    remember_revoked(store, ["task-0"])  # an operator's requeue overrides an earlier revoke
    records = [store.keys.task(kind, "task-0") for kind in ("revoked", "done")]
    store.redis.set(records[1], 1)
    before = redis_now_ms(store)
    assert letters.requeue("task-0", backend) is True
    assert not any(store.redis.exists(key) for key in records)  # nothing left to make a worker skip it
    entry = store.get("task-0")
    assert entry["state"] == "scheduled" and entry["task"] == "tasks.demo.add"
    assert before <= entry["due_ms"] <= redis_now_ms(store)
    assert store.message("task-0") == parked["task-0"]
    assert backend.forgotten == [("task-0", False)]  # forgotten before it could run again
    assert letters.get("task-0") is None and letters.count() == 1
    assert letters.requeue("task-0", backend) is False  # gone: nothing more to do
    assert letters.requeue("task-1") is True  # without a result backend


def test_requeue_of_an_undecodable_message_raises_and_keeps_the_record(letters):
    park_garbage(letters)
    with pytest.raises(DeadLetterError, match="dead letter poison cannot be requeued: its message is not a valid"):
        letters.requeue("poison")
    assert letters.get("poison").message == GARBAGE
    assert letters.store.get("poison") is None


def test_requeue_refuses_a_message_of_another_task(letters):
    (_, _, data), = envelopes(1, "q", 0)
    letters.add(DeadLetter(task_id="topic:17", reason="dispatch failed", source="worker", message=data))
    with pytest.raises(DeadLetterError, match="its message is task task-0"):
        letters.requeue("topic:17")
    assert letters.count() == 1 and letters.store.get("topic:17") is None


def test_requeue_of_a_task_still_scheduled_keeps_its_entry_and_drops_the_record(letters):
    park(letters, 1)
    later = redis_now_ms(letters.store) + 3_600_000
    letters.store.schedule_many(envelopes(1, "q", later))
    assert letters.requeue("task-0")
    assert letters.store.get("task-0")["due_ms"] == later
    assert letters.count() == 0


def test_a_requeue_before_the_ack_of_the_attempt_that_failed_is_not_undone_by_that_ack(letters):
    """Attempt 2 of a task (a retry) was claimed, sent, run, failed for good and parked, all
    before the poller that sent it (CPU-starved, stopped) acked its claim.  The requeue replaces
    that copy in flight, so the late ack removes nothing; stored as a first attempt, it was kept
    out by that copy, and the ack then left the task nowhere."""
    store = letters.store
    (task_id, _, data), = envelopes(1, "q", 0, prefix="late-ack")
    envelope = Envelope.decode(data)
    envelope.headers["retries"] = 2  # as the worker rebuilds the message of the attempt that failed
    data = envelope.encode()
    store.schedule(task_id, redis_now_ms(store) - 1, data, attempt=2)
    partition = store.partition(task_id)
    claim = store.claim(partition, token=1, limit=10)
    assert [item[0] for item in claim.items] == [task_id]
    letters.add(DeadLetter(task_id=task_id, reason="failed for good", source="worker", attempts=3, message=data))
    assert letters.requeue(task_id)
    store.ack(partition, [(task_id, claim.stamp)])  # the stalled poller wakes up
    entry = store.get(task_id)
    assert entry is not None and letters.get(task_id) is None, "the task is nowhere: not stored, not parked"
    assert entry["state"] == "scheduled" and store.message(task_id) == data


def test_requeue_keeps_a_newer_failure_parked_meanwhile(letters, monkeypatch):
    parked = park(letters, 1)
    schedule = letters.store.schedule_many

    def schedule_and_fail_again(items, **options):  # the rerun fails before requeue drops the record
        added = schedule(items, **options)
        letters.add(DeadLetter(task_id="task-0", reason="failed again", source="worker", message=parked["task-0"]))
        return added

    monkeypatch.setattr(letters.store, "schedule_many", schedule_and_fail_again)
    assert letters.requeue("task-0")
    assert letters.get("task-0").reason == "failed again"


def test_requeue_all_skips_what_cannot_run_and_reports_each(letters, monkeypatch):
    monkeypatch.setattr(dlq_module, "REQUEUE_CHUNK", 2)  # several rounds, garbage between them
    parked = park(letters, 3, prefix="a")
    park_garbage(letters, "poison-1")
    parked.update(park(letters, 2, prefix="b"))
    park_garbage(letters, "poison-2")
    reports: dict[str, DeadLetterError | None] = {}
    backend = RecordingBackend(letters.store)
    assert letters.requeue_all(backend, lambda task_id, error: reports.setdefault(task_id, error)) == 5
    assert {t for t, e in reports.items() if e is None} == set(parked)
    assert {t for t, e in reports.items() if e is not None} == {"poison-1", "poison-2"}
    assert all(letters.store.get(t)["state"] == "scheduled" for t in parked)
    assert {x.task_id for x in letters.list()} == {"poison-1", "poison-2"}
    assert sorted(t for t, _ in backend.forgotten) == sorted(parked)
    assert letters.requeue_all() == 0


def test_reading_every_letter_skips_none_when_letters_leave_or_arrive_meanwhile(letters, monkeypatch):
    """A requeue or purge of every matching letter reads the queue page by page, newest first: letters
    removed or parked between two pages shift nothing, each letter parked before is read once.  Pages
    of 7 among 60 letters parked a few per ms, so pages end inside letters of the same time."""
    monkeypatch.setattr(dlq_module, "REQUEUE_CHUNK", 7)
    parked = park(letters, 60)
    reading = letters._newest()
    seen = [next(reading).task_id for _ in range(10)]
    for task_id in seen[:5]:  # read already, as a requeue-all removes what it read
        assert letters.purge(task_id)
    park(letters, 3, prefix="late")
    seen += [letter.task_id for letter in reading]
    assert len(seen) == len(set(seen))
    assert sorted(t for t in seen if not t.startswith("late")) == sorted(parked)


def test_purge_one_and_all(letters):
    park(letters, 3)
    park_garbage(letters)
    assert letters.purge("poison") is True
    assert letters.purge("poison") is False
    assert letters.count() == 3 and letters.get("poison") is None
    assert letters.purge_all() == 3
    assert letters.count() == 0 and letters.store.redis.exists(*letters.keys) == 0
    assert letters.purge_all() == 0


def test_the_queue_keeps_its_newest_letters_within_max_entries(overrides):
    letters = DeadLetters(DelayedStore(Settings.from_conf(overrides, dlq_max_entries=5)))
    for i in range(8):
        park(letters, 1, prefix=f"t{i}")
        time.sleep(0.002)  # ordered by Redis time in ms
    assert letters.count() == 5
    assert {x.task_id for x in letters.list()} == {f"t{i}-0" for i in range(3, 8)}
    assert letters.store.redis.hlen(letters.keys[0]) == 5, "a trimmed letter left its record behind"


def test_letters_older_than_max_age_are_dropped_as_new_ones_arrive(overrides):
    letters = DeadLetters(DelayedStore(Settings.from_conf(overrides, dlq_max_age=1.0)))
    park(letters, 3, prefix="old")
    assert 0 <= letters.oldest_age() < 1.0
    time.sleep(1.2)
    park(letters, 1, prefix="new")
    assert [x.task_id for x in letters.list()] == ["new-0"]
    assert letters.store.redis.hlen(letters.keys[0]) == 1


def test_a_long_queue_is_trimmed_a_bounded_number_at_a_time(overrides, monkeypatch):
    monkeypatch.setattr(dlq_module, "TRIM_LIMIT", 3)
    park(DeadLetters(DelayedStore(Settings.from_conf(overrides))), 10)  # parked with no limit in force
    letters = DeadLetters(DelayedStore(Settings.from_conf(overrides, dlq_max_entries=2)))
    park(letters, 1, prefix="a")
    assert letters.count() == 11 - 3  # at most TRIM_LIMIT dropped per letter parked
    for i in range(3):
        park(letters, 1, prefix=f"b{i}")
    assert letters.count() == 2


# -- the CLI -------------------------------------------------------------------
def test_cli_list_and_show(overrides, letters):
    park(letters, 2)
    time.sleep(0.01)
    park_garbage(letters)

    done = dlq(overrides, "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["task_id"], r["task"], r["source"]) for r in rows][0] == ("poison", "?", "poller")
    assert {(r["task_id"], r["task"], r["attempts"]) for r in rows[1:]} == {
        ("task-0", "tasks.demo.add", 1), ("task-1", "tasks.demo.add", 1)}
    assert [r["task_id"] for r in json.loads(dlq(overrides, "list", "--json", "--limit", "1").stdout)] == ["poison"]

    done = dlq(overrides, "list")
    assert done.returncode == 0, done.stderr
    assert "3 of 3 dead letters" in done.stdout
    assert "task-0" in done.stdout and "tasks.demo.add" in done.stdout and "undecodable stored message" in done.stdout
    long_id = "eec5753c-bbb1-4bd0-9a3e-5f0c2d6b7a81"  # a uuid, as Celery's task ids are
    letters.add(DeadLetter(task_id=long_id, reason="unknown task 'tasks.demo.add'", source="worker"))
    done = dlq(overrides, "list")  # in a pipe, as `dlq list | grep`
    assert done.stdout.splitlines()[1].startswith(f"{long_id}  ?  worker  unknown task 'tasks.demo.add'"), done.stdout
    letters.purge(long_id)

    done = dlq(overrides, "show", "task-1")
    assert done.returncode == 0, done.stderr
    assert "KeyError: 'tasks.demo.add'" in done.stdout and '"argsrepr": "(1, 1)"' in done.stdout
    info = json.loads(dlq(overrides, "show", "task-1", "--json").stdout)
    assert (info["traceback"], info["headers"]["task"], info["queue"]) == (TRACEBACK, "tasks.demo.add", "q")
    info = json.loads(dlq(overrides, "show", "poison", "--json").stdout)
    assert info["message_error"] == "envelope has no meta line" and info["headers"] is None

    done = dlq(overrides, "show", "nope")
    assert done.returncode == 1 and "no dead letter with task id nope" in done.stderr


def test_cli_requeue(overrides, letters):
    park(letters, 3)
    park_garbage(letters)
    done = dlq(overrides, "requeue", "task-0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "requeued task-0"
    assert letters.store.get("task-0")["state"] == "scheduled" and letters.get("task-0") is None

    for task_id, why in (("task-0", "no dead letter with task id task-0"),
                         ("poison", "dead letter poison cannot be requeued: its message is not a valid envelope")):
        done = dlq(overrides, "requeue", task_id)
        assert done.returncode == 1 and why in done.stderr
    assert letters.get("poison") is not None
    assert dlq(overrides, "requeue", "task-1", "--all").returncode == 2
    assert dlq(overrides, "requeue").returncode == 2

    done = dlq(overrides, "requeue", "--all")
    assert done.returncode == 1  # one record could not be requeued...
    assert {"requeued task-1", "requeued task-2", "requeued 2 dead letters"} <= set(done.stdout.splitlines())
    assert "1 dead letters could not be requeued" in done.stderr and "poison" in done.stderr
    assert [x.task_id for x in letters.list()] == ["poison"]  # ...and stays
    assert all(letters.store.get(t) for t in ("task-1", "task-2"))


def test_cli_purge(overrides, letters):
    park(letters, 3)
    done = dlq(overrides, "purge", "task-0")
    assert done.returncode == 0 and done.stdout.strip() == "purged task-0"
    done = dlq(overrides, "purge", "task-0")
    assert done.returncode == 1 and "no dead letter with task id task-0" in done.stderr

    done = dlq(overrides, "purge", "--all", answer="n\n")
    assert done.returncode == 1 and "Purge all 2 dead letters?" in done.stdout
    assert letters.count() == 2
    done = dlq(overrides, "purge", "--all")  # no terminal to answer on
    assert done.returncode == 1
    assert "Error: nothing purged: pass --yes to purge every dead letter without asking" in done.stderr.splitlines()
    done = dlq(overrides, "purge", "--all", answer="y\n")
    assert done.returncode == 0 and "purged 2 dead letters" in done.stdout
    park(letters, 4)
    done = dlq(overrides, "purge", "--all", "--yes")
    assert done.returncode == 0 and done.stdout.strip() == "purged 4 dead letters"
    assert letters.count() == 0


# -- end to end ------------------------------------------------------------------
def test_requeued_dead_letter_runs_on_a_worker(overrides, processes):
    app = create_app(**overrides)
    letters = DeadLetters(store_of(app))
    *_, (task_id, _, data) = envelopes(4, overrides["task_default_queue"], 0, prefix=overrides["delayed_key_prefix"])
    letters.add(DeadLetter(task_id=task_id, reason="unknown task 'tasks.demo.add'", source="worker", message=data))
    app.backend.store_result(task_id, 999, "SUCCESS")  # an old result the rerun must not be mistaken for

    done = dlq(overrides, "requeue", task_id)
    assert done.returncode == 0, done.stderr
    assert app.backend.get_task_meta(task_id)["status"] == "PENDING"
    processes.poller()
    processes.worker()
    assert app.AsyncResult(task_id).get(timeout=60) == 6  # add(3, 3)
    assert letters.count() == 0


def test_task_failing_for_good_is_parked_and_requeue_runs_it_again(overrides, processes):
    app = create_app(**overrides)
    run = uuid.uuid4().hex
    # flaky(run, failures=9, countdown=0.2) exhausts its 5 retries (the quick ones take Celery's normal path).
    result = app.tasks["tasks.demo.flaky"].apply_async((run, 9, 0.2), countdown=1.5)
    processes.poller()
    processes.worker("w1")
    letters = DeadLetters(app.amqp.delayed_store)
    letter = wait_for(lambda: letters.get(result.id), 90, "the failed task in the dead-letter queue")
    assert letter.source == "worker" and letter.attempts == 6
    assert "RuntimeError: attempt 6 failed" in letter.reason and "Traceback" in letter.traceback
    described = letter.describe()
    assert described["task"] == "tasks.demo.flaky" and described["queue"] == overrides["task_default_queue"]
    assert described["headers"]["retries"] == 5

    # Requeued as it last ran (retries exhausted): it runs once more under the same id, fails, and is parked again.
    assert letters.requeue(result.id, app.backend)
    wait_for(lambda: (lambda d: d is not None and d.timestamp > letter.timestamp)(letters.get(result.id)),
             90, "the requeued task to run (and fail) again under the same id")
    runs = store_of(app).redis.hget(f"demo:{run}:runs", result.id)
    assert int(runs) == 7
