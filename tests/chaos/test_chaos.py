"""The chaos suite's quick profile as a test: 10,000 tasks under one of each cheap fault.

Runs ``python -m tests.chaos --quick`` as a subprocess (its pollers and workers are
its own children, stopped by it) and asserts its ledger: nothing lost (Redis is
restarted cleanly in this profile, so its durability excuses nothing), no
duplicate side effect, revoked tasks never ran, rescheduled ones not early, the
store empty, no consumer lag and the dead-letter queue holding exactly the
tasks meant to fail.  Deselect with ``-m "not chaos"``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.support import ROOT

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.serial]  # restarts the servers

#: The quick profile's own deadline is 270 s; past this the run is told to stop (and stops what it started).
RUN_TIMEOUT_S = 285


@pytest.mark.timeout(RUN_TIMEOUT_S + 75)
def test_quick_chaos_profile_loses_nothing_and_duplicates_no_side_effect(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.Popen([sys.executable, "-m", "tests.chaos", "--quick", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the run stops its pollers and workers on SIGTERM
        output, _ = proc.communicate(timeout=60)
    print(output[-8000:])
    result = json.loads((out / "report.json").read_text())
    faults = {row["fault"]: row for row in result["faults"]}
    assert result["lost"] == 0, f"lost {result['lost_ids']}: {faults}"
    assert sum(row["duplicate_effects"] for row in faults.values()) == 0
    failed = {name for name, ok in result["checks"].items() if not ok}
    assert not failed, (result["checks"], result["effects"], result["dlq"], result["store_left"])
    assert all(row["injected"] for name, row in faults.items() if name != "(no fault)"), faults
    assert not [f for f in result["injected"] if f["note"].startswith("FAILED")], result["injected"]
    assert proc.returncode == 0, output[-2000:]
