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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal, TypeVar, overload

from celery import Celery, current_app
from celery.canvas import Signature
from celery.result import AsyncResult
from celery.utils import uuid

from celery_delayed.client.batch import Batch, batching, events_dispatcher
from celery_delayed.client.intercept import DelayedAMQP
from celery_delayed.client.template import Shapes, Template

#: Signatures sent per chunk: their tasks are stored in one pipelined write.
CHUNK = 1000
T = TypeVar("T")
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


class Results(Sequence[AsyncResult]):
    """The results of :func:`apply_many`, in order, each made when it is read: a task made from a
    template is held as its id (an ``AsyncResult`` apiece was most of the memory of a campaign)."""

    def __init__(self) -> None:
        self._sent: list[AsyncResult | tuple[Template, str]] = []

    def __len__(self) -> int:
        return len(self._sent)

    @overload
    def __getitem__(self, index: int) -> AsyncResult: ...

    @overload
    def __getitem__(self, index: slice) -> list[AsyncResult]: ...

    def __getitem__(self, index: int | slice) -> AsyncResult | list[AsyncResult]:
        if isinstance(index, slice):
            return [_result(sent) for sent in self._sent[index]]
        return _result(self._sent[index])

    def __add__(self, other: Iterable[AsyncResult]) -> list[AsyncResult]:
        return [*self, *other]

    def __radd__(self, other: Iterable[AsyncResult]) -> list[AsyncResult]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"<Results of {len(self)} tasks>"

    @property
    def ids(self) -> list[str]:
        """The task ids, without making their results."""
        return [sent[1] if isinstance(sent, tuple) else sent.id for sent in self._sent]


def _result(sent: AsyncResult | tuple[Template, str]) -> AsyncResult:
    return sent[0].result(sent[1]) if isinstance(sent, tuple) else sent


@overload
def apply_many(signatures: Iterable[Signature], *, eta: datetime | None = ..., countdown: float | None = ...,
               app: Celery | None = ..., progress: Callable[[int], None] | None = ..., per_task: bool = ...,
               results: Literal[True] = ...) -> Results: ...


@overload
def apply_many(signatures: Iterable[Signature], *, eta: datetime | None = ..., countdown: float | None = ...,
               app: Celery | None = ..., progress: Callable[[int], None] | None = ..., per_task: bool = ...,
               results: Literal[False]) -> int: ...


def apply_many(signatures: Iterable[Signature], *, eta: datetime | None = None, countdown: float | None = None,
               app: Celery | None = None, progress: Callable[[int], None] | None = None,
               per_task: bool = False, results: bool = True) -> Results | int:
    """Send ``signatures`` (of ``app``'s tasks, default the current app) as their ``apply_async`` would,
    the delayed ones written to the store a chunk at a time; returns their results, in order
    (:class:`Results`, a sequence), or with ``results=False`` only how many were sent: then the
    client's memory stays flat whatever the number of signatures (a generator is read as it goes).

    Each signature keeps its own ``eta``/``countdown``, unless ``eta`` or
    ``countdown`` is given for all of them.  A signature due sooner than
    ``delayed_min_delay`` (or with no ETA) goes to the broker at once, as with
    ``apply_async``.  ``progress`` gets the number sent and stored so far after each chunk.
    ``after_task_publish`` fires when a signature joins its chunk; a chunk is
    written (then its task-sent events sent) while the next one is built.
    The signatures given are not changed: each is sent as a copy with its task id.
    Tasks of a shape already sent are made from its message (:mod:`.template`);
    ``per_task=True`` sends every one through ``apply_async`` instead.
    Raises :class:`ApplyManyError` when a signature cannot be sent, a store
    write fails for good, ``signatures`` raises as it is read (what it gave
    before is sent first), or ``progress`` raises; the signatures before it are
    scheduled, the others not.
    """
    if eta is not None and countdown is not None:
        raise TypeError("apply_many takes eta or countdown, not both")
    when = {"eta": eta} if eta is not None else {"countdown": countdown} if countdown is not None else {}
    app = app or current_app._get_current_object()
    if not isinstance(app.amqp, DelayedAMQP):
        raise RuntimeError("celery_delayed.install(app) was not called on this app")
    shapes = Shapes(app, when, enabled=not per_task)
    dispatcher = events_dispatcher(app)  # the chunks' (a dispatcher is a connection's transport: ms to make)
    done = Results()
    count = 0
    rest = iter(signatures)
    writing: tuple[_Chunk, Future] | None = None
    broken: Exception | None = None  # what reading ``signatures`` raised
    # a chunk's tasks are deflated (the deflater) while the chunk before is written, both while the next is made
    with ThreadPoolExecutor(1, thread_name_prefix="delayed-apply-many") as writer, \
            ThreadPoolExecutor(1, thread_name_prefix="delayed-deflate") as deflater:  # wait for what is in flight
        while not broken:
            chunk, broken = read_chunk(rest, CHUNK)
            if not chunk:
                break
            built = _Chunk(app, shapes, chunk, when, writing and writing[1], dispatcher)
            deflating = deflater.submit(built.batch.deflate)
            if writing:  # the chunk before is stored first
                count = _settle(*writing, done if results else None, count, progress,
                                itertools.chain(built.unsent(), rest))
            writing = built, writer.submit(built.write, deflating)
            if built.failed:
                break
        if writing:
            count = _settle(*writing, done if results else None, count, progress, rest)
    if broken:
        raise ApplyManyError(f"stopped at signature {count + 1}: reading the signatures raised "
                             f"{type(broken).__name__}: {broken}", scheduled=count, unsent=iter(())) from broken
    return done if results else count


def read_chunk(items: Iterator[T], size: int) -> tuple[list[T], Exception | None]:
    """Up to ``size`` of ``items``, and what reading them raised (None): those read before it are
    sent, not lost with the error."""
    chunk: list[T] = []
    try:
        chunk.extend(itertools.islice(items, size))
    except Exception as exc:
        return chunk, exc
    return chunk, None


class _Chunk:
    """One chunk's signatures sent into a :class:`Batch` (built at once, written by :meth:`write`).

    A signature whose messages went around the batch is preceded by a write of
    the batch (after the chunk before it), so every signature before a failure is
    stored and none after it is sent.
    """

    def __init__(self, app: Celery, shapes: Shapes, signatures: list[Signature], when: dict,
                 before: Future | None, dispatcher: Any) -> None:
        self.signatures, self.when = signatures, when
        self.sent: list[AsyncResult | tuple[Template, str]] = []
        self.copies: list[Signature | str] = []  # per signature tried: its copy sent, or the id it was made with
        self.batch = batch = Batch(app, self.sent, before, dispatcher)
        self.store = app.amqp.delayed_store
        self.failed: Exception | None = None
        token = batching.set(batch)
        try:
            with app.producer_or_acquire() as producer, results_subscribed_on_get(app):
                for signature in signatures:
                    self._send(shapes, signature, producer)
        except Exception as exc:
            self.failed = exc
        finally:
            batching.reset(token)

    def _send(self, shapes: Shapes, signature: Signature, producer: Any) -> None:
        batch, when = self.batch, self.when
        shape = shapes.shape(signature)
        template = shapes.templates.get(shape) if shape is not None else None
        if template is not None and (made := shapes.make(template, signature)) is not None:
            self.copies.append(made.task_id)
            batch.add_made(made.task_id, self.store.on_store_clock(made.due_ms), made.frame, template.queue)
            template.sent(made, signature.get("args"), signature.get("kwargs"), batch)
            self.sent.append((template, made.task_id))
            return
        self.copies.append(copy := _copy_with_id(signature, when))
        batch.published = None
        self.sent.append(result := copy.apply_async(producer=producer, **when))
        if shape is not None:
            shapes.learn(shape, copy, batch.published, result)
        if batch.bypassed:
            batch.bypassed = False
            batch.flush()

    def write(self, deflating: Future) -> None:
        """Store what the chunk sent (also before a failure), once ``deflating`` (its tasks) is done;
        raise its failure, if any."""
        try:
            deflating.result()
            self.batch.flush()
        except Exception as exc:
            self.failed = self.failed or exc
        if self.failed is not None:
            raise self.failed

    def unsent(self) -> Iterator[Signature]:
        """Copies of the signatures not stored, those tried with the ids they were sent with."""
        durable = self.batch.durable
        for signature, copy in itertools.zip_longest(self.signatures[durable:], self.copies[durable:]):
            yield copy if isinstance(copy, Signature) else _copy_with_id(signature, self.when, copy)


def _settle(chunk: _Chunk, write: Future, done: Results | None, count: int,
            progress: Callable[[int], None] | None, rest: Iterator[Signature]) -> int:
    """Wait for ``chunk``'s write; add its results; return the count stored so far.  Raises
    :class:`ApplyManyError` (with ``rest``, the signatures after the chunk) when it failed, or when
    ``progress`` raised."""
    failed = write.exception()
    durable = chunk.batch.durable
    if done is not None:
        done._sent.extend(chunk.sent[:durable])
    count += durable
    if failed is not None:
        raise ApplyManyError(f"stopped at signature {count + 1} ({chunk.signatures[durable]!r}): {failed}",
                             scheduled=count, unsent=itertools.chain(chunk.unsent(), rest)) from failed
    if progress:
        try:
            progress(count)
        except Exception as exc:  # the caller's: the count and the rest must not be lost with it
            raise ApplyManyError(f"stopped after signature {count}: the progress callback raised "
                                 f"{type(exc).__name__}: {exc}", scheduled=count, unsent=rest) from exc
    return count


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
