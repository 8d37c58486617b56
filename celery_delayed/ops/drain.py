"""The way back to Celery's broker: scheduled tasks published there with their ETA, then removed.

``celery -A proj delayed drain --to-broker`` is how a project leaves celery-delayed
(or moves some tasks off it): each task a :class:`.browse.Filter` selects is
published to the app's broker exactly as Celery would have sent it without
celery-delayed (its message, with the ``eta`` header of its due time), and only
then removed from the store.  One task at a time: a drain killed at any point
loses nothing and, run again, sends at most the one task it was sending twice.
Pollers must be stopped first (:func:`running_pollers`): a poller dispatching a
task while it is drained would send it through Kafka as well.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery_delayed.client.intercept import header_ms
from celery_delayed.envelope import KEY_HEADER, Envelope, EnvelopeError
from celery_delayed.ops import browse
from celery_delayed.poller.leadership import make_etcd

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


def publish_args(app: Celery, envelope: Envelope, due_ms: int, now_ms: int) -> dict[str, Any]:
    """What ``Producer.publish`` takes to send ``envelope`` as Celery would have, due at ``due_ms``: its
    body untouched, its headers with ``eta``; its queue declared (the app's definition, or as Celery makes a
    missing one) and the message sent to it by name through the default exchange, as Celery sends to a direct
    queue, so it lands in that queue whatever bindings the broker has; Celery's delivery mode, and its
    ``expiration`` from ``expires`` (seconds left at ``now_ms``, at least 0)."""
    queue = app.amqp.queues.get(envelope.queue) or app.amqp.queues.new_missing(envelope.queue)
    eta = datetime.fromtimestamp(due_ms / 1000, timezone.utc).isoformat()
    args = {"body": envelope.body, "exchange": "", "routing_key": envelope.queue,
            "headers": {**envelope.headers, "eta": eta}, "content_type": envelope.content_type,
            "content_encoding": envelope.content_encoding, "declare": [queue], "retry": True,
            "delivery_mode": getattr(queue.exchange, "delivery_mode", None) or app.conf.task_default_delivery_mode,
            **envelope.properties}
    if (expires_ms := header_ms(envelope.headers, "expires")) is not None:
        args["expiration"] = max(0.0, (expires_ms - now_ms) / 1000)
    return args


def to_broker(app: Celery, flt: browse.Filter, progress: browse.Progress | None = None) -> dict[str, int]:
    """Publish every scheduled task ``flt`` selects to ``app``'s broker with its ETA, then remove it
    from the store; returns how many were ``sent``, how many had ``moved on`` meanwhile (a poller
    claimed or someone removed them between the read and the removal: sent all the same) and how many
    were ``left`` because their stored message is not one of a task (their ids in ``unreadable``, up to
    :data:`NAMED`: see ``delayed show``, then cancel them)."""
    store: DelayedStore = app.amqp.delayed_store
    totals: dict[str, Any] = {"sent": 0, "moved on": 0, "left": 0}
    unreadable: list[str] = []
    with app.producer_pool.acquire(block=True) as producer:
        def act(matches: list[dict]) -> None:
            for item in matches:
                task_id = item["task_id"]
                stored = store.message(task_id)
                if stored is None:  # gone since the walk read it
                    continue
                try:
                    envelope = Envelope.decode(stored)
                except EnvelopeError:
                    totals["left"] += 1
                    unreadable.append(task_id)
                    continue
                producer.publish(**publish_args(app, envelope, item["due_ms"], int(time.time() * 1000)))
                removed = store.cancel_many([task_id])[task_id]  # only after the broker has it
                totals["sent" if isinstance(removed, bytes) else "moved on"] += 1
                if isinstance(removed, bytes) and (key := envelope.headers.get(KEY_HEADER)):
                    store.release_key(key, task_id)

        for _ in browse.walk(store, flt, progress, act):
            pass
    return {**totals, **({"unreadable": ", ".join(unreadable[:NAMED])} if unreadable else {})}

