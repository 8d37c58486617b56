"""mypy and ruff (settings in pyproject.toml) are clean on the modules brought clean so far; a module
joins :data:`CHECKED` once it is, and the list grows until it is the whole package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mypy", reason="mypy is a dev tool: scripts/test has it, test-pythons not")

#: The modules held clean (paths under celery_delayed/).
CHECKED = [
    "__init__.py", "backend.py", "inert.py", "metrics.py", "kafka.py", "settings.py",
    "envelope.py", "sandbox.py", "testing.py",
    "client/__init__.py", "client/batch.py", "client/bulk.py", "client/schedules.py", "client/template.py",
    "client/intercept.py",
    "recurring/__init__.py", "recurring/rules.py", "recurring/occurrences.py", "recurring/definitions.py",
    "recurring/policy.py",
    "store/__init__.py", "store/keys.py", "store/layout.py", "store/records.py", "store/revoke.py",
    "store/scripts.py",
    "poller/__init__.py", "poller/loop.py", "poller/delivery.py", "poller/leadership.py",
    "worker/__init__.py", "worker/drained.py", "worker/failures.py", "worker/offsets.py", "worker/once.py",
    "worker/wakeup.py", "worker/intake.py", "worker/consumer.py",
    "store/delayed.py", "store/inspection.py", "store/durability.py", "store/outcomes.py",
    "store/redis_client.py",
    "ops/__init__.py", "ops/cli.py", "ops/drain.py", "ops/web/__init__.py", "ops/web/server.py", "ops/web/views.py", "store/dlq.py",
    "ops/browse.py",
]


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name(tool)), *args,
                           *(f"celery_delayed/{m}" for m in CHECKED)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_is_clean_on_the_checked_modules():
    # imported modules outside CHECKED are read for their types, their own errors not reported
    result = run("mypy", "--follow-imports=silent", "--no-incremental")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean_on_the_checked_modules():
    result = run("ruff", "check", "--no-cache", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr
