"""mypy and ruff (settings in pyproject.toml) are clean on the whole package: a new module is checked
from its first commit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mypy", reason="mypy is a dev tool: scripts/test has it, test-pythons not")


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name(tool)), *args, "celery_delayed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_is_clean_on_the_package():
    result = run("mypy", "--no-incremental")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean_on_the_package():
    result = run("ruff", "check", "--no-cache", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr
