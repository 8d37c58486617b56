"""Helpers for integration tests: real subprocesses and patient waiting."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]


def environment(overrides: dict) -> dict:
    """The same settings for a subprocess, through config.celeryconfig's environment mapping."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in overrides.items():
        name = key.upper() if key.startswith("delayed_") else "CELERY_" + key.upper()
        env[name] = str(value)
    return env


class Processes:
    """Real OS processes a test starts; all are stopped (by PID) at teardown."""

    def __init__(self, logdir: Path, overrides: dict) -> None:
        self.logdir = logdir
        self.overrides = overrides
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = self.logdir / f"{name}-{len(self.procs)}.log"
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", *args], cwd=ROOT,
                                env=environment(self.overrides), stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log))
        return proc

    def poller(self) -> subprocess.Popen:
        return self.start("poller", "delayed", "poller", "-l", "INFO")

    def worker(self, name: str = "w1", *args: str) -> subprocess.Popen:
        queue = self.overrides["task_default_queue"]
        return self.start(f"worker-{name}", "worker", "-l", "INFO", "-n", f"{name}@%h", "-Q", queue,
                          "--without-heartbeat", "--without-mingle", "--without-gossip", *args)

    def log(self, proc: subprocess.Popen) -> str:
        return next(log for p, log in self.procs if p is proc).read_text(errors="replace")

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll ``check`` until it returns a truthy value; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")
