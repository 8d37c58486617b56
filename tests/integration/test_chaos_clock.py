"""The chaos suite's stepped clocks (:mod:`tests.chaos.clock`): a process under its clock sleeps and hands
work between threads on time, its wall clock follows its offset file, its monotonic clock does not, and the
ledger's wall clock (:func:`tasks.chaos.wall_ms`) stays the real one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tasks.chaos import WALL_MINUS_MONOTONIC
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
                            cwd=clock.REAL_WAITS.parents[2])
    try:
        time.sleep(0.6)
        clock.step(offset, 30)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    samples = [json.loads(line) for line in out.splitlines()]
    assert len(samples) == 6, out
    skews = [wall - real for wall, _, real, _ in samples]
    assert abs(skews[0]) < 0.5 and abs(skews[-1] - 30) < 0.5, skews  # stepped, within a second
    ticks = [b[1] - a[1] for a, b in zip(samples, samples[1:])]
    assert all(0.45 < t < 1.5 for t in ticks), ticks  # sleeps of 0.5 s, no jump of the monotonic clock
    assert all(abs((b[2] - a[2]) - t) < 0.01 for a, b, t in zip(samples, samples[1:], ticks))  # the ledger's: real
    assert max(s[3] for s in samples) < 0.1, samples  # libfaketime alone: up to 0.2 s (tests/chaos/realwaits.c)
