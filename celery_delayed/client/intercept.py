"""Client side: route every task message that carries an ETA to the delayed store.

Every path that publishes a task (``apply_async``, ``send_task``, ``Task.retry``,
canvas members, and the same from inside worker processes) ends in
``app.amqp.send_task_message``.  :class:`DelayedAMQP` wraps that sender: when
the message's ``eta`` is at least ``delayed_min_delay`` away, Celery's own
sender runs unchanged but with a producer whose ``publish`` writes the message
(serialized exactly as kombu would) to the store instead of the broker.  So
``before_task_publish``/``after_task_publish`` and the ``task-sent`` event still
fire with the ETA, and tasks without an ETA are untouched.

A task whose ``expires`` is not after its ETA would only ever be revoked by the
worker at its due time, as stock Celery does; it is not stored, and is recorded
as REVOKED (reason ``expired``) at once instead.
"""
from __future__ import annotations

import time
from typing import Any

from celery import current_task
from celery.app.amqp import AMQP
from kombu import Queue
from kombu.exceptions import OperationalError
from kombu.utils.objects import cached_property

from celery_delayed import inert
from celery_delayed.client.batch import Batch, batching
from celery_delayed.envelope import (KEY_HEADER, KEY_MODES, KEY_MODE_HEADER, Envelope, EnvelopeError, attempt_of,
    deflate, executing, serialize)
from celery_delayed.envelope import header_ms as envelope_header_ms
from celery_delayed.settings import RECORD_OVERHEAD, Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.outcomes import Change, Stored, write_retrying
from celery_delayed.store.records import is_revoked
from celery_delayed.store.revoke import cancel_scheduled, record_revoked

#: Longest replace-by-key key (characters).
MAX_KEY_LENGTH = 512

logger = inert.logger(__name__)


class DelayedPublishError(ValueError):
    """A delayed task could not be stored as given; nothing was written."""


def header_ms(headers: dict, name: str) -> int | None:
    """A time header (``eta``/``expires``) in ms since the epoch (:func:`.envelope.header_ms`); raises
    :class:`DelayedPublishError` for one that is not an ISO 8601 time."""
    try:
        return envelope_header_ms(headers, name)
    except EnvelopeError as exc:
        raise DelayedPublishError(str(exc)) from None


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
            if due_ms is None or (due_ms - time.time() * 1000 < self.delayed_settings.min_delay * 1000
                                  and KEY_HEADER not in (options.get("headers") or {})):  # a keyed one meets its key
                if batch := self._batch():
                    batch.bypass()  # what is batched is stored before this goes out
                if _is_own_retry(task_id := message.headers.get("id")):  # as its store write (_write) is
                    return write_retrying(send, (producer, name, message), options, forever=True,
                                          errors=(OperationalError, *producer.connection.recoverable_connection_errors),
                                          failed=f"the retry of task {task_id} cannot reach Celery's broker")
                return send(producer, name, message, **options)
            store_producer = _StoreProducer(producer, self, self._queue_name(options), due_ms)
            if batch := self._batch():  # the task-sent event waits for the batch's write
                options["event_dispatcher"] = batch
                batch.published = batch.last_event = None
            sent = send(store_producer, name, message, **options)
            if batch and store_producer.published:  # the template of its shape (client.template)
                batch.published = dict(store_producer.published, event=batch.last_event)
            if (expired := store_producer.expired) is not None:
                record_revoked(self.app, expired.task_id, expired, "expired", expired=True)
            return sent

        return send_task_message

    def _batch(self) -> Batch | None:
        """The :func:`.bulk.apply_many` batch of this app running in this context, if any."""
        batch = batching.get()
        return batch if batch is not None and batch.app is self.app else None

    def due_ms(self, headers: dict) -> int | None:
        """The message's ETA in ms since the epoch, read as a stock worker reads it."""
        return header_ms(headers, "eta")

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

    def stored_form(self, envelope: Envelope) -> bytes:
        """The bytes the store keeps for ``envelope``, after checking it can be stored and run.

        Raises :class:`DelayedPublishError` when its queue cannot be a Kafka topic,
        a header is not JSON data, the message exceeds ``delayed_max_message_bytes``
        (measured before compression: it is what a worker will hold), or the stored
        form is more than Kafka's producer would carry (it could never be dispatched).
        """
        settings = self.delayed_settings
        key_of(envelope.headers)
        try:
            settings.checked_topic(envelope.queue)
            frame = envelope.encode()
        except ValueError as exc:  # a bad queue name, or an EnvelopeError
            raise DelayedPublishError(str(exc)) from None
        if len(frame) > settings.max_message_bytes:
            raise DelayedPublishError(
                f"task {envelope.task_name} [{envelope.task_id}] message is {len(frame)} bytes, "
                f"over delayed_max_message_bytes={settings.max_message_bytes}")
        stored = deflate(frame, settings.compress_min_bytes)
        record = len(stored) + len(envelope.task_id.encode()) + RECORD_OVERHEAD  # the task id is the key
        if record > settings.kafka_message_max_bytes:
            raise DelayedPublishError(
                f"task {envelope.task_name} [{envelope.task_id}] would be a Kafka record of {record} bytes "
                f"(stored message, task id and framing), over the producer's message.max.bytes="
                f"{settings.kafka_message_max_bytes} (delayed_kafka_config)")
        return stored


class _StoreProducer:
    """Stands in for the kombu producer during one ``send_task_message`` call.

    Its first successful ``publish`` (the task itself) goes to the store; later
    calls (the ``task-sent`` event) and every other attribute go to the real
    producer.  A store write that fails is retried as kombu retries a broker
    publish (``task_publish_retry``, ``task_publish_retry_policy``, the call's
    ``retry_policy``), and always to the store, never to the broker.
    """

    def __init__(self, producer: Any, amqp: DelayedAMQP, queue: str, due_ms: int) -> None:
        self._producer = producer
        self._amqp = amqp
        self._due_ms = due_ms
        self._stored = False
        self.queue = queue
        self.expired: Envelope | None = None  # the message, when it expired before it was due: not stored
        self.published: dict[str, Any] | None = None  # what Celery published, when it joined a batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body, routing_key=None, exchange=None, serializer=None, headers=None,
                compression=None, content_type=None, content_encoding=None, **properties):
        if self._stored:
            return self._producer.publish(body, routing_key=routing_key, exchange=exchange,
                                          serializer=serializer, headers=headers, compression=compression,
                                          content_type=content_type, content_encoding=content_encoding,
                                          **properties)
        headers_given, headers = headers, dict(headers or {})
        data, content_type, content_encoding = serialize(body, serializer, compression, headers)
        envelope = Envelope(
            task_id=headers["id"], queue=self.queue, headers=headers, body=data,
            content_type=content_type, content_encoding=content_encoding,
            properties={k: properties[k] for k in ("correlation_id", "reply_to", "priority")
                        if properties.get(k) not in (None, "")},
            exchange=exchange if isinstance(exchange, str) else getattr(exchange, "name", "") or "",
            routing_key=routing_key or "")
        stored = self._amqp.stored_form(envelope)
        expires_ms = header_ms(headers, "expires")
        self.expired = envelope if expires_ms is not None and expires_ms <= self._due_ms else None
        if self.expired is None and self._write(envelope, stored, properties.get("retry"),
                                            properties.get("retry_policy") or {}):
            self.published = {"envelope": envelope, "body": body, "serializer": serializer,
                              "compression": compression, "exchange": exchange, "routing_key": routing_key,
                              "headers": headers_given}
        self._stored = True

    def _write(self, envelope: Envelope, stored: bytes, retry: bool | None, policy: dict) -> bool:
        """Store the task, retrying an unreachable store by the publish retry policy.

        The retry of the task running here is retried until it is stored, whether
        Kafka or Celery's broker delivered it: given up, Celery would fail the task
        for good (``Task.retry`` turns the error into ``Reject(requeue=False)``),
        while the task was never done.  A retry due sooner than ``delayed_min_delay``
        goes to Celery's broker instead, its publish retried the same way.
        A retry (a higher ``retries``) replaces an older copy of the task still scheduled.
        Inside :func:`.bulk.apply_many`, a first attempt joins the batch instead, written with it:
        then it returns True.
        """
        own_retry = _is_own_retry(envelope.task_id)
        attempt = attempt_of(envelope.headers)
        store, app, task_id = self._amqp.delayed_store, self._amqp.app, envelope.task_id
        keyed = key_of(envelope.headers) if not attempt else None  # a retry keeps the key its first attempt took
        key, mode = keyed or (None, None)
        batch = self._amqp._batch()
        if batch is not None:
            if not own_retry and not attempt and not key:
                batch.items.append((envelope.task_id, store.on_store_clock(self._due_ms), stored, envelope.queue))
                return True
            batch.bypass()  # what is batched is stored before this

        def retrying(write: Any, *args: Any, **kwargs: Any) -> Any:
            return write_retrying(write, args, kwargs,
                                  failed=f"task {envelope.task_name} [{task_id}]: store write failed",
                                  policy=policy if retry or own_retry else {"max_retries": 0}, forever=own_retry)

        if key and retrying(is_revoked, store, task_id):  # e.g. replaced, then sent again
            logger.info("task %s [%s] was revoked: not scheduled again under key %r", envelope.task_name, task_id,
                        key)
            record_revoked(app, task_id, envelope, "revoked")
            return False
        holder = retrying(store.key_holder, key) if mode == "keep" else None
        if key is not None and holder not in (None, task_id) and retrying(store.get, holder) is not None:
            self._refuse(key, holder, envelope)
            return False
        def schedule() -> Stored:
            # the skew is measured in the write retried (a store away, a soft time limit firing meanwhile)
            return store.schedule(task_id, store.on_store_clock(self._due_ms), stored, attempt=attempt)

        if retrying(schedule) is Stored.KEPT:
            logger.warning("task %s [%s] is already scheduled: the scheduled copy is kept, this one dropped",
                           envelope.task_name, task_id)
        if mode == "keep":  # stored first, then the key if nobody took it meanwhile
            taken, holder = retrying(store.hold_key, key, task_id, holder)
            if not taken and holder != task_id:
                if cancel_scheduled(app, [task_id], "duplicate key")[task_id] is not Change.DONE:
                    record_revoked(app, task_id, envelope, "duplicate key")  # dispatched: revoked, never run
                logger.info("task %s [%s] not scheduled: %s took key %r first (delayed_key_mode=keep)",
                            envelope.task_name, task_id, holder, key)
        elif mode == "replace":  # stored first: a crash now leaves the old one holding the key
            previous = retrying(store.hold_key, key, task_id, replace=True)[1]
            if previous not in (None, task_id):
                logger.info("task %s [%s] replaces %s under key %r", envelope.task_name, task_id, previous, key)
                cancel_scheduled(app, [previous], reason="replaced")
        return False

    def _refuse(self, key: str, holder: str, envelope: Envelope) -> None:
        """``delayed_key_mode="keep"`` while ``holder`` is scheduled under ``key``: the task is not
        stored, and is recorded REVOKED (``duplicate key``), so it never runs."""
        logger.info("task %s [%s] not scheduled: %s is scheduled under key %r (delayed_key_mode=keep)",
                    envelope.task_name, envelope.task_id, holder, key)
        record_revoked(self._amqp.app, envelope.task_id, envelope, "duplicate key")


def key_of(headers: dict) -> tuple[str, str] | None:
    """The replace-by-key ``(key, mode)`` of a message's headers, or None when it has no key.

    Raises :class:`DelayedPublishError` for a key that is not a string of 1 to
    :data:`MAX_KEY_LENGTH` characters, or a mode other than ``replace``/``keep``.
    """
    key = headers.get(KEY_HEADER)
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
        raise DelayedPublishError(f"the {KEY_HEADER} header must be a string of 1 to {MAX_KEY_LENGTH} characters, "
                                  f"got {key!r:.80}")
    mode = headers.get(KEY_MODE_HEADER, "replace")
    if not isinstance(mode, str) or mode not in KEY_MODES:
        raise DelayedPublishError(f"the {KEY_MODE_HEADER} header must be one of {', '.join(KEY_MODES)}, got {mode!r}")
    return key, mode


def _is_own_retry(task_id: str | None) -> bool:
    """Whether a message of ``task_id`` is the retry of the task a worker runs here (:func:`executing`)."""
    return bool(current_task) and task_id is not None and executing(current_task.request, task_id)
