"""Bulk scheduling from signatures: :func:`apply_many`.

Each signature is sent by its own ``apply_async``, so its message is exactly
what that call builds (headers, routing, serializer, ``before_task_publish`` /
``after_task_publish``, the task-sent event).  What changes is the writing: the
store writes of a chunk of signatures go to Redis as one pipelined
:meth:`.DelayedStore.schedule_many`, and their task-sent events follow in a few
broker messages of Celery's batched ``task.multi`` form (which Flower and
``celery events`` read as a worker's buffered events), once the chunk is stored.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from datetime import datetime
from typing import Callable, Iterable, Iterator

from celery import Celery, current_app
from celery.canvas import Signature
from celery.result import AsyncResult
from celery.utils import uuid

from celery_delayed.client.batch import Batch, batching
from celery_delayed.client.intercept import DelayedAMQP
from celery_delayed.client.template import Shapes

#: Signatures sent per chunk: their tasks are stored in one pipelined write.
CHUNK = 1000
#: The options that set a signature's due time.
_TIMES = frozenset(("eta", "countdown"))


class ApplyManyError(Exception):
    """:func:`apply_many` stopped at a signature it could not send, or at a failed store write.

    ``scheduled`` is how many of the signatures, in order, were sent and stored
    before it; ``unsent`` iterates over the others: copies already given their
    task ids, then the signatures not yet read.  ``apply_many(error.unsent)``
    sends each of them once (an id already scheduled keeps its stored copy).
    """

    def __init__(self, message: str, scheduled: int, unsent: Iterator[Signature]) -> None:
        super().__init__(message)
        self.scheduled = scheduled
        self.unsent = unsent


def apply_many(signatures: Iterable[Signature], *, eta: datetime | None = None, countdown: float | None = None,
               app: Celery | None = None, progress: Callable[[int], None] | None = None,
               per_task: bool = False) -> list[AsyncResult]:
    """Send ``signatures`` (of ``app``'s tasks, default the current app) as their ``apply_async`` would,
    the delayed ones written to the store a chunk at a time; returns their results, in order.

    Each signature keeps its own ``eta``/``countdown``, unless ``eta`` or
    ``countdown`` is given for all of them.  A signature due sooner than
    ``delayed_min_delay`` (or with no ETA) goes to the broker at once, as with
    ``apply_async``.  ``progress`` gets the number sent so far after each chunk.
    ``after_task_publish`` fires when a signature joins its chunk; the chunk is
    stored (and its task-sent events sent) before the next one is built.
    The signatures given are not changed: each is sent as a copy with its task id.
    Tasks of a shape already sent are made from its message (:mod:`.template`);
    ``per_task=True`` sends every one through ``apply_async`` instead.
    Raises :class:`ApplyManyError` when a signature cannot be sent or a store
    write fails for good; the signatures before it are scheduled, the others not.
    """
    if eta is not None and countdown is not None:
        raise TypeError("apply_many takes eta or countdown, not both")
    when = {"eta": eta} if eta is not None else {"countdown": countdown} if countdown is not None else {}
    app = app or current_app._get_current_object()
    if not isinstance(app.amqp, DelayedAMQP):
        raise RuntimeError("celery_delayed.install(app) was not called on this app")
    shapes = Shapes(app, when, enabled=not per_task)
    results: list[AsyncResult] = []
    chunk: list[Signature] = []
    rest = iter(signatures)
    for signature in rest:
        chunk.append(signature)
        if len(chunk) >= CHUNK:
            _send_chunk(app, shapes, chunk, when, results, progress, rest)
            chunk = []
    if chunk:
        _send_chunk(app, shapes, chunk, when, results, progress, rest)
    return results


def _copy_with_id(signature: Signature, when: dict, task_id: str | None = None) -> Signature:
    """A copy of ``signature`` holding its task id(s) (``task_id`` if given) before anything is sent
    (so an :class:`ApplyManyError`'s ``unsent`` sends it once), without the due time ``when``
    overrides (``apply_async`` would keep its own)."""
    copy = signature.clone()
    if when:
        for name in _TIMES:
            copy.options.pop(name, None)
    if type(copy) is Signature:
        copy.options.setdefault("task_id", task_id or uuid())  # (freeze() would also build a result to drop)
    else:
        copy.freeze()  # a canvas: ids for all its tasks
    return copy


@contextmanager
def results_subscribed_on_get(app: Celery) -> Iterator[None]:
    """No result subscription per task sent: ``AsyncResult.get()`` subscribes when it is called.

    Celery's Redis result backend subscribes to each task's result channel as it
    is sent (``on_task_call``), in case ``get()`` follows at once.  For tasks due
    in hours that is an open channel per task for nothing: a million of them in
    Redis, and a quarter of this call's time.  ``get()`` works the same without:
    it subscribes, then reads a result already stored.  ``app.backend`` belongs
    to this thread, so no other thread's sends are touched.
    """
    backend = app.backend
    backend.on_task_call = lambda producer, task_id: None
    try:
        yield
    finally:
        del backend.on_task_call


def _send_chunk(app: Celery, shapes: Shapes, chunk: list[Signature], when: dict, results: list[AsyncResult],
                progress: Callable[[int], None] | None, rest: Iterator[Signature]) -> None:
    """Send one chunk's signatures into a :class:`Batch`, then write it; ``results`` grows by what
    is stored.  A signature whose messages went around the batch is followed by a write, so every
    signature before a failure is stored and none after it is sent."""
    sent: list[AsyncResult] = []
    copies: list[Signature | str] = []  # per signature tried: its copy sent, or the id it was made with
    batch = Batch(app, sent)
    failed: Exception | None = None
    token = batching.set(batch)
    try:
        with app.producer_or_acquire() as producer, results_subscribed_on_get(app):
            for signature in chunk:
                shape = shapes.shape(signature)
                template = shapes.templates.get(shape) if shape is not None else None
                if template is not None and (made := shapes.make(template, signature)) is not None:
                    copies.append(made.task_id)
                    batch.items.append((made.task_id, made.due_ms, made.stored))
                    template.sent(made, signature.args, signature.kwargs, batch)
                    sent.append(template.result(made.task_id))
                    continue
                copies.append(copy := _copy_with_id(signature, when))
                batch.published = None
                sent.append(copy.apply_async(producer=producer, **when))
                if shape is not None:
                    shapes.learn(shape, copy, batch.published, sent[-1])
                if batch.bypassed:
                    batch.bypassed = False
                    batch.flush()
    except Exception as exc:
        failed = exc
    finally:
        batching.reset(token)
    try:
        batch.flush()  # the signatures sent before a failure are stored too
    except Exception as exc:
        failed = failed or exc
    results.extend(sent[:batch.durable])
    if failed is not None:
        unsent = (copy if isinstance(copy, Signature) else _copy_with_id(signature, when, copy)
                  for signature, copy in itertools.zip_longest(chunk[batch.durable:], copies[batch.durable:]))
        raise ApplyManyError(f"stopped at signature {len(results) + 1} ({chunk[batch.durable]!r}): {failed}",
                             scheduled=len(results), unsent=itertools.chain(unsent, rest)) from failed
    if progress:
        progress(len(results))
