"""Scheduled tasks sent to Celery's broker: by ``delayed drain --to-broker``, and by a stopping worker
handing back the tasks it read but can no longer run (:meth:`.Intake.let_go`).

Each is sent as Celery would have sent it without celery-delayed (its message, with the ``eta``
header of its due time) and carries the :data:`.once.DRAINED` header, so that an installed worker
runs it only once per task id, whatever copy of it Kafka still holds (:mod:`.drained`).  The broker
is reached within bounded time (:func:`connect`).
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import Celery
from kombu import Connection

from celery_delayed.envelope import Envelope, header_ms
from celery_delayed.worker.once import DRAINED, FROM_KAFKA, HANDED_BACK

#: Longest a drain tries to reach the broker, over all its tries (s); each try is bounded by
#: ``broker_connection_timeout``.
CONNECT_WITHIN = 10.0
#: Transports whose socket reads wait for ever unless given a timeout (kombu's Redis transport options).
SOCKET_TIMEOUTS = {"redis": ("socket_connect_timeout", "socket_timeout")}


def connect(app: Celery, within: float = CONNECT_WITHIN) -> Connection:
    """A connection to ``app``'s broker, established, each of whose socket operations gives up after
    ``broker_connection_timeout`` (on Redis: its socket timeouts, unless the app sets its own), tried for
    ``within`` s at most.  Raises kombu's ``OperationalError`` when the broker cannot be
    reached or does not answer, as a publish on it does (within ``task_publish_retry_policy``)."""
    timeout = app.conf.broker_connection_timeout
    connection = app.connection_for_write()
    options = dict(app.conf.broker_transport_options)
    for name in SOCKET_TIMEOUTS.get(connection.transport.driver_type, ()):
        options[name] = options.get(name) or timeout
    connection = connection.clone(transport_options=options)
    try:
        return connection.ensure_connection(max_retries=app.conf.broker_connection_max_retries, timeout=within)
    except BaseException:
        connection.release()
        raise


def publish_args(app: Celery, envelope: Envelope, due_ms: int, now_ms: int, handed_back: bool = False
                 ) -> dict[str, Any]:
    """What ``Producer.publish`` takes to send ``envelope`` as Celery would have, due at ``due_ms``: its
    body untouched, its headers with ``eta`` and :data:`.once.DRAINED` (without :data:`.once.FROM_KAFKA`,
    which would let it pass unchecked); its queue declared (the app's definition, or as Celery makes a
    missing one) and the message sent to it by name through the default exchange, as Celery sends to a
    direct queue, so it lands in that queue whatever bindings the broker has; Celery's delivery mode and
    publish retry policy, and its ``expiration`` from ``expires`` (seconds left at ``now_ms``, at least 0).
    ``handed_back``: a stopping worker's (:data:`.once.HANDED_BACK`)."""
    queue = app.amqp.queues.get(envelope.queue) or app.amqp.queues.new_missing(envelope.queue)
    eta = datetime.fromtimestamp(due_ms / 1000, timezone.utc).isoformat()
    headers = {k: v for k, v in envelope.headers.items() if k != FROM_KAFKA}
    headers.update({"eta": eta, DRAINED: now_ms})
    if handed_back:
        headers[HANDED_BACK] = now_ms
    args = {"body": envelope.body, "exchange": "", "routing_key": envelope.queue,
            "headers": headers, "content_type": envelope.content_type,
            "content_encoding": envelope.content_encoding, "declare": [queue], "retry": True,
            "retry_policy": app.conf.task_publish_retry_policy,
            "delivery_mode": getattr(queue.exchange, "delivery_mode", None) or app.conf.task_default_delivery_mode,
            **envelope.properties}
    if (expires_ms := header_ms(envelope.headers, "expires")) is not None:
        args["expiration"] = max(0.0, (expires_ms - now_ms) / 1000)
    return args
