"""Store writes tried again while the store is away (celery_delayed.store.outcomes.write_retrying)."""
import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_delayed.store.outcomes import write_retrying


def _writes(*outcomes):
    """A write that raises or returns each of ``outcomes`` in turn; the calls are counted."""
    calls = []

    def write():
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return write, calls


def test_a_retry_waiting_for_the_store_is_not_given_up_to_the_tasks_soft_time_limit():
    """F7: the soft time limit fired while a running task's retry waited for the store; Celery turned
    it into Reject(requeue=False): the task failed for good, its retries unused.  The write goes on."""
    write, calls = _writes(RedisConnectionError("down"), SoftTimeLimitExceeded(), RedisConnectionError("down"),
                           "stored")
    assert write_retrying(write, (), failed="the retry", policy={"interval_max": 0}, forever=True) == "stored"
    assert len(calls) == 4


def test_a_write_that_may_be_given_up_gives_way_to_the_soft_time_limit():
    write, _ = _writes(RedisConnectionError("down"), SoftTimeLimitExceeded())
    with pytest.raises(SoftTimeLimitExceeded):
        write_retrying(write, (), failed="a first attempt", policy={"max_retries": 5})
