"""celery-delayed beside Celery's native ETA and the Celery-ecosystem alternatives: the same tasks, one run.

For each system and each N: one worker (prefork, 2 processes) is started, N no-op
tasks are scheduled with ETAs spread uniformly over ``--window`` seconds from
``--lead`` seconds after the start, and each records its first start and how often
it ran (``bench.compare_app``).  Halfway through the window the worker is restarted
(SIGTERM to its main process, a warm shutdown; then a new one), and a task sent without an ETA measures how long the new
worker takes to be running again while the scheduled tasks wait.  Reported: time
to schedule, Redis memory they take, the worker's peak RSS (all its processes),
tasks started on time (within 1 s of due), lag p50/p99/max, lost, duplicated.

Systems, each from the same demo servers and Celery settings (``task_acks_late``):

- **native**: Celery's own ETA on the Redis broker (the worker holds every task in
  memory until due), default ``visibility_timeout`` (1 h);
- **native-vt**: the same with ``visibility_timeout`` shorter than the countdowns
  (``--visibility``), the setting Redis/SQS users lower to recover lost tasks sooner;
- **celery-delayed**: one poller, the worker consuming Kafka;
- **longterm-scheduler**: celery-longterm-scheduler (PyPI, installed by this
  benchmark), its ``celery longterm_scheduler`` run every ``--cron`` seconds as the
  cron job its documentation asks for (cron's finest is 60 s);
- **native-eta-limit**: Celery's ETA with ``worker_eta_task_limit`` (Celery >= 5.6: the
  worker holds at most that many ETA tasks, the others wait on the broker);
- **celery-redis-plus**: its Redis transport keeps ETA tasks in a sorted set that the workers
  move to the queue when due; it needs Python >= 3.13, so its cases run in a venv of Python 3.13
  this benchmark makes (``.services/compare-py3.13``: the project at the tested versions and the
  package; the client that schedules runs there too);
- systems that cannot run here are listed with the reason.

    python -m bench.compare [--quick] [--tasks 100000 ...] [--window 600]

Writes bench/results/compare-<time>.json, .md and .png (worker RSS over time, lag CDF); a full
run also as bench/results/compare-latest[-<systems>].*, which the README shows, and redraws
bench/results/compare-on-time.png (tasks on time against N, from every compare-latest*.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import celery
import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import RESULTS, exclusive, new_overrides, percentile, save_figure, versions
from bench.compare_app import RECORDS, create_app, read_run, run_keys
from bench.dispatch import git_state
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from tasks.processes import ROOT, Processes, environment, wait_for

console = Console(width=None if Console().is_terminal else 160)
#: Where the PyPI packages compared are installed (apart from the project's .venv).
PACKAGES = ROOT / ".services" / "compare-packages"
#: celery-longterm-scheduler's store: "a dedicated redis database", as its documentation asks.
LONGTERM_DB = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}/4"
#: celery-redis-plus's broker: a database of its own, emptied after each case (its keys are its own).
REDIS_PLUS_DB = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}/6"
ON_TIME_MS = 1000
#: This benchmark's Python (a system needing another runs its cases in a venv of that one).
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass
class System:
    name: str
    how: str  # how it is configured, for the table
    app: str  # bench.compare_app's COMPARE_SYSTEM
    overrides: dict[str, Any] = field(default_factory=dict)
    packages: tuple[str, ...] = ()  # from PyPI, installed into PACKAGES
    python: str = ""  # the Python it needs when not this one (e.g. "3.13"): its cases run in a venv of it
    why_not: str | None = None  # set when it cannot run here
    installed: dict[str, str] = field(default_factory=dict)  # versions in its venv, for the report


def systems(opts: argparse.Namespace) -> list[System]:
    found = [
        System("native", "Celery ETA on the Redis broker, visibility_timeout 3600 s (default)", "native"),
        System("celery-delayed", "one poller, 8 partitions; the worker reads Kafka", "celery-delayed"),
        System("native-vt", f"Celery ETA, visibility_timeout {opts.visibility} s (< the countdowns)", "native",
               {"broker_transport_options": {"visibility_timeout": opts.visibility}}),
        System("longterm-scheduler", f"celery-longterm-scheduler 1.3.1; its scheduler run every {opts.cron} s "
               "(a cron job; cron's finest is 60 s)", "longterm-scheduler",
               {"longterm_scheduler_backend": LONGTERM_DB}, ("celery-longterm-scheduler==1.3.1", "pendulum")),
        System("celery-redis-plus", "its Redis transport (ETA tasks in a sorted set, moved to the queue by the "
               "workers when due), Python 3.13", "native",
               {"broker_url": REDIS_PLUS_DB, "broker_transport": "celery_redis_plus.transport:Transport"},
               ("celery-redis-plus==0.4.1",), python="3.13"),
    ]
    from celery.app.defaults import DEFAULTS
    limit = System("native-eta-limit", f"Celery ETA, worker_eta_task_limit {opts.eta_limit} (Celery >= 5.6)",
                   "native", {"worker_eta_task_limit": opts.eta_limit})
    if "worker_eta_task_limit" not in DEFAULTS:
        limit.why_not = f"Celery {celery.__version__} has no worker_eta_task_limit setting"
    found.insert(3, limit)
    return found


def install(system: System) -> None:
    """Install a system's PyPI packages into :data:`PACKAGES` (the project's dependencies are shared),
    or, for a system needing another Python, into a venv of that Python with the project (at the
    tested versions); or say in ``why_not`` why they cannot be installed."""
    if system.python and system.python != PYTHON:
        _install_venv(system)
        return
    if not system.packages or system.why_not:
        return
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PACKAGES),
                           *system.packages], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        needs = re.search(r"Requires-Python ([^;\s]+)", done.stderr)
        system.why_not = (f"needs Python {needs.group(1)} (this run: {platform.python_version()})" if needs
                          else f"cannot be installed here: {lines[-1] if lines else '?'}")
    elif not system.app:
        system.why_not = "installed, but this benchmark does not configure it yet"


def venv_python(version: str) -> Path:
    """The interpreter of the benchmark's venv of Python ``version`` (under ``.services/``)."""
    return ROOT / ".services" / f"compare-py{version}" / "bin" / "python"


def _interpreter(version: str) -> str | None:
    """A Python ``version`` that runs on this machine: one pyenv installed, or one on the PATH (a pyenv
    shim on the PATH answers for versions it does not serve, so each is tried)."""
    candidates = [str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))]
    candidates += [found] if (found := shutil.which(f"python{version}")) else []
    return next((c for c in candidates
                 if subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0), None)


def _install_venv(system: System) -> None:
    """Create (once) the venv of ``system.python`` with the project and the system's packages."""
    python = venv_python(system.python)
    if not python.exists():
        interpreter = _interpreter(system.python)
        if interpreter is None:
            system.why_not = f"needs Python {system.python}, not found on this machine"
            return
        subprocess.run([interpreter, "-m", "venv", str(python.parent.parent)], check=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                           "-e", str(ROOT), *system.packages], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        system.why_not = f"cannot be installed in Python {system.python}: {lines[-1] if lines else '?'}"
        return
    names = [package.split("=")[0] for package in system.packages]
    report = subprocess.run([str(python), "-c", "import sys, platform; from importlib.metadata import version; "
                             "print(platform.python_version(), *(version(n) for n in sys.argv[1:]))", *names],
                            capture_output=True, text=True, check=True).stdout.split()
    system.installed = {f"{system.name} python": report[0], **dict(zip(names, report[1:]))}


def run_elsewhere(system: System, n: int, opts: argparse.Namespace, progress: Progress,
                  logdir: Path) -> dict[str, Any]:
    """One case of a system that needs another Python, run by this benchmark in that Python's venv
    (:func:`run_one`), its figures read back."""
    job = progress.add_task(f"{system.name}: {n:,} tasks, in Python {system.python}", total=None)
    out = logdir / f"case-{system.name}-{n}.json"
    args = ["--run-one", system.name, "--tasks", str(n), "--out", str(out)]
    for name in ("window", "lead", "grace", "visibility", "cron", "eta_limit", "restart_timeout"):
        args += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    with open(logdir / f"case-{system.name}-{n}.log", "wb") as log:
        done = subprocess.run([str(venv_python(system.python)), "-m", "bench.compare", *args], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = (logdir / f"case-{system.name}-{n}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{system.name} at N = {n} failed in Python {system.python}:\n{tail}")
    progress.remove_task(job)
    return json.loads(out.read_text())


def session_rss(pid: int) -> int:
    """Bytes resident in every process of the session ``pid`` leads (a worker and its pool)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            if int(fields[3]) == pid:  # the session id
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss, in pages
        except (OSError, ValueError, IndexError):
            continue
    return total


class RssSampler(threading.Thread):
    """The current worker's session RSS every half second, as ``(seconds since start, MB)``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pid: int | None = None
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._start = time.monotonic()

    def run(self) -> None:
        while not self._done.wait(0.5):
            if self.pid is not None:
                self.samples.append((time.monotonic() - self._start, session_rss(self.pid) / 2**20))

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()


def run_case(system: System, n: int, opts: argparse.Namespace, progress: Progress, logdir: Path) -> dict[str, Any]:
    """One system with N tasks: schedule, restart the worker halfway, wait for every task; the figures."""
    overrides = {**new_overrides(partitions=8), **system.overrides}
    env = {"COMPARE_SYSTEM": system.app, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PACKAGES)])}
    if system.packages and not system.python:
        sys.path.insert(0, str(PACKAGES))
    app = create_app(system.app, **overrides)
    noop = app.tasks["compare.noop"]
    records = redis.Redis.from_url(RECORDS)
    run = uuid.uuid4().hex[:8]
    procs = Processes(logdir, overrides, app="bench.compare_app")
    sampler = RssSampler()
    scheduler = _Cron(system, opts.cron, environment(overrides) | env, logdir) if system.app == "longterm-scheduler" \
        else None
    try:
        if system.app == "celery-delayed":
            procs.start("poller", "delayed", "poller", "-l", "INFO", env=env)
        worker = start_worker(procs, env)
        sampler.pid = worker.pid
        sampler.start()
        memory = records.info("memory")["used_memory"]
        first_due = time.time() + opts.lead
        dues = sorted(int((first_due + random.random() * opts.window) * 1000) for _ in range(n))
        job = progress.add_task(f"{system.name}: schedule {n}", total=n)
        began = time.perf_counter()
        for i, due_ms in enumerate(dues):
            noop.apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
            if i % 500 == 0:
                progress.update(job, completed=i)
        schedule_s = time.perf_counter() - began
        progress.update(job, completed=n)
        memory_mb = (records.info("memory")["used_memory"] - memory) / 2**20
        if scheduler:
            scheduler.start()
        restart_at = first_due + opts.window / 2
        wait_runs(records, run, n, restart_at, progress, f"{system.name}: run, until the restart")
        restart_s = _restart(procs, env, noop, records, sampler, opts.restart_timeout)
        deadline = first_due + opts.window + opts.grace + (opts.cron if scheduler else 0)
        wait_runs(records, run, n, deadline, progress, f"{system.name}: run")
        time.sleep(2)  # a duplicate may still land
        runs, lags, _ = read_run(records, run)
        return {"system": system.name, "tasks": n, "schedule_s": round(schedule_s, 1),
                "schedule_per_s": round(n / schedule_s), "redis_mb": round(memory_mb, 1),
                "worker_peak_rss_mb": round(max((mb for _, mb in sampler.samples), default=math.nan), 1),
                "on_time": sum(lag <= ON_TIME_MS for lag in lags), "ran": len(runs),
                "lag_ms": {"p50": percentile(lags, .5), "p99": percentile(lags, .99), "max": max(lags, default=None)},
                "lost": n - len(runs), "duplicated": sum(count > 1 for count in runs.values()),
                "restart_s": restart_s, "rss": sampler.samples, "lag_cdf": lag_cdf(lags, n)}
    finally:
        procs.stop_all()  # first: whatever else fails here, no process is left running
        if scheduler:
            scheduler.stop()
        sampler.stop()
        _clean(system, overrides, records, run)


def start_worker(procs: Processes, env: dict[str, str], name: str = "compare") -> subprocess.Popen:
    """A worker of the compare app (prefork -c 2), once it is ready."""
    worker = procs.worker(name, "-c", "2", env=env)
    wait_for(lambda: "ready." in procs.log(worker), 60, "the worker to start")
    return worker


def wait_runs(records: redis.Redis, run: str, n: int, until: float, progress: Progress, label: str,
              procs: Processes | None = None) -> None:
    """Until ``until`` (epoch s) or all N tasks of the run started, with a progress bar; ``procs``
    given, fail as soon as one of its processes exited."""
    job = progress.add_task(label, total=n)
    while time.time() < until:
        if procs is not None:
            procs.check_alive()
        done = records.hlen(f"compare:{run}:runs")
        progress.update(job, completed=done)
        if done >= n:
            break
        time.sleep(0.5)
    progress.remove_task(job)


def _restart(procs: Processes, env: dict[str, str], noop: Any, records: redis.Redis, sampler: RssSampler,
             timeout: float) -> float | None:
    """Warm-shut the worker down, start a new one, and time a task sent without an ETA: seconds from
    the new worker's start until that task started (None: not within ``timeout``)."""
    status = procs.warm_stop(procs.procs[-1][0])
    if status != 0:
        console.print(f"[yellow]the worker did not stop warm (exit status {status}): tasks it ran may run again")
    started = time.time()
    worker = procs.worker("compare", "-c", "2", env=env)
    sampler.pid = worker.pid
    probe = uuid.uuid4().hex[:8]
    noop.apply_async((probe, int(started * 1000)))  # its "lag": from the new worker's start to its own
    try:
        wait_for(lambda: records.hlen(f"compare:{probe}:runs"), timeout, "the probe task")
    except AssertionError:
        return None
    (lag_ms,) = records.hvals(f"compare:{probe}:lag")
    records.delete(*run_keys(probe))
    return round(int(lag_ms) / 1000, 2)


class _Cron(threading.Thread):
    """``celery longterm_scheduler`` every ``every`` seconds, as a cron job runs it."""

    def __init__(self, system: System, every: float, env: dict[str, str], logdir: Path) -> None:
        super().__init__(daemon=True)
        self.every, self.env, self.log = every, env, logdir / "longterm-scheduler.log"
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every):
            with self.log.open("ab") as log:
                subprocess.run([sys.executable, "-m", "celery", "-A", "bench.compare_app", "longterm_scheduler"],
                               cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, timeout=600)

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()


def _clean(system: System, overrides: dict[str, Any], records: redis.Redis, run: str) -> None:
    """Remove what one case left: its records, its broker queue, and its system's store."""
    records.delete(*run_keys(run))
    # the whole broker database, kombu's unacknowledged messages with it: a worker stopped while
    # holding native's ETA tasks leaves them there, and the next case's worker restores them (1M
    # native left 517k, whose restoring took the next system's CPU)
    redis.Redis.from_url(create_app("native").conf.broker_url).flushdb()
    if system.app == "celery-delayed":
        settings = Settings.from_conf(overrides)
        remove_everything(settings, [settings.topic(overrides["task_default_queue"])])
    if system.app == "longterm-scheduler":
        redis.Redis.from_url(LONGTERM_DB).flushdb()  # its own database, as its documentation asks
    if system.name == "celery-redis-plus":
        redis.Redis.from_url(REDIS_PLUS_DB).flushdb()


# -- report --------------------------------------------------------------------
def report(results: list[dict[str, Any]], skipped: list[System], opts: argparse.Namespace) -> str:
    """The results as a Markdown table (also printed), ratios against native at the same N."""
    native = {r["tasks"]: r for r in results if r["system"] == "native"}
    head = ["system", "N", "schedule s (tasks/s)", "Redis MB", "worker peak RSS MB (/ native)",
            "on time <= 1 s", "lag p50 / p99 / max ms", "not run by the end", "duplicated", "restart -> running s"]
    rows = []
    for r in results:
        base = native.get(r["tasks"])
        ratio = f" ({r['worker_peak_rss_mb'] / base['worker_peak_rss_mb']:.2f}x)" if base and base is not r else ""
        lag = r["lag_ms"]
        name = r["system"] + (f" ({r['from']})" if r.get("from") else "")
        rows.append([name, f"{r['tasks']:,}", f"{r['schedule_s']} ({r['schedule_per_s']:,})",
                     f"{r['redis_mb']}", f"{r['worker_peak_rss_mb']}{ratio}",
                     f"{r['on_time']:,} ({r['on_time'] / r['tasks']:.1%})",
                     f"{_ms(lag['p50'])} / {_ms(lag['p99'])} / {_ms(lag['max'])}", f"{r['lost']:,}",
                     f"{r['duplicated']:,}", "—" if r["restart_s"] is None else f"{r['restart_s']}"])
    table = Table(*head, title=f"bench.compare: ETAs over {opts.window:.0f} s from {opts.lead:.0f} s, "
                  "worker prefork -c 2, restarted halfway")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |"
                                                                          for row in rows]
    for system in skipped:
        lines.append(f"| {system.name} | not run: {system.why_not} |" + " |" * (len(head) - 2))
        console.print(f"[yellow]{system.name}[/]: not run: {system.why_not}")
    return "\n".join(lines) + "\n"


def lag_cdf(lags: list[int], n: int, points: int = 500) -> list[tuple[int, float]]:
    """The lag CDF as ``points`` + 1 pairs (lag ms, share of all N tasks started by then), small
    enough to keep in the results and draw again."""
    ordered = sorted(lags)
    picks = sorted({i * (len(ordered) - 1) // points for i in range(points + 1)}) if ordered else []
    return [(ordered[i], (i + 1) / n) for i in picks]


def _ms(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.0f}"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Worker RSS over time and the lag CDF of each system (one row per N)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["tasks"] for r in results})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(14, 4.5 * len(sizes)), squeeze=False)
    for (rss, cdf), n in zip(axes, sizes):
        for r in (r for r in results if r["tasks"] == n):
            rss.plot([t for t, _ in r["rss"]], [mb for _, mb in r["rss"]], label=r["system"])
            cdf.plot([max(lag, 1) for lag, _ in r["lag_cdf"]], [share for _, share in r["lag_cdf"]],
                     label=r["system"])
        rss.set(title=f"worker RSS (all processes), N = {n:,}", xlabel="seconds", ylabel="MB")
        cdf.set(title=f"due -> started, N = {n:,} (fraction of all N tasks)", xlabel="lag (ms, log)",
                ylabel="fraction started", xscale="log", ylim=(0, 1.01))
    return save_figure(fig, axes.flat, path)


def plot_on_time(path: Path) -> Path | None:
    """Tasks started on time (share of N) against N, a line per system, from every full run kept as
    ``compare-latest*.json`` (runs of other sizes or systems add their points)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict[int, float]] = {}
    for kept in sorted(RESULTS.glob("compare-latest*.json")):
        for r in json.loads(kept.read_text())["results"]:
            points.setdefault(r["system"], {})[r["tasks"]] = 100 * r["on_time"] / r["tasks"]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system, by_n in sorted(points.items()):
        sizes = sorted(by_n)
        ax.plot(sizes, [by_n[n] for n in sizes], marker="o", label=system)
    ax.set(xscale="log", xlabel="scheduled tasks N (log)", ylabel="% started within 1 s of due", ylim=(0, 101),
           title="tasks on time against N (worker restarted halfway)")
    return save_figure(fig, [ax], path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,500 tasks over 12 s (CI: the code cannot rot)")
    parser.add_argument("--tasks", type=int, nargs="+", default=[100_000], help="N, one case per value")
    parser.add_argument("--window", type=float, default=600.0, help="ETAs spread over this many seconds")
    parser.add_argument("--lead", type=float, default=60.0, help="first ETA this many seconds after the start")
    parser.add_argument("--grace", type=float, default=60.0, help="wait this long past the last ETA")
    parser.add_argument("--visibility", type=int, default=60, help="native-vt's visibility_timeout (s)")
    parser.add_argument("--cron", type=float, default=60.0, help="longterm-scheduler's scheduler interval (s)")
    parser.add_argument("--eta-limit", type=int, default=1000, help="native-eta-limit's worker_eta_task_limit")
    parser.add_argument("--only", nargs="+", help="run these systems only")
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="results of an earlier run (its JSON, or a compare-partial-*.json a stopped run "
                             "left) shown beside this run's, for cases too long to run in one go")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # run_elsewhere: one case of this system, in this Python
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # ... its figures written here as JSON
    parser.add_argument("--restart-timeout", type=float, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.tasks, opts.window, opts.lead, opts.grace, opts.visibility, opts.cron = [1500], 12.0, 8.0, 8.0, 5, 5.0
    if opts.restart_timeout is None:
        opts.restart_timeout = min(900.0, max(60.0, max(opts.tasks) / 200))  # None in the table past it
    return opts


def run_one(opts: argparse.Namespace) -> int:
    """The one case :func:`run_elsewhere` asked this Python for, its figures written to ``opts.out``."""
    (system,) = [s for s in systems(opts) if s.name == opts.run_one]
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp, \
            Progress(TextColumn("{task.description}"), console=console) as progress:
        result = run_case(system, opts.tasks[0], opts, progress, Path(tmp))
    opts.out.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.run_one:  # the parent holds the benchmarks' lock
        return run_one(opts)
    with exclusive("bench.compare"):
        found = versions()
        chosen = [s for s in systems(opts) if not opts.only or s.name in opts.only]
        for system in chosen:
            install(system)
        found |= _package_versions() | {k: v for s in chosen for k, v in s.installed.items()}
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        runnable = [s for s in chosen if not s.why_not]
        results: list[dict[str, Any]] = [r for path in opts.merge for r in _merged(path)]
        partial = RESULTS / f"compare-partial-{os.getpid()}.json"
        with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp, \
                Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=console) as progress:
            for n in opts.tasks:
                for system in runnable:
                    case = run_elsewhere if system.python and system.python != PYTHON else run_case
                    results.append(case(system, n, opts, progress, Path(tmp)))
                    partial.write_text(json.dumps(results))  # a later case that fails keeps these
        partial.unlink()
        table = report(results, [s for s in chosen if s.why_not], opts)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = RESULTS / f"compare-{stamp}{'-quick' if opts.quick else ''}"
        base.with_suffix(".md").write_text(table)
        base.with_suffix(".json").write_text(json.dumps(
            {"versions": found, "git": git_state(), "options": {k: v for k, v in vars(opts).items()},
             "systems": {s.name: s.how for s in chosen}, "not_run": {s.name: s.why_not for s in chosen if s.why_not},
             "results": results}, indent=1, default=str))
        plot(results, base.with_suffix(".png"))
        if not opts.quick:  # the figures the README shows (committed)
            sizes = "" if opts.tasks == [100_000] else "".join(f"-{n}" for n in opts.tasks)  # 100k: the README's
            latest = "compare-latest" + sizes + "".join(f"-{name}" for name in opts.only or ())
            for suffix in (".md", ".json", ".png"):
                shutil.copyfile(base.with_suffix(suffix), RESULTS / f"{latest}{suffix}")
            plot_on_time(RESULTS / "compare-on-time.png")
        console.print(f"results: {base}.md, .json, .png")
        problems = [r for r in results if r["system"] == "celery-delayed" and (r["lost"] or r["duplicated"])]
        return 1 if problems else 0


def _merged(path: Path) -> list[dict[str, Any]]:
    """The results an earlier run kept in ``path`` (a run's JSON, or the partial file of one that
    stopped), each marked with the file it came from."""
    kept = json.loads(path.read_text())
    results = kept["results"] if isinstance(kept, dict) else kept
    for r in results:
        if "lags" in r:  # a partial file keeps every lag
            r["lag_cdf"] = lag_cdf(r.pop("lags"), r["tasks"])
        r["from"] = path.name
    return results


def _package_versions() -> dict[str, str]:
    """The versions of the compared packages installed into :data:`PACKAGES`."""
    from importlib.metadata import distributions
    return {dist.metadata["Name"]: dist.version for dist in distributions(path=[str(PACKAGES)])}


if __name__ == "__main__":
    sys.exit(main())
