"""The batch of one :func:`.bulk.apply_many` chunk: the store writes and task-sent events its
signatures' ``apply_async`` calls make, collected (:data:`batching`) and written together."""
from __future__ import annotations

import time
from concurrent.futures import Future
from contextvars import ContextVar
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import Celery
from celery.events import Event
from celery.utils.time import utcoffset

from celery_delayed.envelope import JSON_ENCODING, JSON_TYPE, deflate, format_of, json_encoder
from celery_delayed.store.delayed import Item
from celery_delayed.store.outcomes import write_retrying

#: task-sent events per broker message.
EVENTS_PER_MESSAGE = 100
#: The fields of a task-sent event that differ between tasks made from one template (:meth:`Batch.event_frame`).
EVENT_SLOTS = ("uuid", "root_id", "args", "kwargs", "eta", "expires", "clock", "timestamp", "utcoffset")


class Batch:
    """The store items and task-sent events of one chunk, collected while its signatures are sent.

    It stands in for Celery's event dispatcher in ``send_task_message`` (the
    ``event_dispatcher`` option), keeping each event until the chunk is stored.
    """

    def __init__(self, app: Celery, sent: list, before: Future | None = None, dispatcher: Any = None) -> None:
        self.app = app
        self.before = before  # the write of the chunk before, stored first
        self.items: list[Item] = []  # each with its queue: the store need not read it from the message
        self.frames: list[int] = []  # the items holding a frame to deflate (add_made)
        self.events: list[dict | str] = []  # a task-sent event's fields, or (publish_made) its JSON
        self.sent = sent  # the chunk's signatures sent so far
        self.durable = 0  # how many of them are stored (or, not delayed, gone to the broker)
        self.bypassed = False  # a message of the signature being sent went around the batch
        # as Celery's task sender holds one (``dispatcher``: one kept, as each makes a connection's transport)
        self._dispatcher = dispatcher = dispatcher or events_dispatcher(app)
        self._json = json_encoder() if dispatcher.serializer == "json" else None  # events sent as JSON text
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

    def event_frame(self, fields: dict) -> str:
        """The JSON of a task-sent event of ``fields`` (a template's own) as a format string with a field
        where each of :data:`EVENT_SLOTS` goes, for :meth:`publish_made`; "" when events are not sent
        as JSON here."""
        if self._json is None:
            return ""
        slot = {name: f"\0{name}\0" for name in EVENT_SLOTS}
        event = Event("task-sent", hostname=self._dispatcher.hostname, utcoffset=slot["utcoffset"],
                      pid=self._dispatcher.pid, clock=slot["clock"],
                      **{**fields, **{name: slot[name] for name in EVENT_SLOTS[:6]}})
        event["timestamp"] = slot["timestamp"]
        return format_of(self._json(event), {name: encode_basestring_ascii(text) for name, text in slot.items()})

    def publish_made(self, frame: str, fields: dict[str, str | None]) -> None:
        """A task-sent event as :meth:`publish` keeps it, made from ``frame`` (:meth:`event_frame`) and the
        task's own ``fields`` (those of :data:`EVENT_SLOTS` but the clock, time and UTC offset)."""
        values = {name: encode_basestring_ascii(value) if type(value) is str else "null" if value is None
                  else repr(value) for name, value in fields.items()}
        self.events.append(frame.format_map(dict(values, clock=self._dispatcher.clock.forward(),
                                                 timestamp=repr(time.time()), utcoffset=utcoffset())))

    def add_made(self, task_id: str, due_ms: int, frame: bytes, queue: str) -> None:
        """A task made from a template, ``frame`` its compact envelope: :meth:`deflate` makes its stored form."""
        self.frames.append(len(self.items))
        self.items.append((task_id, due_ms, frame, queue))

    def deflate(self) -> None:
        """The stored form of each task made from a template (:meth:`add_made`).  :func:`.apply_many` runs it in
        a thread of its own while the next chunk is made (zlib lets go of the GIL as it deflates): it was a
        third of the time of the thread making them."""
        items, min_bytes = self.items, self.app.amqp.delayed_settings.compress_min_bytes
        for at in self.frames:
            item = items[at]
            items[at] = (*item[:2], deflate(item[2], min_bytes), *item[3:])
        self.frames = []

    def flush(self) -> None:
        """Store the chunk's tasks (retried as a broker publish is), after the chunk before; then send
        their events."""
        self.deflate()
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
                    events, json = self.events[start:start + EVENTS_PER_MESSAGE], self._json
                    body = events if json is None else \
                        f"[{', '.join(e if type(e) is str else json(e) for e in events)}]".encode()  # as kombu's
                    producer.publish(body, routing_key="task.multi", exchange=dispatcher.exchange.name,
                                     declare=[dispatcher.exchange], serializer=dispatcher.serializer,
                                     content_type=None if json is None else JSON_TYPE,
                                     content_encoding=None if json is None else JSON_ENCODING,
                                     headers=dispatcher.headers, delivery_mode=dispatcher.delivery_mode,
                                     **self.event_options)
            self.events = []
        self.durable = len(self.sent)

    def bypass(self) -> None:
        """A message goes around the batch (to the broker, or written alone): the batch is stored
        first, so that what failed after it was never sent."""
        self.flush()
        self.bypassed = True


def events_dispatcher(app: Celery) -> Any:
    """The event dispatcher a :class:`Batch` holds, as Celery's task sender holds one."""
    return app.events.Dispatcher(enabled=False)


#: The batch collecting this context's store writes and task-sent events (:class:`.intercept.DelayedAMQP` reads it).
batching: ContextVar[Batch | None] = ContextVar("delayed_batching", default=None)
