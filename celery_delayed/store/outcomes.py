"""What the store answers besides data: its errors, and the named outcomes of its scripts.

Each error says what happened and what the caller may do; :class:`Change` and
:class:`Stored` name the answer codes of ``lua/cancel.lua``, ``lua/reschedule.lua``
and ``lua/schedule.lua``, turned into errors in one place (:meth:`Change.check`).
"""
from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any, NoReturn
from collections.abc import Callable, Mapping

import redis
from billiard.exceptions import SoftTimeLimitExceeded
from kombu.utils.functional import retry_over_time

from celery_delayed import inert
from celery_delayed.settings import ConfigurationError
from celery_delayed.store.redis_client import UNREACHABLE

logger = inert.logger(__name__)


class StoreUnavailable(RuntimeError):
    """The delayed store's Redis could not be reached; nothing was written.

    Not an ``OSError``: Celery's ``send_task`` would turn one into kombu's
    ``OperationalError``, as if the broker were down.
    """


class StoreRefused(StoreUnavailable):
    """The delayed store's Redis answered but refuses the command whatever it is: full under
    ``noeviction``, a read-only replica, an ACL that denies it... (:data:`.redis_client.REFUSALS`).
    Like an unreachable store, one to try again later, or to fix: not a wrong command."""


class StoreNotDurable(StoreUnavailable):
    """A store write (tasks scheduled, a dead letter) was not confirmed durable in time
    (``delayed_schedule_wait``).

    It is on the primary, but may be lost if the primary fails now; writing it
    again is safe (stored ids and dead letters keep one copy).
    """


#: What a call to the store's Redis raises when it should simply be tried again later:
#: unreachable (standalone or cluster), read-only after a failover, out of memory...
STORE_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, *UNREACHABLE, StoreUnavailable)
#: Longest wait (s) between tries of a store write that is never given up while the store is
#: down: a running task's retry, or its dead letter (given up, the task would be lost).
PERSIST_MAX_INTERVAL = 2.0

def write_retrying(write: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any] | None = None, *,
                   failed: str, policy: Mapping[str, Any] | None = None, forever: bool = False,
                   errors: tuple[type[Exception], ...] = STORE_ERRORS,
                   unless: tuple[type[Exception], ...] = ()) -> Any:
    """``write(*args, **kwargs)``, tried again while it raises one of ``errors`` (the store refuses
    it) but none of ``unless`` (raised at once), each refusal logged as ``failed`` with the error and
    the wait.  ``policy`` has the fields of Celery's publish retry policy; ``forever`` ignores its
    ``max_retries`` and waits up to :data:`PERSIST_MAX_INTERVAL`.

    A write done ``forever`` (a running task's retry, a dead letter) is not given up to a task's
    ``soft_time_limit`` firing meanwhile either: Celery would turn that into a failure for good
    (``Task.retry`` rejects the task), its retries left unused, though only the store was away.
    The limit is logged and the write goes on; the hard limit still ends the task.
    """
    policy = policy or {}

    def on_error(exc: Exception, intervals: Any, retries: int) -> float:
        wait = next(intervals)
        logger.warning("%s (%s); retry %d in %.1f s", failed, exc, retries + 1, wait)
        return wait

    def attempt(*args: Any, **kwargs: Any) -> Any:
        try:
            return write(*args, **kwargs)
        except unless as exc:
            raise _GiveUp(exc) from exc

    while True:
        try:
            return retry_over_time(
                attempt, errors, args=args, kwargs=dict(kwargs or {}), errback=on_error,
                max_retries=None if forever else policy.get("max_retries", 3),
                interval_start=policy.get("interval_start", 0), interval_step=policy.get("interval_step", 0.2),
                interval_max=max(policy.get("interval_max", 0.2), PERSIST_MAX_INTERVAL if forever else 0))
        except _GiveUp as given_up:
            raise given_up.error from None
        except SoftTimeLimitExceeded:
            if not forever:
                raise
            logger.warning("%s: the task's soft time limit passed meanwhile; the write goes on", failed)


class _GiveUp(Exception):
    """Carries an error of :func:`write_retrying`'s ``unless`` past its retries."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class LayoutMismatch(ConfigurationError):
    """The store's Redis was laid out with other settings than this process's: it must not touch it."""


class Fenced(RuntimeError):
    """A newer leader owns the partition: this poller must stop dispatching it."""


class TaskNotScheduled(LookupError):
    """The store holds no task with that id (never scheduled, or already dispatched)."""


class TaskInFlight(RuntimeError):
    """A poller is dispatching the task: the store can no longer change it."""


class Change(IntEnum):
    """What ``cancel.lua`` and ``reschedule.lua`` answer for one task id (their headers use these numbers)."""

    DONE = 1  # cancelled, or moved to its new due time
    UNKNOWN = 0  # the store holds no task with that id
    IN_FLIGHT = -1  # a poller is dispatching it: the store can no longer change it

    def check(self, task_id: str, verb: str) -> None:
        """Raise :class:`TaskNotScheduled` or :class:`TaskInFlight`, naming the task, unless DONE."""
        if self is not Change.DONE:
            self.refuse(task_id, verb)

    def refuse(self, task_id: str, verb: str) -> NoReturn:
        """Raise :class:`TaskNotScheduled` (UNKNOWN) or :class:`TaskInFlight` (IN_FLIGHT), naming the task."""
        if self is Change.UNKNOWN:
            raise TaskNotScheduled(f"no scheduled task with id {task_id}")
        raise TaskInFlight(f"task {task_id} is already being dispatched; it can no longer be {verb}")


class Stored(str, Enum):
    """What :meth:`DelayedStore.schedule` did with a task."""

    ADDED = "added"  # the id was new to the store
    REPLACED = "replaced"  # an older attempt, or the same one in flight, gave way to it
    KEPT = "kept"  # the copy already scheduled stays; this one was not stored
