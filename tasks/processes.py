"""The demo project's Celery processes (pollers, workers, Flower) as real OS processes, for the
integration tests, the chaos suite and the benchmarks alike.

Settings reach a process through ``config.celeryconfig``'s environment mapping
(:func:`environment`); each process leads its own session and writes its output
to a log file; :meth:`Processes.stop_all` stops each by PID (TERM, then KILL).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def environment(overrides: dict[str, Any]) -> dict[str, str]:
    """This process's environment with ``overrides`` (Celery and ``delayed_`` settings) as
    ``config.celeryconfig`` reads them: ``DELAYED_FOO`` for ``delayed_foo``, ``CELERY_FOO`` for ``foo``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in overrides.items():
        name = key.upper() if key.startswith("delayed_") else "CELERY_" + key.upper()
        env[name] = str(value)
    return env


class Processes:
    """The demo project's processes one test or benchmark starts; all are stopped (by PID) by :meth:`stop_all`."""

    def __init__(self, logdir: Path, overrides: dict[str, Any] | None = None, app: str = "tasks") -> None:
        self.logdir = logdir
        self.overrides = overrides or {}
        self.app = app  # the Celery app's module (``celery -A``)
        self.procs: list[tuple[subprocess.Popen, Path]] = []  # kept after stop_all: the logs stay readable
        self._stopped: set[int] = set()

    def start(self, name: str, *args: str, env: dict | None = None, overrides: dict[str, Any] | None = None,
              wrap: list[str] | None = None) -> subprocess.Popen:
        """``python -m celery -A <app> <args>``, its output in ``<logdir>/<name>-<n>.log``; ``wrap`` is a
        command prefix that keeps the pid (``ip netns exec NS``: the process in a test host)."""
        log = self.logdir / f"{name}-{len(self.procs)}.log"
        proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "celery", "-A", self.app, *args], cwd=ROOT,
                                env={**environment(self.overrides if overrides is None else overrides),
                                     **(env or {})},
                                stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log))
        return proc

    def poller(self, name: str = "poller", overrides: dict[str, Any] | None = None,
               wrap: list[str] | None = None) -> subprocess.Popen:
        return self.start(name, "delayed", "poller", "-l", "INFO", overrides=overrides, wrap=wrap)

    def worker(self, name: str = "w1", *args: str, env: dict | None = None,
               wrap: list[str] | None = None) -> subprocess.Popen:
        """A worker of the overrides' default queue, without the broadcast chatter tests do not need."""
        queue = self.overrides["task_default_queue"]
        return self.start(f"worker-{name}", "worker", "-l", "INFO", "-n", f"{name}@%h", "-Q", queue,
                          "--without-heartbeat", "--without-mingle", "--without-gossip", *args, env=env, wrap=wrap)

    def log(self, proc: subprocess.Popen) -> str:
        return next(log for p, log in self.procs if p is proc).read_text(errors="replace")

    def check_alive(self) -> None:
        """Fail with the log tail of any started process that exited (and was not stopped)."""
        for proc, log in self.procs:
            if proc.pid not in self._stopped and proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"process {proc.pid} exited with {proc.returncode}; log {log}:\n{tail}")

    def warm_stop(self, proc: subprocess.Popen, timeout: float = 60.0) -> int:
        """Stop a worker as ``docker stop`` or systemd's ``KillMode=mixed`` does: SIGTERM to its main
        process only, a warm shutdown in which its pool children finish the tasks they run (a SIGTERM
        to the whole group kills them mid-task, and they run again); SIGKILL to the group after
        ``timeout``.  Returns the exit status."""
        self._stopped.add(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal(proc.pid, signal.SIGKILL)
            return proc.wait()

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every live process (its own process group, by PID), SIGKILL after ``timeout``."""
        for proc, _ in self.procs:
            self._stopped.add(proc.pid)
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
            else:  # its main process is gone (killed, crashed): what it left in its group goes too
                _signal(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc.pid, signal.SIGKILL)
                proc.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the process leads its own session: its group id is its pid
    except ProcessLookupError:
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a test or benchmark starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], object], timeout: float, what: str | Callable[[], str],
             interval: float = 0.1) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); fail naming ``what`` after ``timeout``
    s (a callable ``what`` is called then, to describe the state the wait ended in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
