"""worker/gate.py: a green pool's gate starts requests in order while a slot is free, keeps the rest
until one frees, and starts none of them once a stop closed it."""
from __future__ import annotations

from types import SimpleNamespace

from celery_delayed.worker.gate import POLL_GAP, PoolGate


class Slots:
    """A stand-in for a gevent pool (``_pool.free_count()``)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self._pool = self

    def free_count(self) -> int:
        return self.free


class Timer:
    """Keeps what the gate asks to be called later; ``fire`` calls it."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_after(self, seconds: float, fun) -> None:
        assert seconds == POLL_GAP
        self.calls.append(fun)

    def fire(self) -> None:
        calls, self.calls = self.calls, []
        for fun in calls:
            fun()


def gate(free: int) -> tuple[PoolGate, Slots, Timer, list[str]]:
    pool, timer, started = Slots(free), Timer(), []

    def start(request) -> None:
        started.append(request.id)
        pool.free -= 1

    return PoolGate(pool, timer, start), pool, timer, started


def req(task_id: str) -> SimpleNamespace:
    return SimpleNamespace(id=task_id)


def test_requests_start_in_order_while_slots_are_free_and_the_rest_when_one_frees():
    g, pool, timer, started = gate(free=2)
    for task_id in "abcd":
        g(req(task_id))
    assert started == ["a", "b"] and len(timer.calls) == 1  # one look scheduled, however many wait
    timer.fire()
    assert started == ["a", "b"] and len(timer.calls) == 1  # still full: looks again
    pool.free = 1
    timer.fire()
    assert started == ["a", "b", "c"]
    pool.free = 5
    g(req("e"))  # a new request waits behind the one before it
    assert started == ["a", "b", "c", "d", "e"]
    timer.fire()
    assert timer.calls == [] and started == ["a", "b", "c", "d", "e"]


def test_a_closed_gate_starts_nothing_that_waited_nor_anything_after_until_reopened():
    g, pool, timer, started = gate(free=0)
    g(req("a"))
    g.close()
    pool.free = 3
    timer.fire()
    g(req("b"))
    assert started == []
    g.reopen()
    g(req("c"))
    assert started == ["c"]
