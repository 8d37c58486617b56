"""A green worker's gate in front of its pool: tasks start only while the pool has a free slot.

Celery's gevent and eventlet pools have no semaphore in front of them (prefork has one): a task
handed to a full pool waits *inside* the pool's ``spawn``, in whichever greenlet handed it over
(Celery's ETA timer's, the Kafka feed's).  A warm stop then sees a request reserved and never
started, gives its run claim up to the next worker, and the task starts here too once a slot frees:
run twice.  The gate takes Celery's ``on_task_request`` (the seam every strategy and the ETA timer
hand a request to the pool through; a test pins it): a request starts at once while a slot is free,
else waits here, in order, until one is; a stop drops what waits, which never starts here.

So a green worker hands records to Celery as prefork does, ahead of their due time: Celery's
strategy reads the message, sends ``task-received`` and holds the request in its ETA timer, and
what is left at the due time is the pool's spawn, as for Celery's own ETA tasks.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from billiard.einfo import ExceptionInfo
from celery.exceptions import WorkerLostError
from celery.worker.state import revoked

#: Seconds between two looks at a full pool for a free slot.
POLL_GAP = 0.005


class PoolGate:
    """Stands for Celery's ``on_task_request`` (``start``) in a green worker (see the module)."""

    def __init__(self, pool: Any, timer: Any, start: Callable[[Any], Any]) -> None:
        self.pool, self.timer, self._start = pool, timer, start
        self._waiting: deque[Any] = deque()
        self._open = True
        self._looking = False  # a look for a free slot is scheduled

    def __call__(self, request: Any) -> None:
        if self._open:
            self._waiting.append(request)
            self._admit()

    def _admit(self) -> None:
        while self._open and self._waiting and free_slots(self.pool) > 0:
            self._start(self._waiting.popleft())
        if self._open and self._waiting and not self._looking:
            self._looking = True
            self.timer.call_after(POLL_GAP, self._look)

    def _look(self) -> None:
        self._looking = False
        self._admit()

    def close(self) -> None:
        """A stop began: what waits never starts here (:meth:`.Intake.let_go` gives its claim up)."""
        self._open = False
        self._waiting.clear()

    def reopen(self) -> None:
        """The consumer started again (after a broker connection was lost)."""
        self._open = True


def free_slots(pool: Any) -> int:
    """Free slots of a green worker's pool: Celery's gevent and eventlet pools keep theirs as
    ``_pool`` (gevent's ``Pool.free_count()``, eventlet's ``GreenPool.free()``; a test pins them)."""
    green = pool._pool
    return green.free_count() if hasattr(green, "free_count") else green.free()


def lost_when_killed(pool: Any) -> None:
    """A green pool's task whose greenlet Celery kills (its cancel at a cold shutdown, SIGQUIT, or at a lost
    broker connection) ends as a lost worker's, as a killed prefork child's does: acks_late and
    reject_on_worker_lost put it back through the store, and it runs again.  Celery's gevent and eventlet
    pools report it a success (``(False, None, None)``, their ``_make_killable_target``, a test pins it):
    acknowledged, its record settled and committed, it never ran again.  A task revoked with
    ``terminate=True`` is killed on purpose: Celery's own report stands (acknowledged, as a terminated
    prefork child's), not put back where a worker that does not remember the revoke would run it again."""
    from greenlet import GreenletExit  # a green pool's: not installed with celery-delayed alone

    def killable(target: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return target(*args, **kwargs)
            except GreenletExit as exc:
                if len(args) > 1 and args[1] in revoked:  # the task id (Request.execute_using_pool's)
                    return False, None, None
                try:
                    raise WorkerLostError(f"its greenlet was killed ({exc!r})") from exc
                except WorkerLostError:
                    return True, ExceptionInfo(), None  # failed: Celery's Request.on_success calls on_failure
        return run

    # on the class, not the instance: Celery's eventlet pool calls TaskPool._make_killable_target
    type(pool)._make_killable_target = staticmethod(killable)
