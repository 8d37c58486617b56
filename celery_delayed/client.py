"""Client side: route every task message that carries an ETA to the delayed store.

Every path that publishes a task (``apply_async``, ``send_task``, ``Task.retry``,
canvas members, and the same from inside worker processes) ends in
``app.amqp.send_task_message``.  :class:`DelayedAMQP` wraps that sender: when
the message's ``eta`` is at least ``delayed_min_delay`` away, Celery's own
sender runs unchanged but with a producer whose ``publish`` writes the message
(serialized exactly as kombu would) to the store instead of the broker.  So
``before_task_publish``/``after_task_publish`` and the ``task-sent`` event still
fire with the ETA, and tasks without an ETA are untouched.
"""
from __future__ import annotations

import time
from typing import Any

from celery.app.amqp import AMQP
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu import Queue
from kombu.compression import compress
from kombu.serialization import dumps
from kombu.utils.objects import cached_property

from .envelope import Envelope
from .settings import _TOPIC_CHARS, Settings
from .store import DelayedStore


class DelayedPublishError(ValueError):
    """A delayed task could not be stored as given; nothing was written."""


class DelayedAMQP(AMQP):
    """Celery's AMQP helper, with ETA messages diverted to the delayed store."""

    @cached_property
    def delayed_settings(self) -> Settings:
        return Settings.from_app(self.app)

    @cached_property
    def delayed_store(self) -> DelayedStore:
        return DelayedStore(self.delayed_settings)

    def _create_task_sender(self):
        send = super()._create_task_sender()

        def send_task_message(producer, name, message, **options):
            due_ms = self.due_ms(message.headers)
            if due_ms is None or due_ms - time.time() * 1000 < self.delayed_settings.min_delay * 1000:
                return send(producer, name, message, **options)
            queue = self._queue_name(options)
            return send(_StoreProducer(producer, self, queue, due_ms), name, message, **options)

        return send_task_message

    def due_ms(self, headers: dict) -> int | None:
        """The message's ETA in ms since the epoch, by Celery's timezone rules (naive = UTC)."""
        eta = headers.get("eta") if isinstance(headers, dict) else None
        if not eta:
            return None
        return int(maybe_make_aware(maybe_iso8601(eta)).timestamp() * 1000)

    def _queue_name(self, options: dict[str, Any]) -> str:
        """The Celery queue a message is routed to: that queue's Kafka topic carries it."""
        queue = options.get("queue")
        if isinstance(queue, Queue):
            return queue.name
        if queue:
            return queue
        if options.get("exchange") is not None:
            rkey = options.get("routing_key")
            for q in self.queues.values():
                if q.routing_key == rkey:
                    return q.name
            raise DelayedPublishError(f"no queue is bound to routing key {rkey!r}: cannot pick a Kafka topic")
        return self.app.conf.task_default_queue


class _StoreProducer:
    """Stands in for the kombu producer during one ``send_task_message`` call.

    Its first ``publish`` (the task itself) goes to the store; later calls
    (the ``task-sent`` event) and every other attribute go to the real producer.
    """

    def __init__(self, producer: Any, amqp: DelayedAMQP, queue: str, due_ms: int) -> None:
        self._producer = producer
        self._amqp = amqp
        self._queue = queue
        self._due_ms = due_ms
        self._stored = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body, routing_key=None, exchange=None, serializer=None, headers=None,
                compression=None, content_type=None, content_encoding=None, **properties):
        if self._stored:
            return self._producer.publish(body, routing_key=routing_key, exchange=exchange,
                                          serializer=serializer, headers=headers, compression=compression,
                                          content_type=content_type, content_encoding=content_encoding,
                                          **properties)
        self._stored = True
        settings = self._amqp.delayed_settings
        if not _TOPIC_CHARS.match(self._queue) or not self._queue:
            raise DelayedPublishError(
                f"queue name {self._queue!r} cannot be a Kafka topic: use letters, digits, '.', '_', '-'")
        headers = dict(headers or {})
        content_type, content_encoding, data = dumps(body, serializer=serializer)
        if isinstance(data, str):
            data = data.encode(content_encoding or "utf-8")
        if compression:
            data, headers["compression"] = compress(data, compression)
        envelope = Envelope(
            task_id=headers["id"], queue=self._queue, headers=headers, body=data,
            content_type=content_type, content_encoding=content_encoding,
            properties={k: properties[k] for k in ("correlation_id", "reply_to", "priority")
                        if properties.get(k) not in (None, "")},
            exchange=exchange if isinstance(exchange, str) else getattr(exchange, "name", "") or "",
            routing_key=routing_key or "")
        encoded = envelope.encode()
        if len(encoded) > settings.max_message_bytes:
            raise DelayedPublishError(
                f"task {envelope.task_name} [{envelope.task_id}] message is {len(encoded)} bytes, "
                f"over delayed_max_message_bytes={settings.max_message_bytes}")
        self._amqp.delayed_store.schedule_many([(envelope.task_id, self._due_ms, encoded)])
