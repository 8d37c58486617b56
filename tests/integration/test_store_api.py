"""The public store API on the real Redis: bulk scheduling, cancel, reschedule, get, upcoming, counts."""
from __future__ import annotations

import time
import uuid
from unittest.mock import Mock
from datetime import datetime, timezone

import pytest
import redis

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.inspection import MAX_PAGE
from celery_delayed.store.layout import member_of, parse_stored
from celery_delayed.store.outcomes import Change, Stored, TaskInFlight, TaskNotScheduled

from .support import envelopes, wait_for_wake_up


pytestmark = pytest.mark.cluster_too


@pytest.fixture
def store(overrides) -> DelayedStore:
    yield DelayedStore(Settings.from_conf(overrides))


def now_ms() -> int:
    return int(time.time() * 1000)


def test_schedule_many_streams_a_generator_with_progress_and_keeps_first_copies(store):
    n = 25_000
    seen: list[int] = []
    due = now_ms() + 3_600_000
    assert store.schedule_many(envelopes(n, "q", due), progress=seen.append) == n
    assert sum(seen) == n and len(seen) == -(-n // 4000)
    assert sum(r["scheduled"] for r in store.counts()) == n
    assert store.schedule_many(envelopes(10, "q", due + 5)) == 0  # same ids: the first copy stays
    assert store.get("task-3")["due_ms"] == due
    (_, _, first), (_, _, second) = envelopes(2, "q", 0, prefix="dup")
    assert store.schedule_many([("dup", due, first), ("dup", due + 9, second), ("dup", due + 7, second)]) == 1
    assert store.get("dup")["due_ms"] == due and store.message("dup") == first


def test_an_item_with_its_queue_is_stored_in_that_queue_lane_as_one_without(store):
    due = now_ms() + 3_600_000
    items = list(envelopes(4, "q", due))
    store.schedule_many([*items[:2], *((*item, "q") for item in items[2:])])
    assert [(row["queue"], row["next_due_ms"]) for row in store.queues()] == [("q", due)]
    assert all(store.get(task_id)["queue"] == "q" for task_id, _, _ in items)
    assert len({parse_stored(store.redis.hget(store.keys.msgs(store.partition(task_id)), member_of(task_id)))[:2]
                for task_id, _, _ in items}) == 1  # the same bucket start and lane
    with pytest.raises(ValueError, match=r"item 1 \(task-1\): queue must be a str, got int"):
        store.schedule_many([items[0], (*items[1], 7)])


def test_items_whose_queue_given_is_not_their_message_s_are_refused_not_stored_in_another_lane(store):
    """A fourth item that is not the message's queue put the task in that queue's lane, while it is
    dispatched to its message's: pausing its own queue did not hold it (nor a rate limit slow it, nor
    the counts show it there).  The first item of each batch giving a queue is checked: a caller
    giving a wrong one gives it to all."""
    due = now_ms() - 1000
    items = [(*item, "other") for item in envelopes(3, "q", due)]
    with pytest.raises(ValueError, match=r"item 0 \(task-0\): queue 'other' given, its message's is 'q'"):
        store.schedule_many(items)
    assert store.get("task-0") is None
    store.pause("q")
    assert store.claim(store.partition("task-0"), token=1, limit=10).items == []


def test_a_bad_item_stops_its_batch_before_anything_of_it_is_written(store):
    items = list(envelopes(4005, "q", now_ms() + 60_000))
    items[4003] = ("task-4003", "later", items[4003][2])
    with pytest.raises(ValueError, match=r"item 4003 \(task-4003\): due time must be ms"):
        store.schedule_many(items)
    assert sum(r["scheduled"] for r in store.counts()) == 4000  # the first batch, whole


def test_cancel_reschedule_and_get(store):
    due = now_ms() + 60_000
    store.schedule_many(envelopes(3, "q", due))
    info = store.get("task-0")
    assert (info["task"], info["queue"], info["state"], info["due_ms"]) == ("tasks.demo.add", "q", "scheduled", due)
    assert info["eta"] == datetime.fromtimestamp(due / 1000, timezone.utc).isoformat(timespec="milliseconds")
    assert info["headers"]["argsrepr"] == "(0, 0)" and info["partition"] == store.partition("task-0")

    later = datetime(2031, 1, 2, 3, 4, 5)  # naive: UTC, as Celery reads it
    assert store.reschedule("task-1", later) == int(later.replace(tzinfo=timezone.utc).timestamp() * 1000)
    assert store.get("task-1")["eta"] == "2031-01-02T03:04:05.000+00:00"

    assert store.cancel("task-0") is Change.DONE
    assert store.get("task-0") is None and store.cancel("task-0") is Change.UNKNOWN
    with pytest.raises(TaskNotScheduled, match="no scheduled task with id task-0"):
        store.reschedule("task-0", due)

    p = store.partition("task-2")
    store.reschedule("task-2", now_ms() - 10)
    claimed = store.claim(p, token=1, limit=10)
    assert [item[0] for item in claimed.items] == ["task-2"] and store.get("task-2")["state"] == "inflight"
    with pytest.raises(TaskInFlight, match="task task-2 is already being dispatched"):
        store.reschedule("task-2", due)
    assert store.cancel("task-2") is Change.IN_FLIGHT


def test_time_buckets_keep_due_order_and_every_task_findable_by_id(overrides):
    """Tasks spread over a dozen 10 s buckets of one partition (UUID ids, stored as 16 bytes):
    cancel, reschedule, claim, nack and an expired claim each leave the index exact."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1, visibility_timeout=1))
    now = now_ms()
    ids = [str(uuid.uuid4()) for _ in range(60)]
    dues = [now - 60_000 + 2000 * i for i in range(30)] + [now + 30_000 + 2000 * i for i in range(30)]
    store.schedule_many((task_id, due, data) for task_id, due, (_, _, data) in zip(ids, dues, envelopes(60, "q", 0)))
    buckets = store.keys.buckets(0, "q")  # the lane of queue q
    assert store.redis.zcard(buckets) >= 12 and store.redis.zscore(store.keys.lanes(0), "q") == dues[0]

    assert store.cancel(ids[0]) is Change.DONE and store.reschedule(ids[5], now + 3_600_000)
    assert store.counts()[0]["next_due_ms"] == dues[1]  # the index left the cancelled head behind
    claimed = store.claim(0, token=1, limit=100)
    overdue = [i for i in range(1, 30) if i != 5]
    assert [item[0] for item in claimed.items] == [ids[i] for i in overdue]
    assert [item[1] for item in claimed.items] == [dues[i] for i in overdue]
    assert claimed.next_due_ms == dues[30]

    assert store.nack(0, [(i, claimed.stamp) for i in ids[1:4]], delay_ms=0) == 3  # due now, in the bucket of now
    assert store.get(ids[1])["state"] == "scheduled" and store.get(ids[1])["due_ms"] >= claimed.now_ms
    assert store.cancel(ids[1]) is Change.DONE  # found through the bucket its nack recorded
    second = store.claim(0, token=1, limit=100)
    assert sorted(item[0] for item in second.items) == sorted(ids[2:4]) and second.stamp > claimed.stamp
    assert store.ack(0, [(i, claimed.stamp) for i in ids[2:4]]) == 0  # the first claim's stamp: not this copy
    assert store.ack(0, [(i, second.stamp) for i in ids[2:4]]) == 2

    time.sleep(1.2)  # the rest of the first claim outlives its visibility timeout
    again = store.claim(0, token=1, limit=100)
    assert sorted(item[0] for item in again.items) == sorted(ids[i] for i in overdue if i >= 4)
    assert store.ack(0, [(item[0], claimed.stamp) for item in again.items]) == 0  # a late ack of the old claim
    assert store.ack(0, [(item[0], again.stamp) for item in again.items]) == len(again.items)

    left = [ids[5]] + ids[30:]
    page = store.upcoming(100)
    assert [item["task_id"] for item in page.items] == left[1:] + left[:1] and page.cursor is None
    assert sum(r["scheduled"] for r in store.counts()) == len(left)
    for task_id in left:
        assert store.cancel(task_id) is Change.DONE
    assert store.redis.zcard(buckets) == 0 and store.redis.hlen(store.keys.msgs(0)) == 0
    assert store.redis.zcard(store.keys.lanes(0)) == 0  # the emptied lane is gone with its last task
    assert not list(store.redis.scan_iter(store.keys.bucket(0, "*", "q")))  # emptied buckets are gone, not left


def test_a_new_leader_takes_its_predecessors_copies_in_flight_at_once_not_after_the_visibility_timeout(overrides):
    """A leader killed between its claims and Kafka's confirmation never acks them: the next leader's
    first claims (a higher token) take them all back, a claim's limit at a time, each due no earlier
    than it was; the dead leader's late acks leave the new copies alone."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1, visibility_timeout=600, dispatch_lead=0.5))
    now = now_ms()
    ids = [str(uuid.uuid4()) for _ in range(25)]
    store.schedule_many((task_id, now - 1000 + i, data)
                        for i, (task_id, (_, _, data)) in enumerate(zip(ids, envelopes(25, "q", 0))))
    first = store.claim(0, token=5, limit=10)
    second = store.claim(0, token=5, limit=10)
    assert len(first.items) == len(second.items) == 10
    assert store.claim(0, token=5, limit=10).items[0][0] == ids[20]  # the same leader: in flight, not again
    assert store.claim(0, token=5, limit=10).items == []

    taken = [store.claim(0, token=6, limit=10) for _ in range(4)]  # the next leader, 10 a claim
    assert [len(claim.items) for claim in taken] == [10, 10, 5, 0]
    assert sorted(item[0] for claim in taken for item in claim.items) == sorted(ids)
    assert all(claim.now_ms <= due <= claim.now_ms + 500 for claim in taken for _, due, _ in claim.items)
    assert store.redis.get(store.keys.handover(0)) == b"0"  # all taken back
    assert store.ack(0, [(task_id, first.stamp) for task_id in ids]) == 0  # the dead leader's late acks
    assert store.ack(0, [(item[0], claim.stamp) for claim in taken for item in claim.items]) == 25
    with pytest.raises(Exception, match="FENCED"):
        store.claim(0, token=5, limit=10)



def test_a_new_leader_with_a_shorter_visibility_timeout_takes_back_its_predecessors_copies_not_its_own(overrides):
    """The predecessor's copies in flight have later deadlines than the new leader's claims (its
    visibility timeout was longer: a rolling config change; or Redis' clock stepped back): the new
    leader's next claims, before Kafka confirmed its first, took its own copies back as its
    predecessor's, lowest deadline first, and sent those 10 four times while the other 20 waited out the
    predecessor's visibility timeout (review 51).  Each is taken back and claimed once."""
    settings = {"partitions": 1, "dispatch_lead": 0.5}
    old = DelayedStore(Settings.from_conf(overrides, visibility_timeout=30, **settings))
    new = DelayedStore(Settings.from_conf(overrides, visibility_timeout=10, **settings))
    now = now_ms()
    ids = [str(uuid.uuid4()) for _ in range(30)]
    old.schedule_many((task_id, now - 1000 + i, data)
                      for i, (task_id, (_, _, data)) in enumerate(zip(ids, envelopes(30, "q", 0))))
    assert len(old.claim(0, token=5, limit=30).items) == 30
    taken = [new.claim(0, token=6, limit=10) for _ in range(4)]  # no ack in between: Kafka has not confirmed
    sent = [item[0] for claim in taken for item in claim.items]
    assert sorted(sent) == sorted(ids), f"{len(sent)} sent, {len(set(sent))} distinct"
    assert taken[0].stamp < taken[1].stamp < taken[2].stamp  # a stamp names one claim
    assert new.redis.get(new.keys.handover(0)) == b"0"
    assert new.ack(0, [(item[0], claim.stamp) for claim in taken for item in claim.items]) == 30

def test_a_claim_read_lost_during_a_handover_is_claimed_again_at_once(overrides, monkeypatch):
    """A new leader's claim during a handover has a deadline above its predecessor's copies' (above);
    the connection is lost before its tasks are read.  The next claim, sending its request id again,
    put them back due at that deadline less the visibility timeout, taken for the claim's horizon:
    with the predecessor's visibility timeout 300 s against 10 s, ten tasks waited 290 s while the
    others went at once.  They are due again at once, as any unread claim's are, each claimed once."""
    settings = {"partitions": 1, "dispatch_lead": 0.5}
    old = DelayedStore(Settings.from_conf(overrides, visibility_timeout=300, **settings))
    new = DelayedStore(Settings.from_conf(overrides, visibility_timeout=10, **settings))
    tasks = list(envelopes(30, "q", now_ms() - 1000))
    old.schedule_many(tasks)
    assert len(old.claim(0, token=5, limit=30).items) == 30  # then killed before Kafka confirmed them
    monkeypatch.setattr(new, "_read_claimed", Mock(side_effect=redis.ConnectionError("lost")))
    with pytest.raises(redis.ConnectionError):
        new.claim(0, token=6, limit=10)
    monkeypatch.undo()
    taken = [new.claim(0, token=6, limit=10) for _ in range(4)]  # no ack in between: Kafka has not confirmed
    sent = [item[0] for claim in taken for item in claim.items]
    assert sorted(sent) == sorted(task_id for task_id, _, _ in tasks), f"{len(sent)} sent, {len(set(sent))} distinct"


def test_a_newer_copy_scheduled_while_the_old_one_is_in_flight_survives_its_ack_and_nack(store):
    """A retry (or put-back) written while the poller still waits for the first copy's delivery
    report: the old claim's ack or nack must not delete it; a plain duplicate says it was kept."""
    (_, _, first), (_, _, second), (_, _, third) = envelopes(3, "q", 0)
    due = now_ms() - 10
    for settle in ("ack", "nack"):
        task_id = f"race-{settle}"
        p = store.partition(task_id)
        assert store.schedule(task_id, due, first) is Stored.ADDED
        claimed = store.claim(p, token=1, limit=10)
        assert [item[0] for item in claimed.items] == [task_id]
        assert store.schedule(task_id, now_ms() + 60_000, second, attempt=1) is Stored.REPLACED  # the retry, 60 s on
        assert getattr(store, settle)(p, [(task_id, claimed.stamp)]) == 0
        info = store.get(task_id)
        assert info is not None, f"the old copy's {settle} deleted the newer copy"
        assert info["state"] == "scheduled" and info["due_ms"] >= due + 60_000 and store.message(task_id) == second
        # a plain duplicate of a scheduled task keeps the stored copy, and says so; a retry replaces it
        assert store.schedule(task_id, due, third) is Stored.KEPT and store.message(task_id) == second
        assert store.schedule(task_id, due + 5, third, attempt=2) is Stored.REPLACED  # a newer attempt replaces
        assert store.get(task_id)["due_ms"] == due + 5 and store.message(task_id) == third
        assert [r["scheduled"] for r in store.counts() if r["partition"] == p] == [1]
        assert store.cancel(task_id) is Change.DONE


def test_a_task_whose_delivery_keeps_failing_counts_as_failing_from_its_first_due_until_it_leaves(overrides):
    """A nack makes a failed task due again a second on, so ``overdue`` never holds it: it counts as
    failing, by the due time it first failed at, until it is delivered, cancelled, moved or replaced."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    ids = ["delivered", "cancelled", "moved", "replaced", "lapsed"]
    due = now_ms() - 60_000
    store.schedule_many((task_id, due, data) for task_id, (_, _, data) in zip(ids, envelopes(5, "q", 0)))
    for round_ in range(2):  # failing twice keeps the first due time
        claim = store.claim(0, token=1, limit=10)
        assert len(claim.items) == 5
        failed = {task_id: due_ms + round_ for task_id, due_ms, _ in claim.items if task_id != "lapsed"}
        assert store.nack(0, [(task_id, claim.stamp) for task_id, *_ in claim.items], delay_ms=0, failed=failed) == 5
    row = store.counts()[0]
    assert (row["failing"], row["overdue"]) == (4, 5)
    assert 59 < row["oldest_overdue_s"] < 120
    assert store.redis.zscore(store.keys.failing(0), member_of("moved")) == due  # the first failure's
    claim = store.claim(0, token=1, limit=10)
    assert store.ack(0, [("delivered", claim.stamp)]) == 1
    store.nack(0, [(task_id, claim.stamp) for task_id, *_ in claim.items if task_id != "delivered"], delay_ms=0)
    assert store.counts()[0]["failing"] == 3
    assert store.cancel("cancelled") is Change.DONE
    store.reschedule("moved", now_ms() + 60_000)
    (_, _, retry), = envelopes(1, "q", 0)
    assert store.schedule("replaced", now_ms(), retry, attempt=1) is Stored.REPLACED
    assert store.counts()[0]["failing"] == 0 and not store.redis.exists(store.keys.failing(0))


def test_a_failing_task_that_left_the_store_unseen_stops_counting_as_failing(overrides):
    """A task left the store by a way that did not drop it from ``failing`` (the ack of a poller of an
    earlier release, which knows no such key, during a rolling upgrade): status must not count it
    failing for ever, its first failed due time growing older and the alert on it firing for good."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    due = now_ms() - 60_000
    store.schedule_many((task_id, due, data) for task_id, (_, _, data) in zip(("gone", "kept"), envelopes(2, "q", 0)))
    claim = store.claim(0, token=1, limit=10)
    store.nack(0, [(task_id, claim.stamp) for task_id, *_ in claim.items], delay_ms=0,
               failed={"gone": due - 3_600_000, "kept": due})
    store.redis.hdel(store.keys.msgs(0), member_of("gone"))  # an old release's ack: message gone, failing kept
    row = store.counts()[0]
    assert (row["failing"], 59 < row["oldest_overdue_s"] < 120) == (1, True), row
    assert store.redis.zrange(store.keys.failing(0), 0, -1) == [member_of("kept")]


def test_a_retry_stored_between_a_claim_and_its_read_is_not_taken_for_the_claimed_copy(overrides, monkeypatch):
    """A claim moves its tasks to inflight, then reads their messages (``lua/claim.lua``).  A retry
    stored in between replaces one message and takes that task out of flight, due in a minute: it
    must not go out now, under the claim that no longer holds it, as if it were the claimed copy."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    (_, _, first), (_, _, retry), (_, _, other) = envelopes(3, "q", 0)
    due = now_ms() - 10
    store.schedule("raced", due, first)
    store.schedule("bystander", due, other)
    read = store._read_claimed

    def retried_first(*args):
        assert store.schedule("raced", due + 60_000, retry, attempt=1) is Stored.REPLACED
        return read(*args)

    monkeypatch.setattr(store, "_read_claimed", retried_first)
    claim = store.claim(0, token=1, limit=10)
    assert [(task_id, data) for task_id, _, data in claim.items] == [("bystander", other)]
    assert store.get("raced")["state"] == "scheduled" and store.get("raced")["due_ms"] == due + 60_000
    assert store.message("raced") == retry


def test_an_id_claimed_without_its_message_holds_no_new_copy_of_it_in_flight(overrides):
    """A bucket entry can outlive its message (a schedule a slot migration cut short: schedule.lua),
    and a claim takes such an id in flight without one (claim.lua).  Scheduled again, the id is a new
    task: scheduled, cancellable, due at its own time, not sent at once when that claim expires; and a
    drain's nack of the lapsed claim takes a message-less id out of flight (review of stop 37)."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1, visibility_timeout=1))
    (_, _, data), = envelopes(1, "q", 0)
    now = now_ms()
    for task_id in ("orphan", "lapsed"):
        store.schedule(task_id, now - 10, data)
        store.redis.hdel(store.keys.msgs(0), member_of(task_id))
    claim = store.claim(0, token=1, limit=10)
    assert claim.items == []

    assert store.schedule("orphan", now + 3_600_000, data) is Stored.ADDED
    assert store.get("orphan")["state"] == "scheduled" and store.get("orphan")["due_ms"] == now + 3_600_000
    assert store.nack(0, [("lapsed", claim.stamp)], delay_ms=0) == 0  # nothing to send: it only leaves
    assert store.counts()[0]["inflight"] == 0
    time.sleep(1.2)  # past the claim's visibility timeout
    assert store.claim(0, token=1, limit=10).items == []  # not sent an hour early
    assert store.cancel("orphan") is Change.DONE


def test_a_late_copy_of_an_older_attempt_never_replaces_a_newer_one(store):
    """A worker puts back a late duplicate of attempt 0 (its run claim was still held) while
    attempt 1 is in flight, then attempt 1's delivery fails: attempt 1 must still be the one
    stored, or it would never run (attempt 0 is refused as finished)."""
    (_, _, first), (_, _, retry) = envelopes(2, "q", 0)
    task_id, due = "attempts", now_ms() - 10
    p = store.partition(task_id)
    assert store.schedule(task_id, due, first) is Stored.ADDED
    store.claim(p, token=1, limit=10)
    assert store.schedule(task_id, due, retry, attempt=1) is Stored.REPLACED  # attempt 0 ran and retried
    claim = store.claim(p, token=1, limit=10)
    assert [item[2] for item in claim.items] == [retry]
    assert store.schedule(task_id, due, first, attempt=0) is Stored.KEPT  # the late put-back of attempt 0
    assert store.nack(p, [(task_id, claim.stamp)], delay_ms=0) == 1
    assert store.message(task_id) == retry and store.get(task_id)["state"] == "scheduled"
    again = store.claim(p, token=1, limit=10)
    assert store.ack(p, [(task_id, again.stamp)]) == 1
    assert store.redis.hlen(store.keys.attempts(p)) == 0  # forgotten with the task


def test_reschedule_to_the_front_wakes_the_pollers(store):
    store.schedule_many(envelopes(2, "q", now_ms() + 60_000))
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.wake)
    soon = now_ms() + 1000
    store.reschedule("task-1", soon)
    wait_for_wake_up(pubsub, soon)
    pubsub.close()


def test_upcoming_pages_through_every_task_once_in_due_order_even_with_ties(store):
    base = now_ms() + 60_000
    store.schedule_many(envelopes(30, "q", base, prefix="tie"))  # 30 tasks due the same ms, all partitions
    store.schedule_many([(f"t{i}", base + 1000 * (i % 7), data) for i, (_, _, data)
                         in enumerate(envelopes(40, "q", 0, prefix="t"))])
    expected = sorted(((base, f"tie-{i}") for i in range(30)), key=lambda e: (e[0], e[1].encode()))
    expected = sorted(expected + [(base + 1000 * (i % 7), f"t{i}") for i in range(40)],
                      key=lambda e: (e[0], e[1].encode()))
    seen, cursor, pages = [], None, 0
    while True:
        page = store.upcoming(7, after=cursor)
        seen += [(item["due_ms"], item["task_id"]) for item in page.items]
        pages += 1
        if page.cursor is None:
            break
        cursor = page.cursor
    assert seen == expected and pages == 10
    first = store.upcoming(1).items[0]
    assert first["task"] == "tasks.demo.add" and first["queue"] == "q"
    with pytest.raises(ValueError, match="limit must be between 1 and"):
        store.upcoming(MAX_PAGE + 1)


def test_counts_overdue_and_next_due(store):
    now = now_ms()
    store.schedule_many(envelopes(3, "q", now - 5000, prefix="late"))
    store.schedule_many(envelopes(2, "q", now + 60_000, prefix="soon"))
    rows = store.counts()
    assert sum(r["overdue"] for r in rows) == 3
    assert 4.5 < max(r["oldest_overdue_s"] or 0 for r in rows) < 30
    assert min(r["upcoming_due_ms"] or 1 << 62 for r in rows) == now + 60_000
    assert all(r["oldest_overdue_s"] is None for r in rows if not r["overdue"])


def test_a_real_celery_message_takes_little_redis_memory(overrides):
    from celery_delayed import store_of
    from tasks import create_app

    app = create_app(**overrides)
    store = store_of(app)
    result = app.tasks["tasks.demo.add"].apply_async((2, 2), countdown=3600)
    info = store.get(result.id)
    assert info["stored_bytes"] < 150  # Celery's own message is over 1 KB; the original form stored 576 B
    assert store.redis.memory_usage(store.keys.msgs(info["partition"])) < 400


def test_the_largest_claims_and_acks_fit_the_scripts_variadic_calls(overrides):
    """claim.lua and ack.lua move a batch per command: 5000 tasks claimed in one call and 15,000
    acked (or nacked) in one are more values than Lua's ``unpack`` takes at once (~8000)."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    store.schedule_many(envelopes(15_000, "q", now_ms() - 60_000))
    claims = [store.claim(0, 1, 5000) for _ in range(3)]
    assert [len(c.items) for c in claims] == [5000] * 3
    assert len({task_id for c in claims for task_id, _, _ in c.items}) == 15_000
    assert store.counts()[0]["inflight"] == 15_000
    acked = [(task_id, c.stamp) for c in claims[:2] for task_id, _, _ in c.items]
    assert store.ack(0, acked) == 10_000
    assert store.nack(0, [(task_id, claims[2].stamp) for task_id, _, _ in claims[2].items]) == 5000
    assert store.ack(0, acked) == 0  # forgotten already
    assert (store.counts()[0]["inflight"], store.counts()[0]["scheduled"]) == (0, 5000)
    assert store.message(claims[0].items[0][0]) is None and store.message(claims[2].items[0][0]) is not None


def test_a_claim_takes_from_each_queue_in_turn_so_no_backlog_holds_another_queue_back(overrides):
    """Lanes (issue 29): 3,000 tasks of queue bulk due a minute ago and 3,000 of queue mail due 30 s ago
    stand before a task of queue other due a second ago.  A claim of 100 still takes other's task and
    shares the rest between the two backlogs; then they drain a whole claim at a time, each task once."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    store.schedule_many(envelopes(3000, "bulk", now - 60_000, prefix="bulk"))
    store.schedule_many(envelopes(3000, "mail", now - 30_000, prefix="mail"))
    store.schedule_many(envelopes(1, "other", now - 1000, prefix="other"))

    first = [item[0] for item in store.claim(0, token=1, limit=100).items]
    assert "other-0" in first and len(first) == 100
    shares = [sum(task_id.startswith(queue) for task_id in first) for queue in ("bulk", "mail")]
    assert abs(shares[0] - shares[1]) <= 1, shares
    drained = first
    while claimed := [item[0] for item in store.claim(0, token=1, limit=100).items]:
        assert len(claimed) == 100 or len(drained) + len(claimed) == 6001  # whole claims to the end
        drained += claimed
    assert sorted(drained) == sorted([f"bulk-{i}" for i in range(3000)] + [f"mail-{i}" for i in range(3000)]
                                     + ["other-0"])
    assert store.counts()[0]["next_due_ms"] is None and not store.redis.exists(store.keys.lanes(0))
