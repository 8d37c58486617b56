"""The allowed directions of imports between the hops (``[tool.importlinter]`` in pyproject.toml,
each subpackage's docstring) hold, checked by import-linter; and an import against them fails the check."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("importlinter", reason="import-linter is a dev tool: scripts/test has it, test-pythons not")


def lint_imports(where: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``celery_delayed`` package and pyproject.toml found in ``where``."""
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("imports, broken", [
    ({"store/keys.py": "from celery_delayed.poller import loop"}, "Hops: ops above the client"),
    ({"worker/offsets.py": "from celery_delayed.poller import delivery"}, "Hops: ops above the client"),
    ({"client/bulk.py": "import confluent_kafka"}, "never import Kafka"),
    ({"envelope.py": "from celery_delayed.store import keys"}, "import no hop"),
    ({"store/keys.py": "from celery_delayed.store import layout",  # a circle: both halves
      "store/layout.py": "from celery_delayed.store import keys"}, "No import circles"),
])
def test_an_import_against_the_contracts_fails_the_check(tmp_path, imports, broken):
    """``imports``: a line added at the end of each module named (under celery_delayed/)."""
    shutil.copytree(ROOT / "celery_delayed", tmp_path / "celery_delayed", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for module, line in imports.items():
        with open(tmp_path / "celery_delayed" / module, "a") as f:
            f.write(f"\n{line}  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    report = " ".join(result.stdout.split())  # contract names wrap in the report
    verdict = re.search(re.escape(broken) + r".*? (KEPT|BROKEN)\b", report)
    assert verdict and verdict.group(1) == "BROKEN", result.stdout
