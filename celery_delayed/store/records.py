"""The store's records of task ids: revoked ones, which workers will not run, kept for
``delayed_revoke_days``; and, beside the ``done`` records the worker writes
(:func:`celery_delayed.worker.once.remember_finished`), the way to forget both for a task
deliberately run again.
"""
from __future__ import annotations

from celery_delayed.store.delayed import DelayedStore


def remember_revoked(store: DelayedStore, task_ids: list[str]) -> None:
    """Record the ids as revoked for ``delayed_revoke_days``; workers will not run them."""
    ttl_ms = int(store.settings.revoke_days * 86_400_000)
    pipe = store.redis.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.set(store.keys.revoked(task_id), 1, px=ttl_ms)
    store.execute(pipe)


def is_revoked(store: DelayedStore, task_id: str) -> bool:
    """Whether the id was revoked within ``delayed_revoke_days`` (:func:`remember_revoked`)."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.exists(store.keys.revoked(task_id))
    return bool(store.execute(pipe)[0])


def forget_run_records(store: DelayedStore, task_ids: list[str]) -> None:
    """Drop the ``done`` and ``revoked`` records of ``task_ids``, which are deliberately run again."""
    pipe = store.redis.pipeline(transaction=False)
    for task_id in task_ids:
        for kind in ("done", "revoked"):  # one key per DEL: a cluster pipeline refuses several
            pipe.delete(store.keys.task(kind, task_id))
    store.execute(pipe)
