"""A poller of the demo app that kills itself (SIGKILL) at a chosen point of dispatching an occurrence of
a recurring schedule (the first, or the one after ``LET_THROUGH`` others; with ``any``, of any task), as
``celery -A tasks delayed poller`` would run otherwise:

- ``before_produce``: its successor is written, the occurrence is not yet handed to Kafka;
- ``before_ack``: Kafka confirmed the occurrence, the store has not forgotten it.

``python -m tests.integration.killer_poller POINT [LET_THROUGH [any [SIGNAL]]]``, configured from the environment as the
demo's processes are (:func:`tasks.processes.environment`); SIGNAL (default SIGKILL) may be SIGSTOP: it stops
itself there, once, and goes on when continued (an old leader paused past its lease).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from celery_delayed import store_of
from celery_delayed.client.schedules import beat_entries
from celery_delayed.poller.loop import Poller
from celery_delayed.recurring.occurrences import maybe_occurrence
from tasks import create_app


def main(point: str, let_through: str = "0", which: str = "occurrence", signal_name: str = "SIGKILL") -> None:
    logging.basicConfig(level="INFO", format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    app = create_app()
    store = store_of(app)
    poller = Poller(store.settings, store=store, backend=app.backend, beat_schedule=beat_entries(app))
    target, name = (poller.delivery, "produce") if point == "before_produce" else (store, "ack")
    call = getattr(target, name)
    seen: set[str] = set()
    stopped: list[bool] = []

    def dying(*args, **kwargs):
        task_ids = [args[1]] if name == "produce" else [task_id for task_id, _ in args[1]]
        seen.update(task_id for task_id in task_ids if which == "any" or maybe_occurrence(task_id))
        if len(seen) > int(let_through) and not stopped:
            print(f"killing myself {point} of {task_ids}", flush=True)
            stopped.append(True)
            os.kill(os.getpid(), getattr(signal, signal_name))
        return call(*args, **kwargs)

    setattr(target, name, dying)
    poller.run()


if __name__ == "__main__":
    main(*sys.argv[1:])
