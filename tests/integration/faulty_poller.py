"""A poller of the demo app whose advance of the recurring schedule ``POISON`` raises RuntimeError, as a
fault nobody knows of yet would, as ``celery -A tasks delayed poller`` would run otherwise.

``python -m tests.integration.faulty_poller POISON``, configured from the environment as the demo's
processes are (:func:`tasks.processes.environment`).
"""
from __future__ import annotations

import logging
import sys

from celery_delayed import store_of
from celery_delayed.poller.loop import Poller
from celery_delayed.recurring.definitions import Definitions
from tasks import create_app


def main(poison: str) -> None:
    logging.basicConfig(level="INFO", format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    next_of = Definitions._next

    def faulty(self, held, after_ms):
        if held.schedule_id == poison:
            raise RuntimeError(f"a fault in the advance of {poison}")
        return next_of(self, held, after_ms)

    Definitions._next = faulty
    app = create_app()
    store = store_of(app)
    Poller(store.settings, store=store, backend=app.backend).run()


if __name__ == "__main__":
    main(sys.argv[1])
