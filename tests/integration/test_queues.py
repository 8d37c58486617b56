"""Queues at fire time (issue 29): a paused queue's tasks stay in the store until it is resumed,
whatever happens to the pollers meanwhile, while every other queue goes on."""
from __future__ import annotations

import os
import signal
import time

import pytest

from celery_delayed.poller.leadership import Leadership
from celery_delayed.poller.loop import Poller
from celery_delayed.sandbox import running
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import TOKEN_BURST_S, Claim, DelayedStore

from .support import TopicReader, envelopes, leaders, wait_for, wait_for_wake_up
from .test_poller import now_ms

pytestmark = pytest.mark.cluster_too


class Recording(DelayedStore):
    """The real store, noting each claim (its caps and what it returned) and each take of tokens
    (``want`` > 0: what it got), in order, as ``("claim", caps, claim)`` and ``("take", queue, got)``."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.events: list[tuple] = []

    def claim(self, partition: int, token: int, limit: int, paused=(), caps=None) -> Claim:
        claim = super().claim(partition, token, limit, paused, caps)
        self.events.append(("claim", dict(caps or {}), claim))
        return claim

    def take_tokens(self, queue: str, rate: float, want: int) -> int:
        got = super().take_tokens(queue, rate, want)
        if want > 0:
            self.events.append(("take", queue, got))
        return got

    def claims(self) -> list[tuple[dict, Claim]]:
        return [(caps, claim) for kind, caps, claim in self.events if kind == "claim"]

    def takes(self, queue: str) -> list[int]:
        return [got for kind, name, got in self.events if kind == "take" and name == queue]


def leading_poller(settings: Settings) -> tuple[Recording, Poller]:
    """A recording store and an in-process poller (not running) leading every partition (as long as
    ``delayed_lease_ttl`` allows: no thread keeps it)."""
    store, leader = Recording(settings), Leadership(settings)
    assert len(leader.step()) == settings.partitions
    return store, Poller(settings, store=store, leadership=leader)


def test_a_paused_queue_gives_no_task_and_no_due_time_to_a_claim_until_it_is_resumed(overrides):
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    assert store.pause("bulk") and not store.pause("bulk")  # paused once, since the first time
    store.schedule_many(envelopes(50, "bulk", now - 60_000, prefix="bulk"))
    store.schedule_many(envelopes(2, "other", now - 1000, prefix="other"))
    store.schedule_many(envelopes(1, "other", now + 60_000, prefix="later"))

    claim = store.claim(0, token=1, limit=100, paused=store.paused(), caps={"bulk": 0})
    assert sorted(item[0] for item in claim.items) == ["other-0", "other-1"]
    assert not claim.throttled  # paused, it has no tokens to wait for: the poller need not come back
    assert claim.next_due_ms == now + 60_000  # not bulk's overdue tasks: the poller may sleep till then
    rows = {row["queue"]: row for row in store.queues()}
    assert rows["bulk"]["overdue"] == 50 and rows["bulk"]["paused_since_ms"] is not None
    assert rows["other"] == {"queue": "other", "overdue": 0, "next_due_ms": now + 60_000, "paused_since_ms": None,
                             "rate": None}

    assert store.resume("bulk") and not store.resume("bulk")
    claim = store.claim(0, token=1, limit=100, paused=store.paused())
    assert sorted(item[0] for item in claim.items) == sorted(f"bulk-{i}" for i in range(50))
    with pytest.raises(ValueError, match="a queue to pause must be a name of 1 to 255 bytes"):
        store.pause("")


def test_a_capped_queue_gives_at_most_its_cap_and_the_claim_says_it_has_more_due(overrides):
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    store.schedule_many(envelopes(50, "bulk", now - 60_000, prefix="bulk"))
    store.schedule_many(envelopes(2, "other", now - 1000, prefix="other"))
    store.schedule_many(envelopes(1, "other", now + 60_000, prefix="later"))
    claim = store.claim(0, token=1, limit=100, caps={"bulk": 10, "other": 5})
    ids = [item[0] for item in claim.items]
    assert len(ids) == 12 and {"other-0", "other-1"} <= set(ids)
    assert claim.throttled == {"bulk"}  # other's cap was not all spent: not throttled
    assert claim.taken == {"bulk": 10, "other": 2}  # what the poller gives back of the tokens it held
    assert claim.next_due_ms == now + 60_000  # bulk is due, but closed for this claim
    assert store.claim(0, token=1, limit=100, caps={"bulk": 0}).items == []
    claim = store.claim(0, token=1, limit=100, caps={"bulk": 100})
    assert len(claim.items) == 40 and not claim.throttled


@pytest.mark.parametrize("cap", [0, 3], ids=["no-tokens", "tokens-spent"])
def test_a_capped_queues_next_task_not_yet_due_is_the_partitions_next_due_time(overrides, cap):
    """A claim closed a capped queue's lane and left its next task out of the partition's next due
    time, as a paused one's (review of stop 36): the poller slept past it until its next sweep, so a
    queue limited far above its pace went up to ``max_sleep`` late.  Its tasks due now make the claim
    throttled; its next one not yet due is the next due time, as any queue's."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    store.schedule_many(envelopes(cap, "bulk", now - 1000, prefix="due"))
    store.schedule_many(envelopes(1, "bulk", now + 5000, prefix="later"))
    store.schedule_many(envelopes(1, "other", now + 60_000, prefix="other"))
    claim = store.claim(0, token=1, limit=100, caps={"bulk": cap})
    assert len(claim.items) == cap and not claim.throttled
    assert claim.next_due_ms == now + 5000, claim.next_due_ms
    assert store.pause("bulk")
    claim = store.claim(0, token=1, limit=100, paused=store.paused(), caps={"bulk": 0})
    assert claim.next_due_ms == now + 60_000  # paused, it gives none


def test_a_queues_tokens_refill_at_its_rate_up_to_a_quarter_second_and_are_shared(overrides):
    settings = Settings.from_conf(overrides)
    one, other = DelayedStore(settings), DelayedStore(settings)  # two pollers' stores
    began = time.monotonic()
    assert one.take_tokens("bulk", 100, 1000) == 25  # a new bucket is full: a quarter second's worth
    refilled = int((time.monotonic() - began) * 100) + 1  # what 100/s earned meanwhile (a busy machine)
    assert other.take_tokens("bulk", 100, 1000) <= refilled  # the same bucket
    time.sleep(0.5)
    assert one.take_tokens("bulk", 100, 1000) == 25  # refilled, up to the quarter second
    assert one.take_tokens("bulk", 100, -10) == 0  # unused ones given back...
    assert 10 <= other.take_tokens("bulk", 100, 1000) <= 13  # ...go to the next taker


@pytest.mark.timeout(180)
def test_a_rate_shared_by_two_pollers_holds_while_another_queue_goes_at_once(overrides, processes):
    """delayed_queue_rates = {bulk: 100}: 600 tasks of bulk due at once, with two pollers leading half the
    partitions each, reach bulk's topic at about 100 a second (generous bounds here: bench.burst measures
    it), while another queue's tasks due at the same time all go at once."""
    rate, n = 100, 600
    queue, bulk = overrides["task_default_queue"], f"{overrides['task_default_queue']}-bulk"
    overrides.update(delayed_partitions=4, delayed_queue_rates={bulk: rate})
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    limited, other = TopicReader(settings, settings.topic(bulk)), TopicReader(settings, settings.topic(queue))
    first, second = processes.poller(), processes.poller("poller2")
    wait_for(lambda: set(leaders(settings).values()) == {first.pid, second.pid}, 30, "both pollers to lead")
    store.schedule_many(envelopes(n, bulk, now_ms(), prefix="bulk"))
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="other"))
    started = time.monotonic()
    assert len(other.read_until(20, timeout=30)) == 20
    other_done = time.monotonic() - started

    stamps: list[int] = []  # when each record of bulk was produced (ms)
    deadline = time.monotonic() + 60
    while len(stamps) < n and time.monotonic() < deadline:
        for record in limited.consumer.consume(num_messages=1000, timeout=0.5):
            if not record.error():
                stamps.append(record.timestamp()[1])
                limited.keys[record.key().decode()] += 1
    limited.close()
    other.close()
    assert len(limited.keys) == n and sum(limited.keys.values()) == n
    stamps.sort()
    burst = int(rate * TOKEN_BURST_S) + 1  # the first tokens are a full bucket's
    measured = (n - burst) / ((stamps[-1] - stamps[burst]) / 1000)
    print(f"\n{n} tasks of {bulk} at {measured:.1f}/s (limit {rate}/s), the other queue's 20 on their topic "
          f"after {other_done:.2f} s")
    assert 0.8 * rate <= measured <= 1.2 * rate
    assert other_done < 0.5 * n / rate  # long before the limited queue is through


def test_a_task_due_soonest_in_its_queue_wakes_the_pollers_even_behind_a_paused_queues_overdue_tasks(overrides):
    """A poller sleeps until its partitions' next due time, paused queues left out, so a task due sooner
    than everything in its own queue must wake it, even when a paused queue's task is due sooner still."""
    store = DelayedStore(Settings.from_conf(overrides, partitions=1))
    now = now_ms()
    store.pause("bulk")
    store.schedule_many(envelopes(5, "bulk", now - 60_000, prefix="bulk"))
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.wake)
    store.schedule_many(envelopes(1, "other", now + 2000, prefix="other"))
    wait_for_wake_up(pubsub, now + 2000)
    pubsub.close()


@pytest.mark.timeout(240)
def test_a_paused_queue_stays_in_the_store_through_a_poller_kill_and_a_restart_then_goes_once(overrides, processes):
    """Two pollers lead the partitions; a queue is paused; one poller is killed (-9) and its standby takes
    over, then that one is stopped and a new one leads: the paused queue's due tasks stay in the store all
    along (0 records on its topic) while another queue's go; resumed, each is on its topic once."""
    overrides.update(delayed_partitions=4)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue, bulk = overrides["task_default_queue"], f"{overrides['task_default_queue']}-bulk"
    held, other = TopicReader(settings, settings.topic(bulk)), TopicReader(settings, settings.topic(queue))
    assert store.pause(bulk)
    first, second = processes.poller(), processes.poller("poller2")
    wait_for(lambda: set(leaders(settings).values()) == {first.pid, second.pid}, 30, "both pollers to lead")
    store.schedule_many(envelopes(300, bulk, now_ms(), prefix="bulk"))
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="before"))
    assert len(other.read_until(20, timeout=30)) == 20

    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: set(leaders(settings).values()) == {second.pid} and len(leaders(settings)) == 4,
             settings.lease_ttl + 10, "the standby to take the killed poller's partitions")
    processes.warm_stop(second)
    third = processes.poller("poller3")
    wait_for(lambda: set(leaders(settings).values()) == {third.pid} and len(leaders(settings)) == 4,
             settings.lease_ttl + 10, "a new poller to lead every partition")
    store.schedule_many(envelopes(20, queue, now_ms(), prefix="after"))
    assert len(other.read_until(40, timeout=30)) == 40
    time.sleep(2)
    held.read(timeout=1)
    assert not held.keys, f"{len(held.keys)} tasks of the paused queue reached its topic"
    assert {row["queue"]: row["overdue"] for row in store.queues()}[bulk] == 300

    assert store.resume(bulk)
    keys = held.read_until(300, timeout=60)
    held.read(timeout=1)  # a copy sent twice would be there by now
    assert len(keys) == 300 and set(keys.values()) == {1}, (len(keys), max(keys.values(), default=0))
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 30, "the store to be empty")
    held.close()
    other.close()


def test_each_claim_of_a_round_gets_a_share_of_its_tokens_not_the_first_all_of_them(overrides):
    """Issue 41 item 8: a round's next claim is sent before the one before it returns, and the first
    was given every token the round held, so the second read none and was throttled (every second
    claim of a round: its partition waited 50 ms for tokens the round still held).  Each claim now
    gets a share, as many shares as the round's partitions with the queue's due tasks."""
    bulk = f"{overrides['task_default_queue']}-bulk"
    settings = Settings.from_conf(overrides, partitions=4, lease_ttl=30, queue_rates={bulk: 1000})
    store, poller = leading_poller(settings)
    store.schedule_many(envelopes(400, bulk, now_ms() - 1000, prefix="bulk"))
    starved, throttled, produced = [], 0, 0
    for _ in range(200):
        store.events.clear()
        produced += poller.tick()
        took = sum(store.takes(bulk))
        for caps, claim in store.claims():
            throttled += bool(claim.throttled)
            if claim.throttled and not caps.get(bulk) and took >= settings.partitions:
                starved.append((took, caps, len(claim.items)))
        if produced >= 400:
            break
        time.sleep(0.06)  # a throttled partition is due again 50 ms on
    poller.leadership.release()
    print(f"\n{throttled} claims throttled, {len(starved)} of them given no token of a round holding some")
    assert produced == 400
    assert not starved, f"claims given no token by a round holding one a partition or more: {starved[:5]}"


def test_a_poller_draws_no_tokens_of_a_limited_queue_none_of_its_partitions_has_due(overrides):
    """Issue 41 item 8: every round took a limited queue's whole bucket (and gave it back at its end),
    even on a poller whose partitions held none of its due tasks, leaving it empty for the pollers that
    had them.  Tokens are now taken for the queues a partition's last claim found due there; a
    partition's first task of such a queue makes its claim throttled, and it is claimed again at once
    with tokens, not 50 ms later."""
    queue, bulk = overrides["task_default_queue"], f"{overrides['task_default_queue']}-bulk"
    settings = Settings.from_conf(overrides, partitions=2, lease_ttl=30, dispatch_lead=0,
                                  queue_rates={bulk: 1000})
    store, poller = leading_poller(settings)
    later = now_ms() + 3000  # past a sweep or two, however slow this machine is
    store.schedule_many(envelopes(1, bulk, later, prefix="bulk"))
    store.schedule_many(envelopes(10, queue, now_ms() - 1000))
    produced = 0
    while now_ms() < later:  # the other queue's tasks go; a sweep a second claims each partition
        produced += poller.tick()
        time.sleep(0.05)
    assert produced == 10
    assert store.takes(bulk) == [], "tokens taken of a queue no partition had due"
    time.sleep(0.1)  # bulk's task due (a claim reads Redis' clock)
    produced = poller.tick() + poller.tick()  # the claim that finds it, and the one right after
    poller.leadership.release()
    assert produced == 1, "the limited queue's first task waited"


def test_a_paused_limited_queue_costs_no_more_claims_than_a_paused_one(overrides):
    """Issue 41 item 8: a paused queue's lane was capped too, every second claim of a round to 0
    tokens, and the claim said it throttled: its partition was claimed again every 50 ms while the
    queue stayed paused, taking its tokens each round.  A paused queue now draws no tokens and is
    never throttled: the same claims as without its limit (a sweep a second)."""
    bulk = f"{overrides['task_default_queue']}-bulk"
    settings = Settings.from_conf(overrides, partitions=4)
    store = Recording(settings)
    store.schedule_many(envelopes(100, bulk, now_ms() - 1000, prefix="bulk"))
    assert store.pause(bulk)
    claims = {}
    for limited in (False, True):
        if limited:
            store.set_rate(bulk, 1000)
        store.events.clear()
        with running(Poller(settings, store=store)):
            time.sleep(3)
        claims[limited] = [claim for _, claim in store.claims()]
        assert not any(claim.items for claim in claims[limited])
    throttled = sum(bool(claim.throttled) for claim in claims[True])
    print(f"\nclaims in 3 s of a paused queue's partitions: {len(claims[False])}, limited too: {len(claims[True])} "
          f"({throttled} throttled); its tokens taken {len(store.takes(bulk))} times")
    assert not throttled and store.takes(bulk) == [], "a paused queue waited for tokens"
    assert len(claims[True]) <= len(claims[False]) + settings.partitions  # a sweep more at most: timing
