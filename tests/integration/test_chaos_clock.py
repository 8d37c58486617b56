"""The chaos suite's stepped clocks (:mod:`tests.chaos.clock`): a process under its clock sleeps and hands
work between threads on time, its wall clock follows its offset file, its monotonic clock does not, and the
ledger's wall clock (:func:`tasks.chaos.wall_ms`) stays the real one; and a client whose wall clock is off
schedules by the store's clock."""
from __future__ import annotations

import json
import os
from itertools import pairwise
import subprocess
import sys
import time

import pytest

from celery_delayed import store_of
from tasks import create_app
from tasks.chaos import WALL_MINUS_MONOTONIC
from tasks.processes import ROOT, environment
from tests.chaos import clock

pytestmark = pytest.mark.skipif(clock.available() is not None, reason=f"no clock steps here: {clock.available()}")

#: Prints 6 times, 0.5 s apart: wall clock, monotonic clock, the ledger's clock, a thread hand-off's time (s).
PROBE = """
import json, queue, threading, time
from tasks.chaos import wall_ms
handed = queue.Queue()
for _ in range(6):
    threading.Thread(target=lambda: handed.put(time.monotonic())).start()
    handoff = time.monotonic() - handed.get(timeout=5)
    print(json.dumps([time.time(), time.monotonic(), wall_ms() / 1000, handoff]), flush=True)
    time.sleep(0.5)
"""


def test_a_stepped_clock_moves_the_wall_clock_alone_and_waits_stay_on_time(tmp_path):
    prefix, offset = clock.Clocks(tmp_path).wrap()
    env = {**os.environ, WALL_MINUS_MONOTONIC: repr(time.time() - time.monotonic())}
    proc = subprocess.Popen([*prefix, sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    try:
        first = proc.stdout.readline()  # before the step
        clock.step(offset, 30)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    samples = [json.loads(line) for line in (first + out).splitlines()]
    assert len(samples) == 6, out
    skews = [wall - real for wall, _, real, _ in samples]
    assert abs(skews[0]) < 0.5 and abs(skews[-1] - 30) < 0.5, skews  # stepped, within a second
    ticks = [b[1] - a[1] for a, b in pairwise(samples)]
    assert all(0.45 < t < 1.5 for t in ticks), ticks  # sleeps of 0.5 s, no jump of the monotonic clock
    assert all(abs((b[2] - a[2]) - t) < 0.01 for (a, b), t in zip(pairwise(samples), ticks))  # the ledger's: real
    assert max(s[3] for s in samples) < 0.1, samples  # libfaketime alone: up to 0.2 s (tests/chaos/realwaits.c)


#: Sends task argv[1] with a 20 s countdown (Celery turns it into an ETA by this process's clock).
SEND = """
import sys
from tasks import app
app.tasks["tasks.demo.add"].apply_async((1, 2), countdown=20, task_id=sys.argv[1])
"""


@pytest.mark.parametrize("seconds", [30, -30])
def test_a_countdown_from_a_client_whose_clock_is_off_is_due_by_the_stores_clock(overrides, tmp_path, seconds):
    """Found by the chaos suite's clock-step fault: a worker 30 s ahead stored its tasks' retries (countdown 3 s)
    33 s ahead of the store's clock, which decides when they are due: 30 s late (or, 30 s behind, at once)."""
    prefix, offset = clock.Clocks(tmp_path).wrap()
    clock.step(offset, seconds)
    store = store_of(create_app(**overrides))
    task_id = f"skewed-{seconds}"
    sent = subprocess.run([*prefix, sys.executable, "-c", SEND, task_id], cwd=ROOT, env=environment(overrides),
                          capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr[-2000:]
    due_in_s = (store.get(task_id)["due_ms"] - store.now_ms()) / 1000
    assert 15 < due_in_s <= 20, due_in_s
