"""The batch of one :func:`.bulk.apply_many` chunk: the store writes and task-sent events its
signatures' ``apply_async`` calls make, collected (:data:`batching`) and written together."""
from __future__ import annotations

from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any

from celery import Celery
from celery.events import Event
from celery.utils.time import utcoffset

from celery_delayed.store.delayed import Item
from celery_delayed.store.outcomes import write_retrying

#: task-sent events per broker message.
EVENTS_PER_MESSAGE = 100


class Batch:
    """The store items and task-sent events of one chunk, collected while its signatures are sent.

    It stands in for Celery's event dispatcher in ``send_task_message`` (the
    ``event_dispatcher`` option), keeping each event until the chunk is stored.
    """

    def __init__(self, app: Celery, sent: list, before: Future | None = None) -> None:
        self.app = app
        self.before = before  # the write of the chunk before, stored first
        self.items: list[Item] = []  # each with its queue: the store need not read it from the message
        self.events: list[dict] = []
        self.sent = sent  # the chunk's signatures sent so far
        self.durable = 0  # how many of them are stored (or, not delayed, gone to the broker)
        self.bypassed = False  # a message of the signature being sent went around the batch
        self._dispatcher = app.events.Dispatcher(enabled=False)  # as Celery's own task sender holds one
        self.event_options: dict[str, Any] = {}
        self.last_event: dict | None = None  # the fields of the last task-sent event, and what
        self.published: dict[str, Any] | None = None  # Celery published last (for client.template)

    def publish(self, type: str, fields: dict, producer: Any, retry: bool = False,
                retry_policy: dict | None = None, **_: Any) -> None:
        """``EventDispatcher.publish``, deferred: the event is sent by :meth:`flush`."""
        dispatcher = self._dispatcher
        self.events.append(Event(type, hostname=dispatcher.hostname, utcoffset=utcoffset(), pid=dispatcher.pid,
                                 clock=dispatcher.clock.forward(), **fields))
        self.event_options = {"retry": retry, "retry_policy": retry_policy}
        self.last_event = fields

    def flush(self) -> None:
        """Store the chunk's tasks (retried as a broker publish is), after the chunk before; then send
        their events."""
        if self.before is not None:
            self.before.result()
            self.before = None
        if self.items:
            conf = self.app.conf
            store = self.app.amqp.delayed_store
            write_retrying(store.schedule_many, (self.items,), failed=f"storing {len(self.items)} tasks failed",
                           policy=conf.task_publish_retry_policy if conf.task_publish_retry else {"max_retries": 0})
            self.items = []
        if self.events:
            dispatcher = self._dispatcher
            with self.app.producer_or_acquire() as producer:
                for start in range(0, len(self.events), EVENTS_PER_MESSAGE):
                    producer.publish(self.events[start:start + EVENTS_PER_MESSAGE], routing_key="task.multi",
                                     exchange=dispatcher.exchange.name, declare=[dispatcher.exchange],
                                     serializer=dispatcher.serializer, headers=dispatcher.headers,
                                     delivery_mode=dispatcher.delivery_mode, **self.event_options)
            self.events = []
        self.durable = len(self.sent)

    def bypass(self) -> None:
        """A message goes around the batch (to the broker, or written alone): the batch is stored
        first, so that what failed after it was never sent."""
        self.flush()
        self.bypassed = True


#: The batch collecting this context's store writes and task-sent events (:class:`.intercept.DelayedAMQP` reads it).
batching: ContextVar[Batch | None] = ContextVar("delayed_batching", default=None)
