"""An ``upsert_many`` client of the demo app for the kill -9 tests: upserts ``um:<i>`` for i in
range(COUNT), each ``tasks.demo.tick`` every 365 days plus i seconds (none due during a test), and
prints ``upserted N`` each time a batch is acknowledged put (``progress``), until it is done or killed.
With DIE_AT, it kills itself (``SIGKILL``) in that batch (1 for the first), once its compare-and-sets
are done and before its occurrences are written: the worst point of the crash-safe sequence.

``python -m tests.integration.upsert_many_client COUNT [DIE_AT]``, configured from the environment as
the demo's processes are (:func:`tasks.processes.environment`).
"""
from __future__ import annotations

import os
import signal
import sys

from celery_delayed import Schedules
from celery_delayed.recurring.definitions import Definitions
from tasks import create_app


def main(count: int, die_at: int | None) -> None:
    app = create_app()
    if die_at is not None:
        written = Definitions._write_pending
        batches = iter(range(1, count + 1))

        def dying(self: Definitions, definitions: list) -> None:
            if next(batches) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            written(self, definitions)

        Definitions._write_pending = dying  # type: ignore[method-assign]
    run = os.environ["DELAYED_KEY_PREFIX"]
    Schedules(app).upsert_many(((f"um:{i}", app.signature("tasks.demo.tick", args=(run,)), 365 * 86400 + i)
                                for i in range(count)), progress=lambda n: print(f"upserted {n}", flush=True))
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
