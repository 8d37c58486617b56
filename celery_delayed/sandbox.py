"""A deployment of its own for one test or benchmark: installed on fresh prefixes, removed after.

:func:`installed` gives an app Redis keys, etcd keys, Kafka topics and a consumer
group under a prefix unique to it, and :func:`remove_everything` removes all of a
prefix afterwards; :func:`running` runs a poller (:func:`poller_of`) in a thread.  The pytest
fixtures of :mod:`celery_delayed.testing` are built on them.
"""
from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager, suppress
from collections.abc import Iterator

import redis
from celery import Celery
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from celery_delayed import install, store_of
from celery_delayed.poller.leadership import make_etcd
from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.keys import Keys
from celery_delayed.store.redis_client import connect

#: Longest wait for a test's poller to hand its last batch to Kafka and resign (s).
STOP_TIMEOUT = 30.0


@contextmanager
def installed(app: Celery) -> Iterator[Celery]:
    """``app`` with celery-delayed installed on prefixes of its own; everything stored under them
    is removed on exit.  Call it before the app sends a task (the settings are read then)."""
    tag = f"test-{uuid.uuid4().hex[:12]}"
    app.conf.update(delayed_key_prefix=tag, delayed_topic_prefix=f"{tag}.", delayed_consumer_group=tag)
    install(app)
    try:
        yield app
    finally:
        remove_everything(store_of(app).settings)


def poller_of(app: Celery) -> Poller:
    """A poller of ``app``'s store, as ``celery -A app delayed poller`` makes it."""
    return Poller(store_of(app).settings, store=store_of(app), backend=app.backend)


@contextmanager
def running(poller: Poller) -> Iterator[threading.Thread]:
    """``poller.run()`` in a thread until the block ends; then stopped and joined."""
    thread = threading.Thread(target=poller.run, name="delayed-poller", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        poller.stop()
        thread.join(STOP_TIMEOUT)


def remove_everything(settings: Settings, topics: list[str] | None = None) -> None:
    """Remove what a deployment prefix holds: its Redis keys (``UNLINK``, never ``DEL``: big keys
    block Redis), its etcd keys, and its Kafka topics (``topics``, else every topic under
    ``delayed_topic_prefix``).  For tests and benchmarks: nothing of the prefix survives."""
    unlink_prefix(connect(settings), settings.key_prefix)
    with suppress(Exception):  # etcd keys die with the pollers' leases anyway
        make_etcd(settings).delete_prefix(Keys(settings.key_prefix).etcd_root + "/")
    admin = AdminClient(settings.kafka())  # referenced until the futures resolve
    if topics is None:
        topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(settings.topic_prefix)]
    if not topics:
        return
    for future in admin.delete_topics(list(topics), operation_timeout=30, request_timeout=30).values():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


def unlink_prefix(client: redis.Redis | redis.RedisCluster, prefix: str) -> int:
    """``UNLINK`` every key starting with ``prefix:``; returns how many.  On a cluster, SCAN
    visits every primary and UNLINK is split by slot (redis-py's ``RedisCluster``)."""
    removed = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            removed += client.unlink(*batch)
            batch = []
    if batch:
        removed += client.unlink(*batch)
    return removed
