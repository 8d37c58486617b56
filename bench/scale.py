"""celery-delayed at scale: the bulk APIs, a poller, Kafka and several workers, in one run.

1. **End to end** (``--tasks``, default 1M): N no-op tasks (``compare.noop``, which records its
   first start and how often it ran) sent with ``celery_delayed.apply_many`` while a poller and
   ``--workers`` workers (prefork ``-c 2`` each) run, their ETAs spread evenly over N / ``--rate``
   seconds from ``--lead`` s after the first call.  ``apply_many`` sends faster than the tasks fall
   due, so every task is stored before its due time while the scheduling client shares the machine
   with the workers, as it would in production.  ``--rate`` stays below what the workers can run,
   so lag, not a backlog, is measured.  Reported: scheduling tasks/s,
   due -> started lag p50/p99/max and its CDF, tasks started per second, the poller's and every
   worker's RSS over time, end-to-end wall time (first ``apply_many`` call -> last task started),
   lost and duplicated tasks.
2. **Store and dispatch** (``--store-tasks``, default 10M): N copies of the real message Celery
   builds for ``tasks.demo.add(2, 2)``, each with its own id, stored with
   ``store_of(app).schedule_many`` (the bulk API for pre-built messages; ``apply_many`` builds
   each message with Celery, ~0.4 ms a task here) all due, then one poller moves them to Kafka
   with no worker (``bench.dispatch``'s throughput run): scheduling tasks/s, Redis bytes per task,
   dispatch tasks/s, the PING round trips another Redis client saw meanwhile, and every record
   read back from the topic (lost, duplicated).  Running 10M no-op tasks is left out: a 2-process
   worker runs ~400 tasks/s here (``bench.e2e``), so 10M would take hours.

    python -m bench.scale [--quick] [--tasks N] [--rate R] [--workers K] [--store-tasks N]

Writes bench/results/scale-<time>.json, .md and .png; a full run also as scale-latest.* (the
README's figures).  Exits 1 when a task is lost or ran twice."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import RESULTS, exclusive, new_overrides, save_figure, summary, versions
from bench.compare import RssSampler, start_worker, wait_runs
from bench.compare_app import RECORDS, create_app, read_run, run_keys
from bench.dispatch import Profile, capture_template, git_state, throughput
from celery_delayed import apply_many
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from tasks.processes import Processes

console = Console(width=None if Console().is_terminal else 160)
#: Signatures per ``apply_many`` call: the results of each are dropped, so the client's memory stays flat.
SEND_CHUNK = 50_000
#: Store partitions, as a deployment of this size would have.
PARTITIONS = 16
ON_TIME_MS = 1000


def send(app: Any, run: str, n: int, first_due: float, window: float, progress: Progress, label: str,
         queue: str | None = None, until: float | None = None) -> tuple[float, int]:
    """``apply_many`` N ``compare.noop`` signatures due evenly over ``window`` s from ``first_due``
    (epoch s; a window of 0: all due at that instant), on ``queue`` if given (else the app's
    default queue), in calls of :data:`SEND_CHUNK`; returns the seconds it took and the signatures
    sent.  With ``until`` (epoch s), none is built from then on (``apply_many`` builds and sends
    them a chunk at a time), so fewer than N may be sent."""
    noop = app.tasks["compare.noop"]
    job = progress.add_task(label, total=n)
    routing = {"queue": queue} if queue else {}

    def signatures() -> Iterator[Any]:
        for i in range(n):
            if until is not None and time.time() >= until:
                return
            due_ms = int((first_due + window * i / n) * 1000)
            yield noop.si(run, due_ms).set(eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc), **routing)

    began = time.perf_counter()
    rest, done, sent = signatures(), 0, SEND_CHUNK
    while sent == SEND_CHUNK:
        sent = len(apply_many(islice(rest, SEND_CHUNK), app=app,
                              progress=lambda k, done=done: progress.update(job, completed=done + k)))
        done += sent
    return time.perf_counter() - began, done


def end_to_end(opts: argparse.Namespace, progress: Progress, logdir: Path) -> dict[str, Any]:
    """Case 1: N tasks through apply_many, one poller and ``opts.workers`` workers; the figures."""
    n = opts.tasks
    overrides = new_overrides(partitions=PARTITIONS)
    app = create_app("celery-delayed", **overrides)
    records = redis.Redis.from_url(RECORDS)
    run = uuid.uuid4().hex[:8]
    env = {"COMPARE_SYSTEM": "celery-delayed"}
    procs = Processes(logdir, overrides, app="bench.compare_app")
    samplers: dict[str, RssSampler] = {}
    try:
        started = {"poller": procs.start("poller", "delayed", "poller", "-l", "INFO", env=env)}
        for k in range(opts.workers):
            started[f"worker w{k + 1}"] = start_worker(procs, env, name=f"w{k + 1}")
        for name, proc in started.items():
            samplers[name] = RssSampler()
            samplers[name].pid = proc.pid
            samplers[name].start()
        window = n / opts.rate
        began = time.time()
        first_due = began + opts.lead
        schedule_s, _ = send(app, run, n, first_due, window, progress, f"end to end: schedule {n:,}")
        wait_runs(records, run, n, first_due + window + opts.grace, progress,
                  f"end to end: run (due over {window:,.0f} s)", procs)
        time.sleep(2)  # a duplicate may still land
        runs, lags, per_s = read_run(records, run)
        lags.sort()
        return {"tasks": n, "workers": opts.workers, "rate": opts.rate, "window_s": round(window, 1),
                "schedule_s": round(schedule_s, 1), "schedule_per_s": round(n / schedule_s),
                "lag_ms": summary(lags),
                "on_time": sum(lag <= ON_TIME_MS for lag in lags), "ran": len(runs), "lost": n - len(runs),
                "duplicated": sum(count > 1 for count in runs.values()),
                "wall_s": round(max(per_s, default=began) + 1 - began, 1),
                "started_per_s": sorted((second - began, count) for second, count in per_s.items()),
                "first_due_s": round(first_due - began, 1),
                "peak_rss_mb": {name: round(max((mb for _, mb in s.samples), default=0.0), 1)
                                for name, s in samplers.items()},
                "rss": {name: s.samples for name, s in samplers.items()}, "lags": lags}
    finally:
        for sampler in samplers.values():  # first: the processes' teardown is not part of the curve
            sampler.stop()
        procs.stop_all()
        records.delete(*run_keys(run))
        settings = Settings.from_conf(overrides)
        remove_everything(settings, [settings.topic(overrides["task_default_queue"])])


# -- report --------------------------------------------------------------------
def report(e2e: dict[str, Any] | None, disp: dict[str, Any] | None) -> str:
    """Both cases as Markdown (also printed)."""
    lines = []
    if e2e:
        lag = e2e["lag_ms"]
        rss = ", ".join(f"{name} {mb}" for name, mb in e2e["peak_rss_mb"].items())
        rows = [("tasks (end to end)", f"{e2e['tasks']:,}, due over {e2e['window_s']:,} s ({e2e['rate']:,}/s), "
                 f"{e2e['workers']} workers prefork -c 2, one poller"),
                ("scheduling (apply_many)", f"{e2e['schedule_s']} s, {e2e['schedule_per_s']:,} tasks/s"),
                ("due -> started p50 / p99 / max ms", f"{lag['p50']:.0f} / {lag['p99']:.0f} / {lag['max']:.0f}"),
                ("started within 1 s of due", f"{e2e['on_time']:,} ({e2e['on_time'] / e2e['tasks']:.2%})"),
                ("peak RSS MB", rss),
                ("end-to-end wall time", f"{e2e['wall_s']:,} s (first apply_many call -> last task started)"),
                ("lost / duplicated", f"{e2e['lost']:,} / {e2e['duplicated']:,}")]
        lines += _table("bench.scale: end to end", rows)
    if disp:
        ping = disp["ping_ms"]
        rows = [("tasks (store and dispatch)", f"{disp['tasks']:,} due, {disp['partitions']} partitions, one poller, "
                 "no worker"),
                ("scheduling (schedule_many)", f"{disp['preload_s']} s, {disp['preload_per_s']:,} tasks/s"),
                ("Redis bytes per task", f"{disp['redis_bytes_per_task']:,} (message {disp['envelope_bytes']} B)"),
                ("dispatch to Kafka", f"{disp['dispatch_s']} s, {disp['per_s_dispatch']:,} tasks/s "
                 f"(all on the topic and gone from the store after {disp['wall_s']} s)"),
                ("PING p99 / max ms meanwhile", f"{ping['p99']:.1f} / {ping['max']:.1f}"),
                ("records read back / lost / duplicated", f"{disp['records']:,} / {disp['lost']:,} / "
                 f"{disp['duplicates']:,}")]
        lines += _table("bench.scale: store and dispatch", rows)
    return "\n".join(lines) + "\n"


def _table(title: str, rows: list[tuple[str, str]]) -> list[str]:
    table = Table("measure", "result", title=title)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return [f"### {title}", "", "| measure | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows), ""]


def plot(e2e: dict[str, Any], path: Path) -> Path:
    """End to end: the lag CDF, tasks started per second, and RSS over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, rate, rss) = plt.subplots(1, 3, figsize=(18, 4.8))
    lags, n = e2e["lags"], e2e["tasks"]
    cdf.plot([max(lag, 1) for lag in lags], [(i + 1) / n for i in range(len(lags))], label="celery-delayed")
    cdf.set(title=f"due -> started, {n:,} tasks (fraction of N)", xlabel="lag (ms, log)",
            ylabel="fraction started", xscale="log", ylim=(0, 1.01))
    per_s = e2e["started_per_s"]
    rate.plot([t for t, _ in per_s], [k for _, k in per_s], label="started")
    rate.axhline(e2e["rate"], color="grey", linestyle="--", label=f"due ({e2e['rate']:,}/s)")
    rate.set(title="tasks started per second", xlabel="seconds since the first apply_many call", ylabel="tasks/s")
    for name, samples in e2e["rss"].items():
        rss.plot([t for t, _ in samples], [mb for _, mb in samples], label=name)
    rss.set(title="RSS over time (each process with its pool)", xlabel="seconds", ylabel="MB", ylim=(0, None))
    return save_figure(fig, (cdf, rate, rss), path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3,000 tasks end to end, 50,000 stored (CI)")
    parser.add_argument("--tasks", type=int, default=1_000_000, help="N end to end (0: skip)")
    parser.add_argument("--rate", type=int, default=300,
                        help="tasks due per second end to end (2 workers here run ~430/s at most)")
    parser.add_argument("--workers", type=int, default=2, help="workers (prefork -c 2 each)")
    parser.add_argument("--lead", type=float, default=10.0, help="first ETA this many seconds after the start")
    parser.add_argument("--grace", type=float, default=120.0, help="wait this long past the last ETA")
    parser.add_argument("--store-tasks", type=int, default=10_000_000, help="N stored and dispatched (0: skip)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.tasks, opts.rate, opts.store_tasks, opts.lead, opts.grace = 3_000, 300, 50_000, 5.0, 60.0
    if opts.store_tasks > 10_000_000:
        parser.error("--store-tasks: at most 10,000,000")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    with exclusive("bench.scale"):
        found = versions()
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp, \
                Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=console) as progress:
            disp = None
            if opts.store_tasks:
                profile = Profile(tasks=opts.store_tasks, backlog=0, rates=[], duration=1.0, partitions=PARTITIONS,
                                  pollers=[1])
                disp = throughput(capture_template(PARTITIONS), profile, 1, Processes(Path(tmp)), progress,
                                  py_spy=False)
            e2e = end_to_end(opts, progress, Path(tmp)) if opts.tasks else None
        table = report(e2e, disp)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = RESULTS / f"scale-{stamp}{'-quick' if opts.quick else ''}"
        base.with_suffix(".md").write_text(table)
        base.with_suffix(".json").write_text(json.dumps(
            {"versions": found, "git": git_state(), "options": vars(opts),
             "end_to_end": e2e and {k: v for k, v in e2e.items() if k != "lags"}, "store_and_dispatch": disp},
            indent=1))
        if e2e:
            plot(e2e, base.with_suffix(".png"))
        if not opts.quick:
            for suffix in (".md", ".json", ".png"):
                if base.with_suffix(suffix).exists():
                    shutil.copyfile(base.with_suffix(suffix), RESULTS / f"scale-latest{suffix}")
        console.print(f"results: {base}.md, .json, .png")
        bad = any(case and (case.get("lost") or case.get("duplicated") or case.get("duplicates"))
                  for case in (e2e, disp))
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
