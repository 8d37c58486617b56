"""The worker's hand-over of Kafka records to Celery (celery_delayed.worker.intake, KafkaFeed._drain):
the parts that are pure logic."""
from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_delayed.kafka import CLAIMED_HEADER, DUE_HEADER
from celery_delayed.store.layout import MAX_DUE_MS
from celery_delayed.worker.consumer import UNEXPECTED_TRIES, KafkaFeed
from celery_delayed.worker.intake import Arrival, _check_body, _record_headers, hold_until

REDIS_NOW = 1_800_000_000_000


def test_a_task_sent_ahead_of_its_due_time_waits_for_it_by_this_workers_clock():
    assert hold_until(REDIS_NOW + 300, REDIS_NOW - 200, REDIS_NOW) == REDIS_NOW + 300
    assert hold_until(REDIS_NOW + 300, None, REDIS_NOW) == REDIS_NOW + 300
    assert hold_until(REDIS_NOW - 5, REDIS_NOW - 505, REDIS_NOW) is None  # due: at once
    assert hold_until(None, None, REDIS_NOW) is None


def test_a_worker_whose_clock_is_behind_redis_waits_no_longer_than_the_dispatch_lead():
    """Claimed 500 ms before due by Redis' clock; this worker's clock an hour behind: it waits
    the 500 ms, not an hour (holding the task and its partition's commit)."""
    behind = REDIS_NOW - 3_600_000
    assert hold_until(REDIS_NOW + 300, REDIS_NOW - 200, behind) == behind + 500


class _Record:
    def __init__(self, headers: list) -> None:
        self._headers = headers

    def headers(self) -> list:
        return self._headers


def test_timing_headers_no_time_can_hold_are_ignored():
    record = _Record([(DUE_HEADER, b"99999999999999999"), (CLAIMED_HEADER, b"-1"), ("other", b"5")])
    assert _record_headers(record) == {}
    assert _record_headers(_Record([(DUE_HEADER, str(MAX_DUE_MS - 1).encode()), (CLAIMED_HEADER, b"oops")])) == \
        {DUE_HEADER: MAX_DUE_MS - 1}


class _Intake:
    """Hands over records, failing with ``errors[record]`` (one per try) while any is left."""

    def __init__(self, errors: dict[str, list[Exception]]) -> None:
        self.errors, self.handed, self.parked = errors, [], []

    def dispatch(self, arrival: Arrival) -> None:
        if self.errors.get(arrival.record):
            raise self.errors[arrival.record].pop(0)
        self.handed.append(arrival.record)

    def give_up(self, arrival: Arrival, reason: str, tb: str) -> None:
        self.parked.append((arrival.record, reason))


def _feed(intake: _Intake, records: list[str]) -> tuple[KafkaFeed, list]:
    """A KafkaFeed's hand-over loop alone: its ready records, the intake, and a timer whose
    ``call_after`` is recorded (the test calls ``_drain`` again itself, as the loop would)."""
    later: list = []
    feed = object.__new__(KafkaFeed)
    feed.c = SimpleNamespace(timer=SimpleNamespace(call_after=lambda delay, fn, args=(): later.append(fn)))
    feed.intake, feed._ready_lock, feed._scheduled, feed._green = intake, threading.Lock(), True, False
    feed._ready = deque(Arrival(record=r, partition=None, read_ms=0) for r in records)
    feed._reading = threading.Event()
    feed._reading.set()
    feed._stopping = False
    return feed, later


@pytest.mark.parametrize("payload", [[[1], {}, {}], ((1,), {"x": 1}, {"chain": None}), {"args": [1], "kwargs": {}}])
def test_a_body_celery_can_run_passes(payload):
    _check_body(payload)


@pytest.mark.parametrize("payload", [[5, {}, {}], [[1], [], {}], [[1], {}, 7], [[1], {}], {"a": 1}, 7, None, "abc"])
def test_a_body_celery_would_only_fail_on_later_is_refused_naming_its_shape(payload):
    with pytest.raises(ValueError, match=r"task body is not \[args \(a list\), kwargs \(an object\)"):
        _check_body(payload)

def test_a_record_failing_by_an_unknown_error_is_dead_lettered_and_the_ones_behind_it_go_on():
    intake = _Intake({"odd": [RuntimeError("a bug")] * (UNEXPECTED_TRIES + 3)})
    feed, later = _feed(intake, ["odd", "next"])
    for _ in range(UNEXPECTED_TRIES + 3):
        feed._drain()
        if not later:
            break
        later.clear()
    assert intake.parked == [("odd", "could not be handed to Celery: RuntimeError('a bug')")]
    assert intake.handed == ["next"]


def test_a_record_failing_by_a_transient_error_is_tried_again_for_as_long_as_it_lasts():
    intake = _Intake({"blink": [RedisConnectionError("down")] * (UNEXPECTED_TRIES * 3)})
    feed, later = _feed(intake, ["blink", "next"])
    for _ in range(UNEXPECTED_TRIES * 3):
        feed._drain()
        assert later == [feed._drain] and intake.handed == []
        later.clear()
    feed._drain()
    assert intake.parked == [] and intake.handed == ["blink", "next"]


def test_a_stopping_feed_hands_nothing_more_to_celery_while_it_gives_its_tasks_up():
    """A warm stop gives up or hands back the tasks in hand (``Intake.let_go``), calling Redis and the
    broker: in a green worker the loop runs meanwhile, and a record it handed to Celery then was in hand
    after the stop had looked, held by Celery's ETA timer, which the stop had already cleared: never run
    there, its claim held, it ran a run lease late.  Records still waiting then are dropped, their claims
    given up (the partition's next owner reads them)."""
    intake = _Intake({})
    feed, _ = _feed(intake, ["waiting"])
    feed._gate, feed._wakeup, feed._room = None, None, threading.Event()
    feed.claims = SimpleNamespace(release=lambda task_id: None)
    intake.let_go = lambda running: feed._drain()  # its network calls: the loop runs
    feed.stop()
    assert intake.handed == [] and not feed._ready


def test_the_feed_stops_when_celerys_consumer_closes_before_its_other_steps_stop():
    """Celery's consumer stops by closing (its ``on_close``, which drops the requests it holds, then each
    step's ``close``), then stopping its steps, last first, several of which wait on the network; a green
    worker's feed handed records over in between, which nothing dropped.  The feed stops at ``close``,
    once (the ``stop`` after is nothing); a consumer restart calls ``stop`` alone."""
    from celery import bootsteps

    from celery_delayed.worker.consumer import KafkaConsumerStep

    said: list[str] = []
    step = object.__new__(KafkaConsumerStep)
    step.feed = SimpleNamespace(stop=lambda: said.append("feed stopped"))

    class Later(bootsteps.StartStopStep):
        def stop(self, parent) -> None:
            said.append("a later step stopped")

    parent = SimpleNamespace(steps=[step, object.__new__(Later)])
    blueprint = bootsteps.Blueprint(on_close=lambda: said.append("on_close"))
    blueprint.state, blueprint.started = bootsteps.RUN, 2
    blueprint.stop(parent)
    assert said == ["on_close", "feed stopped", "a later step stopped"]


class _Job:
    """A pool job as billiard's ApplyResult shows it: written to a child or not, accepted or not."""

    def __init__(self, **state) -> None:
        self.__dict__.update(state)


class _Claims:
    def __init__(self) -> None:
        self.released, self.forgotten = [], []

    def release(self, task_id: str) -> None:
        self.released.append(task_id)

    release_now = release

    def forget(self, task_id: str) -> None:
        self.forgotten.append(task_id)


@pytest.mark.parametrize("done_ttl", [3600.0, 0.0])
def test_a_stopped_feed_gives_up_the_claims_of_what_can_never_run_and_keeps_those_of_what_may(done_ttl):
    """After Celery stopped its consumer (which flushes the pool): a prefork job flushed before it was
    written to a child never runs here (F3: its claim is given up, so the next worker runs it at once);
    one written to a child runs there (F1: its claim stays held, and the job goes back in the pool's
    books, which the flush dropped it from, so Celery settles it when it ends); a threads-pool job still
    runs; a request never given to the pool and dropped is given up; one whose job Celery no longer
    refers to cannot be told, and lapses.  The jobs, which Celery refers to only weakly, are held from
    the start of the warm shutdown, so the flush does not hide them."""
    import weakref

    from celery.worker import state as worker_state

    from celery_delayed.worker.intake import Intake

    pool_cache: dict = {}  # the flush dropped both prefork jobs from it
    jobs = {"unwritten": _Job(_write_to=None, _accepted=False, _cache=pool_cache, _job=1),
            "written": _Job(_write_to="child", _accepted=False, _cache=pool_cache, _job=2), "threads": _Job()}
    written = jobs["written"]
    requests = {task_id: SimpleNamespace(id=task_id, _apply_result=weakref.ref(job)) for task_id, job in jobs.items()}
    requests["dropped"] = SimpleNamespace(id="dropped", _apply_result=None)
    requests["gone"] = SimpleNamespace(id="gone", _apply_result=weakref.ref(_Job()))  # already collected
    intake = object.__new__(Intake)
    intake.claims, intake._requests, intake._jobs = _Claims(), dict(requests), {}
    intake.settings = SimpleNamespace(done_ttl=done_ttl)
    intake.in_hand = {task_id: SimpleNamespace(envelope=SimpleNamespace(task_id=task_id))
                      for task_id in [*requests, "running"]}
    handed_back: list = []
    intake._hand_back = handed_back.extend
    intake._on_shutting_down()  # worker_shutting_down
    del jobs  # Celery's pool flush drops its own references
    assert "dropped" not in worker_state.requests
    intake.let_go(running={"running"})
    assert sorted(intake.claims.released) == ["dropped", "unwritten"]
    handed = ["dropped", "unwritten"] if done_ttl else []  # to the broker, unless their runs go unremembered
    assert sorted(task.envelope.task_id for task in handed_back) == handed
    assert intake.claims.forgotten == ["gone"]
    assert list(intake.in_hand) == ["running"]
    assert pool_cache == {2: written}


def test_a_consumer_that_restarts_gives_up_the_claims_of_what_it_dropped_and_hands_nothing_back():
    """Celery restarts its consumer when the broker connection is lost, dropping the requests it held:
    their claims are given up, and the same worker reads their records again once its consumer is back;
    nothing goes to the broker, which only a stopping worker's tasks need (no ``worker_shutting_down``)."""
    from celery_delayed.worker.intake import Intake

    intake = object.__new__(Intake)
    intake.claims, intake._jobs, intake._shutting_down = _Claims(), {}, False
    intake._requests = {"dropped": SimpleNamespace(id="dropped", _apply_result=None)}
    intake.settings = SimpleNamespace(done_ttl=3600.0)
    intake.in_hand = {"dropped": SimpleNamespace(envelope=SimpleNamespace(task_id="dropped"))}
    handed_back: list = []
    intake._hand_back = handed_back.extend
    intake.let_go(running=set())
    assert intake.claims.released == ["dropped"] and handed_back == [] and not intake.in_hand


@pytest.mark.parametrize("shutting_down", [True, False])
def test_a_request_scheduled_while_celerys_on_close_ran_is_given_up_not_left_to_lapse(shutting_down):
    """An eventlet worker's ETA timer cancels (Celery's ``on_close``) let the other greenlets run: a
    record handed to Celery then was scheduled after on_close had looked, and stayed in Celery's
    ``requests`` though in none of its reserved, scheduled or active sets, its ETA timer entry pending.
    It never starts here (the gate is closed), yet its fate could not be told: its claim lapsed and
    it ran a run lease late (review 53: eventlet, 2 of 300 tasks 30 s late).  Its claim is given up
    (and it is handed back, on a stop), its timer entry cancelled so that a restarted consumer, its
    gate open again, never starts it too, and it leaves Celery's books.  A request Celery reserved
    may be in the pool: it still lapses."""
    from celery.worker import state as worker_state

    from celery_delayed.worker.intake import Intake

    class Request(SimpleNamespace):  # Celery's sets of requests hold them weakly
        __hash__ = object.__hash__

    stale = Request(id="stale", _apply_result=None, _eta_timer_entry="stale's entry")
    reserved = Request(id="reserved", _apply_result=None, _eta_timer_entry=None)
    cancelled: list = []
    intake = object.__new__(Intake)
    intake.c = SimpleNamespace(timer=SimpleNamespace(cancel=cancelled.append))
    intake.claims, intake._jobs, intake._shutting_down = _Claims(), {}, shutting_down
    intake._requests = {"stale": stale, "reserved": reserved}
    intake.settings = SimpleNamespace(done_ttl=3600.0)
    intake.in_hand = {task_id: SimpleNamespace(envelope=SimpleNamespace(task_id=task_id)) for task_id in intake._requests}
    handed_back: list = []
    intake._hand_back = handed_back.extend
    worker_state.requests.update(stale=stale, reserved=reserved)
    worker_state.reserved_requests.add(reserved)
    try:
        intake.let_go(running=set())
        assert intake.claims.released == ["stale"] and intake.claims.forgotten == ["reserved"]
        assert [task.envelope.task_id for task in handed_back] == (["stale"] if shutting_down else [])
        assert cancelled == ["stale's entry"]
        assert "stale" not in worker_state.requests and not intake.in_hand
    finally:
        worker_state.requests.pop("stale", None)
        worker_state.requests.pop("reserved", None)
        worker_state.reserved_requests.discard(reserved)
