"""The way back to Celery's broker: scheduled tasks published there with their ETA, then removed.

``celery -A proj delayed drain --to-broker`` is how a project leaves celery-delayed
(or moves some tasks off it): each task a :class:`.browse.Filter` selects is
published to the app's broker exactly as Celery would have sent it without
celery-delayed (its message, with the ``eta`` header of its due time), and only
then removed from the store.  One task at a time: a drain killed at any point
loses nothing and, run again, sends at most the one task it was sending twice.
Pollers must be stopped first (:func:`running_pollers`): a poller dispatching a
task while it is drained would send it through Kafka as well.

A task may have run from Kafka already, or run now: its poller died after
delivering it but before telling the store (its claim lapsed and the drain
schedules it again), or a drain beside live pollers.  Such a task is not sent:
each is checked as a worker checks a copy from Kafka (:func:`.once.look`), one
that ended is removed from the store, one that runs is left for a second run.
The task a drain sends carries the :data:`.once.DRAINED` header, so that an
installed worker still runs it only once should a Kafka copy start after the
check (:mod:`.worker.drained`).  The broker is reached within bounded time
(:func:`.broker.connect`): one that does not answer ends the drain before it changes
anything.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kombu import Connection

from celery_delayed.envelope import KEY_HEADER, Envelope, EnvelopeError
from celery_delayed.ops import browse
from celery_delayed.poller.leadership import make_etcd
from celery_delayed.store.revoke import record_revoked
from celery_delayed.worker.broker import publish_args
from celery_delayed.worker.intake import copy_of
from celery_delayed.worker.once import Admit, look

#: Ids of unreadable stored messages a drain names (it counts them all).
NAMED = 20

if TYPE_CHECKING:
    from celery import Celery

    from celery_delayed.store.delayed import DelayedStore


def running_pollers(store: DelayedStore) -> list[str]:
    """The ids of the pollers alive in etcd now (each under its lease)."""
    etcd = make_etcd(store.settings)
    try:
        return sorted(meta.key.decode().rsplit("/", 1)[1]
                      for _, meta in etcd.get_prefix(store.keys.pollers(), keys_only=True))
    finally:
        etcd.close()


def return_lapsed_claims(store: DelayedStore) -> tuple[int, int]:
    """Put the tasks whose poller's claim lapsed (the poller is gone) back among the scheduled, due
    now, as the next poller's claim would; returns how many went back and how many are still claimed
    (a poller dispatching them, or one that died less than ``delayed_visibility_timeout`` ago)."""
    now_ms, returned = store.now_ms(), 0
    for p in range(store.settings.partitions):
        if lapsed := store.lapsed_claims(p, now_ms):
            returned += store.nack(p, lapsed, delay_ms=0)
    return returned, sum(row["inflight"] for row in store.counts())


def to_broker(app: Celery, connection: Connection, flt: browse.Filter,
              progress: browse.Progress | None = None) -> dict[str, Any]:
    """Publish every scheduled task ``flt`` selects to ``app``'s broker (on ``connection``, see
    :func:`.broker.connect`) with its ETA, then remove it from the store; returns how many were ``sent``, how
    many had ``moved on`` meanwhile (a poller claimed or someone removed them between the read and the
    removal: sent all the same), how many were not sent: ``already run`` (ended: removed from the store),
    ``revoked`` (revoked, or replaced under their key: recorded REVOKED, removed), ``running`` (a copy
    from Kafka runs now: left in the store, for a drain once it ended), and how many were ``left``
    because their stored message is not one of a task (their ids in ``unreadable``, up to :data:`NAMED`:
    see ``delayed show``, then cancel them)."""
    store: DelayedStore = app.amqp.delayed_store
    totals: dict[str, Any] = {"sent": 0, "moved on": 0, "already run": 0, "revoked": 0, "running": 0, "left": 0}
    unreadable: list[str] = []
    producer = connection.Producer()

    def remove(task_id: str, envelope: Envelope) -> bool:
        """Out of the store (its key released); False when it was no longer scheduled."""
        removed = store.cancel_many([task_id])[task_id]
        if isinstance(removed, bytes) and (key := envelope.headers.get(KEY_HEADER)):
            store.release_key(key, task_id)
        return isinstance(removed, bytes)

    def act(matches: list[dict]) -> None:
        found: list[tuple[dict, Envelope]] = []
        for item in matches:
            stored = store.message(item["task_id"])
            if stored is None:  # gone since the walk read it
                continue
            try:
                found.append((item, Envelope.decode(stored)))
            except EnvelopeError:
                totals["left"] += 1
                unreadable.append(item["task_id"])
        copies = [copy_of(e.task_id, e.headers) for _, e in found]
        for (item, envelope), verdict in zip(found, look(store, copies, app.backend)):
            task_id = envelope.task_id
            if verdict.admit is Admit.BUSY:
                totals["running"] += 1
            elif verdict.admit is Admit.FINISHED:
                remove(task_id, envelope)
                totals["already run"] += 1
            elif verdict.admit is not Admit.RUN:  # revoked, or replaced under its key
                record_revoked(app, task_id, envelope, reason=verdict.admit.value)
                remove(task_id, envelope)
                totals["revoked"] += 1
            else:
                producer.publish(**publish_args(app, envelope, item["due_ms"], int(time.time() * 1000)))
                totals["sent" if remove(task_id, envelope) else "moved on"] += 1  # only after the broker has it

    for _ in browse.walk(store, flt, progress, act):
        pass
    return {**totals, **({"unreadable": ", ".join(unreadable[:NAMED])} if unreadable else {})}
