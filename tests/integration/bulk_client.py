"""An ``apply_many`` client of the demo app for the kill -9 test: sends ``add(i, i)`` for i in
range(COUNT), task ids :func:`task_id`, an hour from now, and prints ``stored N LAST_ID`` each
time a chunk is acknowledged stored (``progress``), until it is done or killed.

``python -m tests.integration.bulk_client COUNT``, configured from the environment as the demo's
processes are (:func:`tasks.processes.environment`).
"""
from __future__ import annotations

import sys
import uuid

from celery_delayed import apply_many
from tasks import create_app


def task_id(i: int) -> str:
    """The task id of the ``i``-th signature."""
    return str(uuid.UUID(int=i + 1, version=4))


def main(count: int) -> None:
    app = create_app()
    add = app.tasks["tasks.demo.add"]

    def stored(n: int) -> None:
        print(f"stored {n} {task_id(n - 1)}", flush=True)

    apply_many((add.s(i, i).set(task_id=task_id(i), countdown=3600) for i in range(count)), app=app,
               progress=stored, results=False)
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
