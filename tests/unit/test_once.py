"""Attempt numbers (celery_delayed.worker.once): pure logic."""
from celery_delayed.envelope import attempt_of


def test_a_replacement_is_a_later_attempt_than_every_attempt_of_the_task_it_replaced():
    """Task.replace keeps the task id and starts retries over at 0, one nesting level deeper (F6)."""
    assert attempt_of({}) == 0 and attempt_of({"retries": 3}) == 3
    assert attempt_of({"retries": 0, "replaced_task_nesting": 1}) > attempt_of({"retries": 40})
    later, earlier = {"retries": 2, "replaced_task_nesting": 1}, {"retries": 1, "replaced_task_nesting": 1}
    assert attempt_of(later) > attempt_of(earlier)
    assert attempt_of({"retries": True, "replaced_task_nesting": "x"}) == 0 == attempt_of(None)
