"""Durable revoke: a revoked task that is still scheduled is taken out of the store.

Celery's revoke is a broadcast that workers keep in memory, so a task due weeks
later, or after every worker restarted, would run anyway.  :class:`DelayedControl`
(the app's ``control_cls`` once :func:`celery_delayed.install` ran, so
``AsyncResult.revoke``, ``app.control.revoke`` and Flower's revoke all go through
it) first remembers every revoked id in Redis for ``delayed_revoke_days``,
then removes each from the store for good and records it as REVOKED, as a
worker would have; then it broadcasts Celery's revoke as usual.  A worker
checks that record before it runs a task (:meth:`celery_delayed.worker.once.RunClaims.acquire`), so a
task already claimed by a poller or waiting on Kafka, or one that was running
and retries into the store, does not run either, on any worker, started when
it may.
"""
from __future__ import annotations

from typing import Any

from billiard.common import TERM_SIGNAME
from celery import Celery
from celery.app.control import Control
from celery.app.task import Context
from celery.utils.functional import maybe_list
from kombu.serialization import prepare_accept_content

from celery_delayed import inert
from celery_delayed.envelope import Envelope, EnvelopeError
from celery_delayed.store.outcomes import Change
from celery_delayed.store.records import remember_revoked

logger = inert.logger(__name__)


class DelayedControl(Control):
    """Celery's remote control, with a revoke that also reaches the delayed store."""

    def revoke(self, task_id: str | list[str], destination: Any = None, terminate: bool = False,
               signal: str = TERM_SIGNAME, **kwargs: Any) -> Any:
        """Take still-scheduled tasks out of the store for good, then broadcast Celery's revoke.

        The broadcast goes out even when the store cannot be reached (the error
        is raised after it), so workers still drop the task while they live.
        """
        try:
            cancel_scheduled(self.app, maybe_list(task_id))
        finally:
            reply = super().revoke(task_id, destination=destination, terminate=terminate, signal=signal, **kwargs)
        return reply


def cancel_scheduled(app: Celery, task_ids: list[str], reason: str = "revoked") -> dict[str, Change]:
    """Remove tasks from ``app``'s store, recording each one removed as REVOKED (with ``reason``).

    Returns, per id, ``Change.DONE``, ``UNKNOWN`` (not in the store) or ``IN_FLIGHT``
    (a poller is dispatching it: only a worker can drop it now).
    """
    store = app.amqp.delayed_store
    outcomes = {}
    remember_revoked(store, task_ids)  # first: a worker must not run what is cancelled next
    for task_id, removed in store.cancel_many(task_ids).items():
        outcomes[task_id] = Change.DONE if isinstance(removed, bytes) else removed
        if isinstance(removed, bytes):
            try:
                envelope = Envelope.decode(removed)
            except EnvelopeError:
                envelope = None
            record_revoked(app, task_id, envelope, reason=reason)
    return outcomes


def cancel_or_revoke(app: Celery, task_ids: list[str]) -> dict[str, Change]:
    """:func:`cancel_scheduled`, then Celery's revoke for the tasks a poller is already dispatching
    (IN_FLIGHT), so the workers drop them instead: what an operator's cancel means."""
    outcomes = cancel_scheduled(app, task_ids)
    dispatching = [task_id for task_id, outcome in outcomes.items() if outcome is Change.IN_FLIGHT]
    if dispatching:
        app.control.revoke(dispatching)
    return outcomes


def record_revoked(app: Celery, task_id: str, envelope: Envelope | None, reason: str,
                   expired: bool = False) -> None:
    """Record a task that will never run as a worker records a revoked one.

    The result backend gets REVOKED with ``reason`` (so ``AsyncResult.get()``
    raises ``TaskRevokedError`` instead of waiting for ever); a chord member
    counts as a finished part of its chord, as in a worker, so the chord
    completes (with Celery's ``ChordError``) rather than waiting for ever;
    when task events are on, a ``task-revoked`` event is sent for Flower.  A
    failure here is logged, not raised: the task will not run either way.
    """
    request = Context(_request_of(app, task_id, envelope),
                      delivery_info={"routing_key": envelope.queue if envelope else None})
    try:
        app.backend.mark_as_revoked(task_id, reason=reason, request=request)
        if app.conf.task_send_sent_event or app.conf.worker_send_task_events:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-revoked", uuid=task_id, terminated=False, signum=None, expired=expired)
    except Exception as exc:
        logger.warning("task %s will not run (%s), but recording it as revoked failed: %r", task_id, reason, exc)


def _request_of(app: Celery, task_id: str, envelope: Envelope | None) -> dict[str, Any]:
    """What a worker's request for the message would hold: its headers and what the body
    embeds (chord, chain, callbacks); just the id when the message cannot be read."""
    if envelope is None:
        return {"id": task_id}
    try:
        return {**envelope.headers, **envelope.embed(prepare_accept_content(app.conf.accept_content))}
    except Exception as exc:  # a body this process cannot load: the headers still say what it was
        logger.warning("task %s: body not readable here (%r); recorded from its headers only", task_id, exc)
        return dict(envelope.headers)
