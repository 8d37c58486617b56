"""Tasks a drain sent to Celery's broker (``delayed drain --to-broker``) run once, as from Kafka.

A drained task may have a copy in Kafka too: its poller died after delivering it, or a drain ran
beside live pollers.  The drain skips a task that ended or runs (:func:`.once.look`), but a Kafka
copy can start after that check.  So an installed worker takes a broker message carrying the
:data:`.once.DRAINED` header through the Kafka path's own check (:func:`.once.admit`) before
Celery's task strategy sees it: it runs holding the task's run claim (kept through Celery's ETA
wait, given up when Celery acks or rejects it), is acknowledged without running when the task
ended or was revoked, and is checked again when another copy runs.  Other broker messages go
straight to Celery: one dict lookup more.
"""
from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable

from kombu.message import Message

from celery_delayed import inert
from celery_delayed.envelope import Envelope
from celery_delayed.store.revoke import record_revoked
from celery_delayed.worker.intake import TRANSIENT_ERRORS, copy_of
from celery_delayed.worker.once import ADMISSION_RETRY, DRAINED, FROM_KAFKA, HANDED_BACK, Admit, RunClaims, admit

logger = inert.logger(__name__)


def guard_drained(c: Any, claims: RunClaims) -> None:
    """Put :class:`Guard` in front of each of the consumer's task strategies (Celery makes them
    anew at each consumer start, before this is called)."""
    c.strategies.update({name: Guard(c, claims, strategy) for name, strategy in c.strategies.items()})


class Guard:
    """A task strategy that lets a drained broker message through only once its task may run."""

    def __init__(self, c: Any, claims: RunClaims, strategy: Callable[..., Any]) -> None:
        self.c = c
        self.claims = claims
        self.strategy = strategy

    def __call__(self, message: Message, body: Any, ack: Callable, reject: Callable, callbacks: Any,
                 **kwargs: Any) -> Any:
        headers = message.headers or {}
        if DRAINED not in headers or FROM_KAFKA in headers:  # a broker task of its own, or a copy from Kafka
            return self.strategy(message, body, ack, reject, callbacks, **kwargs)
        self._admit(message, body, ack, reject, callbacks)

    def _admit(self, message: Message, body: Any, ack: Callable, reject: Callable, callbacks: Any) -> None:
        """Run, skip or check again later (the message unacknowledged meanwhile)."""
        app, headers = self.c.app, message.headers
        task_id = headers["id"]
        if (handed_back := headers.get(HANDED_BACK)) is not None and not self._fresh(handed_back):
            logger.info("task %s was handed back to the broker too long ago: acknowledged without running (its "
                        "Kafka copy carries it)", task_id)
            ack(logger, self.c.connection_errors)
            return
        try:
            verdict = admit(self.claims, [copy_of(task_id, headers)], app.backend,
                            app.amqp.delayed_store.key_holder)[0]
        except TRANSIENT_ERRORS as exc:
            logger.warning("cannot tell yet whether drained task %s may run (%r); trying again in %.0f s",
                           task_id, exc, ADMISSION_RETRY)
            self.c.timer.call_after(ADMISSION_RETRY, self._admit, (message, body, ack, reject, callbacks))
            return
        if verdict.admit is Admit.BUSY:  # checked again once the other copy's claim would have expired
            logger.info("drained task %s runs elsewhere: checked again in %.1f s", task_id, verdict.wait_ms / 1000)
            self.c.timer.call_after(verdict.wait_ms / 1000, self._admit, (message, body, ack, reject, callbacks))
        elif verdict.admit is Admit.RUN:
            self._run(task_id, message, body, ack, reject, callbacks)
        else:
            logger.info("drained task %s %s already: acknowledged without running", task_id, verdict.admit.value)
            if verdict.admit is not Admit.FINISHED:
                record_revoked(app, task_id, _envelope(message), reason=verdict.admit.value)
            ack(logger, self.c.connection_errors)

    def _fresh(self, handed_back: Any) -> bool:
        """Whether a copy a stopping worker handed back at ``handed_back`` (ms) may still run: within half
        of ``delayed_done_ttl``.  Its Kafka copy cannot have ended before it was handed back (its claim was
        held until then), so until then a Kafka copy that ended is still remembered (its done record); an
        older copy (one a worker killed while it held it, back from the broker's visibility timeout an hour
        later) may have outlived that record, and is not needed: the Kafka copy runs the task."""
        max_age_ms = self.c.app.amqp.delayed_settings.done_ttl * 500
        return isinstance(handed_back, int) and time.time() * 1000 - handed_back <= max_age_ms

    def _run(self, task_id: str, message: Message, body: Any, ack: Callable, reject: Callable,
             callbacks: Any) -> None:
        """Hand a claimed message to Celery, its run claim given up when Celery acks or rejects it."""
        def released(settle: Callable) -> Callable:
            def settled(*args: Any, **kwargs: Any) -> Any:
                self.claims.release(task_id)
                return settle(*args, **kwargs)
            return settled

        try:
            self.strategy(message, body, released(ack), released(reject), callbacks)
        except BaseException:  # Celery refused the message (it handles it): nothing runs
            self.claims.release(task_id)
            raise


def _envelope(message: Message) -> Envelope:
    """A broker message as an envelope, for :func:`.revoke.record_revoked`."""
    return Envelope(task_id=message.headers["id"], queue=(message.delivery_info or {}).get("routing_key") or "",
                    headers=message.headers, body=message.body, content_type=message.content_type,
                    content_encoding=message.content_encoding)
