"""Waking the worker's event loop from the feed: the hand-off of admitted records.

A worker with an event loop (prefork, threads, solo on a Redis or AMQP broker) is woken from the
feed's thread (:class:`Wakeup`); a green worker (gevent, eventlet) has no event loop, and its feed
runs as a greenlet of the worker's own hub, so its hand-off is a greenlet spawned there through
the pool's timer (:class:`GreenWakeup`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any


class Wakeup:
    """Runs ``callback`` on the worker's event loop as soon as another thread calls :meth:`wake`.

    A pipe the loop watches (``hub.add_reader``): kombu 5.6's ``call_soon``
    from another thread does not wake the loop, which then sleeps up to its
    1 s poll timeout; this is prompt on every kombu.
    """

    def __init__(self, hub: Any, callback: Any) -> None:
        self.hub, self.callback = hub, callback
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        hub.add_reader(self._read, self._on_readable)

    def wake(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has wake-ups pending anyway
            pass
        except OSError:  # closed by stop(): records left are read again after a restart
            pass

    def _on_readable(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        self.callback()

    def unwatch(self) -> None:
        """Stop watching the pipe (on the loop thread): later wake-ups do nothing."""
        with contextlib.suppress(Exception):  # the hub was reset meanwhile (a consumer restart): nothing to remove
            self.hub.remove_reader(self._read)

    def close(self) -> None:
        """Close the pipe, once no thread can wake it any more."""
        for fd in (self._read, self._write):
            os.close(fd)


class GreenWakeup:
    """Runs ``callback`` in a new greenlet of a green worker when :meth:`wake` is called from another
    greenlet of its hub (the feed's): ``timer`` is the worker's, the pool's own greenlet timer, the
    seam Celery uses for every callback it runs later in such a worker."""

    def __init__(self, timer: Any, callback: Any) -> None:
        self.timer, self.callback = timer, callback

    def wake(self) -> None:
        self.timer.call_after(0, self.callback)

    def unwatch(self) -> None:
        """Nothing is watched."""

    def close(self) -> None:
        """Nothing to close."""
