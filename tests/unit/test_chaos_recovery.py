"""The chaos report's recovery times (:func:`tests.chaos.check.recovery_s`), on made-up executions."""
from __future__ import annotations

from tests.chaos.check import recovery_s
from tests.chaos.faults import Injected

S = 1000  # ms

#: A fault from 10 s to 20 s into a load due from 0 to 100 s.
FAULT = Injected("x", 10 * S, 20 * S, "")
LOAD_END = 100 * S


def executions(late_until_s: float, end_s: float = 100, step_ms: int = 100) -> list[tuple[int, bool]]:
    """One execution every ``step_ms`` from 0 to ``end_s``, late while due before ``late_until_s``."""
    return [(due, due >= late_until_s * S) for due in range(0, int(end_s * S) + 1, step_ms)]


def test_back_when_every_task_of_a_whole_window_is_on_time_again():
    assert recovery_s(FAULT, executions(late_until_s=33), LOAD_END) == 23.0  # from the fault's start


def test_back_at_once_when_nothing_after_the_fault_was_late():
    assert recovery_s(FAULT, executions(late_until_s=15), LOAD_END) == 10.0


def test_late_until_the_load_ran_out_is_after_the_load_not_never_back():
    """The workers still worked off a backlog when the last task came due; every task ran (the full runs of
    2026-12 showed "not back" for every fault this way), so it came back after the load."""
    assert recovery_s(FAULT, executions(late_until_s=200), LOAD_END) == "after the load"
    assert recovery_s(FAULT, executions(late_until_s=99), LOAD_END) == "after the load"  # a clean tail, no window


def test_never_back_when_nothing_due_after_the_fault_ran():
    assert recovery_s(FAULT, executions(late_until_s=0, end_s=19), LOAD_END) is None


def test_a_fault_that_ended_with_the_load_is_after_the_load():
    assert recovery_s(Injected("x", 90 * S, 99 * S, ""), executions(late_until_s=0), LOAD_END) == "after the load"


def test_one_late_task_in_a_window_puts_the_window_off():
    on_time = [(due, ok and due != 31 * S) for due, ok in executions(late_until_s=30)]
    assert recovery_s(FAULT, on_time, LOAD_END) == 21.1  # the first window after the late one at 31 s
