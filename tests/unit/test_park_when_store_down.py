"""A task that fails for good while the store is down: its dead letter is retried until the store
is back, but never by blocking the worker's main process or an eager caller; an eager task's own
store writes are not retried for ever either.

Each case runs Celery's own code (``Request.on_failure``, ``Task.apply``) in a subprocess whose
store points at a port nothing listens on, so every store call is refused at once; the
subprocess's daemon threads, still retrying, end with it.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.support import ROOT

#: Set up in the subprocess: an app whose store is unreachable, results kept in memory.
PRELUDE = """
import json, sys, threading, time, uuid
from tasks import create_app
app = create_app(delayed_redis_url="redis://127.0.0.1:9/0", result_backend="cache+memory://")
"""

#: Celery's main-process failure path (a hard time limit, or a pool child lost without requeue):
#: it pushes the task's request (``called_directly`` True) and sends ``task_failure`` from the loop.
MAIN_PROCESS = PRELUDE + """
from billiard.einfo import ExceptionInfo
from celery.exceptions import TimeLimitExceeded
from celery.worker.request import Request
from kombu.message import Message
from kombu.utils.json import dumps
task = app.tasks["tasks.demo.add"]
headers, properties, body, _ = app.amqp.create_task_message(str(uuid.uuid4()), task.name, [1, 2], {})
message = Message(body=dumps(body).encode(), content_type="application/json", content_encoding="utf-8",
                  headers=headers, properties=properties, delivery_info={"routing_key": "celery"}, channel=None)
request = Request(message, app=app, task=task)
try:
    raise TimeLimitExceeded(3)
except TimeLimitExceeded:
    einfo = ExceptionInfo()
started = time.monotonic()
request.on_failure(einfo)
print(json.dumps({"seconds": time.monotonic() - started,
                  "parking": [t.name for t in threading.enumerate() if t.name == "delayed-park"]}))
"""

#: ``Task.apply`` of a task that fails for good (an eager call in a web process or a test suite).
EAGER = PRELUDE + """
started = time.monotonic()
result = app.tasks["tasks.chaos.step"].apply((sys.argv[1], "fail", 0))
print(json.dumps({"seconds": time.monotonic() - started, "state": result.state,
                  "parking": [t.name for t in threading.enumerate() if t.name == "delayed-park"]}))
"""


#: An eager task that schedules itself again under its own id: not a retry a worker must not give
#: up, so the store's refusal reaches the caller after Celery's publish retry policy.
EAGER_SELF_SCHEDULE = PRELUDE + """
from celery_delayed import StoreUnavailable

@app.task(bind=True, name="again")
def again(self):
    self.apply_async(countdown=120, task_id=self.request.id)

started = time.monotonic()
result = again.apply()
print(json.dumps({"seconds": time.monotonic() - started, "state": result.state,
                  "error": type(result.result).__name__}))
"""


#: A record handed to Celery through the intake, whose task then hits its hard time limit (Celery's
#: main process sends ``task_failure``, then acknowledges): the record must stay unsettled while its
#: dead letter waits for the store, and settle once it is written.
HELD_UNTIL_PARKED = PRELUDE + """
from types import SimpleNamespace
from celery.worker.request import Request
from kombu.utils.json import dumps
from celery_delayed.envelope import Envelope
from celery_delayed.worker import failures
from celery_delayed.worker.intake import Arrival, Intake, Task
from celery_delayed.worker.offsets import OffsetTracker
from celery_delayed.worker.once import Admit, Verdict
task, later, requests = app.tasks["tasks.demo.add"], [], []

def strategy(message, body, on_ack, on_reject, callbacks):
    requests.append(Request(message, app=app, task=task, on_ack=on_ack, on_reject=on_reject))

c = SimpleNamespace(app=app, on_task_message=set(),
                    timer=SimpleNamespace(call_after=lambda delay, fn, args=(): later.append((fn, args))))
offsets, key = OffsetTracker(), ("t", 0)
offsets.assign([key])
intake = Intake(c, app.amqp.delayed_store, SimpleNamespace(release=lambda task_id: None), offsets, lambda: None)
headers, properties, body, _ = app.amqp.create_task_message(str(uuid.uuid4()), task.name, [1, 2], {})
envelope = Envelope(task_id=headers["id"], queue="celery", headers=headers, body=dumps(body).encode(),
                    content_type="application/json", content_encoding="utf-8")
record = SimpleNamespace(headers=lambda: [], timestamp=lambda: (1, 0), offset=lambda: 0, value=envelope.encode)
intake.dispatch(Arrival(record, offsets.add(key, 0), 0, task=Task(envelope, dict(headers), strategy),
                        verdict=Verdict(Admit.RUN)))
(request,) = requests
request.on_timeout(False, 3)
held = offsets.committable()[key]
time.sleep(1)
still = offsets.committable()[key]
failures._parking.clear()  # as when the store is back and the letter written
for fn, args in later:
    fn(*args)
print(json.dumps({"held": held, "still": still, "after": offsets.committable()[key]}))
"""


def run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_main_process_failure_path_hands_the_dead_letter_to_a_thread():
    result = run(MAIN_PROCESS)
    assert result["seconds"] < 5, result  # the loop goes on; blocked, it would wait for the store
    assert result["parking"] == ["delayed-park"], result  # and the letter is still being retried


def test_an_eager_failure_returns_while_its_dead_letter_is_retried_in_a_thread(tmp_path):
    result = run(EAGER, str(tmp_path / "ledger.db"))
    assert result["state"] == "FAILURE" and result["seconds"] < 5, result
    assert result["parking"] == ["delayed-park"], result


def test_an_eager_task_scheduling_its_own_id_gets_the_stores_error():
    result = run(EAGER_SELF_SCHEDULE)
    assert result == {**result, "state": "FAILURE", "error": "StoreUnavailable"} and result["seconds"] < 10, result


def test_a_record_whose_dead_letter_waits_for_the_store_stays_unsettled_until_it_is_written():
    """Celery's main process acknowledges a task that hit its hard time limit right after it sent
    ``task_failure``, whose dead letter a thread writes once the store is back: settled at once, the
    record was committed, and a worker that died before that left the task nowhere."""
    assert run(HELD_UNTIL_PARKED) == {"held": 0, "still": 0, "after": 1}


def test_a_park_with_no_thread_to_be_had_is_tried_once_and_holds_no_record(monkeypatch):
    """No thread could start (memory, a thread limit): the letter is written once, here, and its task
    id no longer says it is being parked, or its record would be held back for good."""
    from types import SimpleNamespace

    from celery_delayed.store.dlq import DeadLetter
    from celery_delayed.worker import failures

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(failures.threading.Thread, "start", refuse)
    written = []
    failures._park(SimpleNamespace(add=written.append), DeadLetter(task_id="t-1", reason="failed", source="worker"),
                   in_pool=False)
    assert [letter.task_id for letter in written] == ["t-1"] and not failures.parking("t-1")
