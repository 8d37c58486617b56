"""Tasks that fail for good are parked in the dead-letter queue, ready to be requeued.

"For good" is Celery's own verdict: the ``task_failure`` signal fires once a
task's retries are exhausted (or when it allows none), never for a retry.  A
failure after the body returned or retried (storing its result or its retry
state, or sending its callbacks, failed, say while Redis restarts) is not
parked: the task ran, or its retry is scheduled, and a requeue would run it
again.  Such a failure's traceback passes through a step of :data:`AFTER_BODY`;
Celery reports it from the pool child, or from the worker's main process when
recording the failure failed too (its ``Request.on_failure``), so the check
reads the formatted traceback, which both carry.  The handler rebuilds the
task's message as Celery would publish it, with the same task id, so
``celery delayed dlq requeue`` can run it again unchanged.
"""
from __future__ import annotations

import re
import threading
from typing import Any

from celery import Celery, Task, signals

from celery_delayed import inert
from celery_delayed.envelope import Envelope, executing, serialize
from celery_delayed.store.dlq import DeadLetter, DeadLetters, reason_of
from celery_delayed.store.outcomes import write_retrying

logger = inert.logger(__name__)

#: Steps of Celery's tracer (celery.app.trace) that run only once a task's body returned or retried.
AFTER_BODY = ("mark_as_done", "_dispatch_callbacks_and_chain", "handle_retry")
_AFTER_BODY_FRAME = re.compile(rf'^  File ".*", line \d+, in (?:{"|".join(AFTER_BODY)})$', re.MULTILINE)


def park_failures(app: Celery) -> None:
    """Connect the ``task_failure`` handler for ``app``'s tasks."""

    def on_failure(sender: Task | None = None, task_id: str | None = None, exception: BaseException | None = None,
                   args: Any = None, kwargs: Any = None, einfo: Any = None, **_: Any) -> None:
        if (sender is None or task_id is None or sender.app is not app
                or not app.amqp.delayed_settings.dead_letter_failures):
            return
        if after_body(getattr(einfo, "traceback", None)):
            logger.warning("task %s failed after its body ran (%s: %s): not parked in the dead-letter queue, "
                           "where a requeue would run it again", task_id, type(exception).__name__, exception)
            return
        try:
            letter = DeadLetter(task_id=task_id, reason=reason_of(exception),
                                source="worker", traceback=str(einfo or ""),
                                attempts=(sender.request.retries or 0) + 1,
                                message=_envelope(sender, task_id, args or (), kwargs or {}))
        except Exception:  # the failure itself is already recorded by Celery; never mask it
            logger.exception("could not build the dead letter of failed task %s", task_id)
            return
        _park(DeadLetters(app.amqp.delayed_store), letter, in_pool=executing(sender.request, task_id))

    signals.task_failure.connect(on_failure, weak=False)


#: Task ids whose dead letter a background thread is writing; guarded by :data:`_parking_lock`.
_parking: dict[str, int] = {}
_parking_lock = threading.Lock()


def parking(task_id: str) -> bool:
    """Whether the dead letter of ``task_id`` is being written in the background: its Kafka record
    must stay unsettled until it is, or a worker that died meanwhile would leave it nowhere."""
    with _parking_lock:
        return task_id in _parking


def _park(dead_letters: DeadLetters, letter: DeadLetter, in_pool: bool) -> None:
    """Add ``letter``, retrying while the store is down (every 2 s at most, logged), as the retry
    of a running task is: given up, nothing else would park it.  In the pool child that ran the
    task (``in_pool``) it is done before its message is acknowledged; anywhere else (the worker's
    main process, whose event loop must not stall, for a hard time limit or a ``Reject``; an eager
    call) in a daemon thread, the task id :func:`parking` meanwhile (Celery sends ``task_failure``
    there before it acknowledges the message, and the intake holds the record until then)."""
    if not in_pool:
        with _parking_lock:
            _parking[letter.task_id] = _parking.get(letter.task_id, 0) + 1
        try:
            threading.Thread(target=_park_in_background, args=(dead_letters, letter), name="delayed-park",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had: one try here, the record held no longer
            _parked(letter.task_id)
            logger.exception("no thread to park failed task %s in: trying once, here", letter.task_id)
            dead_letters.add(letter)
        return
    try:
        write_retrying(dead_letters.add, (letter,), forever=True,
                       failed=f"task {letter.task_id} failed for good, but the dead-letter queue cannot be written")
    except Exception:  # not a store outage: the failure itself is already recorded by Celery
        logger.exception("could not park failed task %s in the dead-letter queue", letter.task_id)


def _park_in_background(dead_letters: DeadLetters, letter: DeadLetter) -> None:
    try:
        _park(dead_letters, letter, in_pool=True)
    finally:
        _parked(letter.task_id)


def _parked(task_id: str) -> None:
    """One background park of ``task_id`` is over (see :func:`parking`)."""
    with _parking_lock:
        _parking[task_id] -= 1
        if not _parking[task_id]:
            del _parking[task_id]


def after_body(traceback: str | None) -> bool:
    """Whether a formatted traceback (``einfo.traceback``) passes through a step of :data:`AFTER_BODY`."""
    return bool(traceback and _AFTER_BODY_FRAME.search(traceback))


def _envelope(task: Task, task_id: str, args: Any, kwargs: Any) -> bytes:
    """The failed task's message, rebuilt as Celery builds it (same id, args and lineage)."""
    request = task.request
    queue = (request.delivery_info or {}).get("routing_key") or task.app.conf.task_default_queue
    hard, soft = request.timelimit or (None, None)  # Celery's header order: [time_limit, soft_time_limit]
    headers, properties, body, _ = task.app.amqp.create_task_message(
        task_id, task.name, list(args), dict(kwargs), retries=request.retries or 0, root_id=request.root_id,
        parent_id=request.parent_id, group_id=request.group, group_index=request.group_index,
        reply_to=request.reply_to or "", callbacks=request.callbacks, errbacks=request.errbacks,
        chain=request.chain, chord=request.chord, time_limit=hard, soft_time_limit=soft,
        ignore_result=request.ignore_result)
    data, content_type, content_encoding = serialize(body, task.serializer, None, headers)
    return Envelope(task_id=task_id, queue=queue, headers=headers, body=data, content_type=content_type,
                    content_encoding=content_encoding,
                    properties={k: v for k, v in properties.items() if v not in (None, "")}).encode()
