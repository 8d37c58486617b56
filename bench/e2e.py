"""End-to-end benchmark: due time -> task started, and tasks/s through one worker.

Each figure is measured twice in the same run, on the same worker command:

- **kafka**: celery-delayed's path (store -> poller -> Kafka -> worker);
- **broker**: plain Celery on the Redis broker (the baseline): Celery's own ETA on the same pool.

Throughput: N tasks already due, one worker (``--pool``: prefork with 2 processes, threads with 2
threads, solo, or a green pool of 50 greenlets) started on them; tasks/s from the first to the
last task started.  Baseline: the same N tasks waiting on the broker queue.  Lag: tasks scheduled at a fixed rate with a
2 s countdown; lag = task start - due time.  Baseline: Celery's own ETA
handling (the worker holds each task in memory until due).  On the Kafka path
each lag is split into its hops (due -> claimed by the poller -> produced ->
read by the worker's feed -> handed to Celery -> started), so a regression
names its hop.  ``--load`` measures everything twice: quiet, and beside a
busy neighbour (one process spinning one core for the whole run).

``--io [S]`` measures instead the I/O-bound load Celery recommends a green pool for: one worker of
200 greenlets (``--pool gevent`` by default), R tasks due a second, each waiting S s (``time.sleep``,
patched by the pool) after it records its start; throughput = tasks ended a second, from the first
due time to the last end, on both paths.

    python -m bench.e2e [--quick] [--load] [--repeat K] [--tasks N] [--rate R] [--duration S]
                        [--pool prefork|threads|solo|gevent|eventlet] [--io [SECONDS]]

Writes bench/results/e2e[-io]-<pool>-<time>.md, .json and .png (lag distributions); a run without
``--quick`` also as e2e[-io]-<pool>-latest.*.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
from confluent_kafka import KafkaException
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.common import RESULTS, cpu_hog, exclusive, new_overrides, plot_lags, summary, versions
from bench.fleet import _markdown
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from tasks import create_app
from tasks.processes import Processes, wait_for

console = Console()

#: The worker command of each ``--pool``, the same for both paths.
POOLS = {"prefork": ("-c", "2"), "threads": ("--pool", "threads", "-c", "2"), "solo": ("--pool", "solo"),
         "gevent": ("--pool", "gevent", "-c", "50"), "eventlet": ("--pool", "eventlet", "-c", "50")}
#: ``--io``: the I/O-bound load Celery recommends a green pool for, on a worker of this many greenlets.
IO_CONCURRENCY = "200"


def _remove(overrides: dict[str, Any]) -> None:
    """Remove the keys, etcd keys and topic of a run's key prefix and queue; a busy Kafka that does not
    answer in time leaves the topic, said, not the run's figures lost."""
    settings = Settings.from_conf(overrides)
    topic = settings.topic(overrides["task_default_queue"])
    try:
        remove_everything(settings, [topic])
    except KafkaException as exc:
        console.print(f"[yellow]topic {topic} not removed: {exc}")


def lags_of(client: redis.Redis, run: str) -> list[int]:
    """Lags (ms) recorded by ``tasks.demo.fire`` for one run."""
    return [int(x) for x in client.lrange(f"demo:{run}:lag", 0, -1)]


#: The hops of a task's way from its due time to its start, as (name, from, to) of ``fire``'s record.
HOPS = [("due -> claimed", "due", "claimed"), ("claimed -> produced", "claimed", "produced"),
        ("produced -> read", "produced", "read"), ("read -> handed", "read", "handed"),
        ("handed -> started", "handed", "started")]


def hops_of(client: redis.Redis, run: str) -> dict[str, dict[str, float]]:
    """p50/p99/max (ms) of each hop, from the hop records ``tasks.demo.fire`` wrote for one run."""
    records = [json.loads(x) for x in client.lrange(f"demo:{run}:hops", 0, -1)]
    return {name: summary([r[b] - r[a] for r in records if r.get(a) is not None and r.get(b) is not None])
            for name, a, b in HOPS}


def wait_fired(client: redis.Redis, run: str, n: int, progress: Progress, label: str, timeout: float) -> None:
    job = progress.add_task(label, total=n)
    deadline = time.monotonic() + timeout
    while (done := client.hlen(f"demo:{run}:runs")) < n:
        progress.update(job, completed=done)
        if time.monotonic() > deadline:  # the table counts the others as lost
            console.print(f"[red]{label}: only {done} of {n} tasks ran in {timeout:.0f} s")
            return
        time.sleep(0.2)
    progress.update(job, completed=n)


def throughput(path: str, n: int, pool: str, progress: Progress, logdir: Path) -> dict[str, Any]:
    """Tasks/s through one worker, for N tasks already due when it starts."""
    overrides = new_overrides(partitions=8)
    app = create_app(**overrides)
    client = redis.Redis.from_url(app.conf.delayed_redis_url)
    run = uuid.uuid4().hex[:8]
    procs = Processes(logdir, overrides)
    fire = app.tasks["tasks.demo.fire"]
    try:
        due_ms = int((time.time() + 2) * 1000)
        job = progress.add_task(f"{path}: send {n}", total=n)
        sending = time.perf_counter()
        for i in range(n):
            if path == "kafka":
                fire.apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
            else:
                fire.apply_async((run, due_ms))
            progress.advance(job)
        call_ms = (time.perf_counter() - sending) * 1000 / n
        if path == "kafka":
            procs.poller()
            time.sleep(max(0.0, due_ms / 1000 - time.time()) + 1)  # all due and on Kafka...
        procs.worker("bench", *POOLS[pool])  # ...before the worker starts
        wait_fired(client, run, n, progress, f"{path}: run {n}", timeout=max(120.0, n / 20))
        starts = [due_ms + lag for lag in lags_of(client, run)]
        span = (max(starts) - min(starts)) / 1000
        return {"path": path, "tasks": n, "seconds": span, "per_s": len(starts) / span if span else float("nan"),
                "apply_async_ms": call_ms}
    finally:
        procs.stop_all()
        client.delete(f"demo:{run}:runs", f"demo:{run}:lag")
        _remove(overrides)


def lag(path: str, rate: int, duration: float, worker: tuple[str, ...], progress: Progress, logdir: Path,
        seconds: float = 0.0) -> dict[str, Any]:
    """Lag from due time to task start, tasks scheduled at ``rate``/s with a 2 s countdown, each
    taking ``seconds`` (then also tasks ended per second, from the first due time to the last end)."""
    overrides = new_overrides(partitions=8)
    if path == "broker":
        overrides["delayed_min_delay"] = 365 * 86_400  # every ETA under a year takes Celery's own path
    app = create_app(**overrides)
    client = redis.Redis.from_url(app.conf.delayed_redis_url)
    run = uuid.uuid4().hex[:8]
    procs = Processes(logdir, overrides)
    fire = app.tasks["tasks.demo.fire"]
    n = int(rate * duration)
    try:
        if path == "kafka":
            procs.poller()
        procs.worker("bench", *worker)
        warm = fire.apply_async((run + "-warm", int((time.time() + 1.5) * 1000)), countdown=1.5)
        wait_for(lambda: client.hlen(f"demo:{run}-warm:runs"), 60, "the warm-up task")
        job = progress.add_task(f"{path}: {rate}/s for {duration:.0f} s", total=n)
        started = time.monotonic()
        first_due = int((time.time() + 2) * 1000)
        for i in range(n):
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
            due_ms = int((time.time() + 2) * 1000)
            fire.apply_async((run, due_ms, seconds), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
            progress.advance(job)
        wait_fired(client, run, n, progress, f"{path}: run {n}", timeout=120)
        ended = {}
        if seconds:
            began = client.hlen(f"demo:{run}:runs")
            wait_for(lambda: client.llen(f"demo:{run}:done") >= began, 60 + seconds, "the tasks begun to end")
            span = (max(int(x) for x in client.lrange(f"demo:{run}:done", 0, -1)) - first_due) / 1000
            ended = {"seconds_each": seconds, "ended_per_s": began / span, "span_s": span}
        lags = lags_of(client, run)
        return {"path": path, "rate": rate, "tasks": n, "achieved_rate": n / (time.monotonic() - started),
                "lag_ms": summary(lags), "hops_ms": hops_of(client, run) if path == "kafka" else None,
                "points": [(i / rate, x) for i, x in enumerate(lags)], "warm": warm.id, **ended}
    finally:
        procs.stop_all()
        client.delete(*(f"demo:{name}:{what}" for name in (run, f"{run}-warm")
                        for what in ("runs", "lag", "hops", "done")))
        _remove(overrides)


def profile(name: str, n: int, rate: int, duration: float, repeat: int, pool: str, progress: Progress,
            logdir: Path) -> dict[str, Any]:
    """Both paths' throughput and lag, quiet or (``load``) beside a CPU hog running all along.

    The lag runs alternate between the paths ``repeat`` times, so a slow minute of the machine
    hits both; the ratio compares the median p99 of each path's runs."""
    hog = cpu_hog(3600) if name == "load" else None
    try:
        rates = [throughput(path, n, pool, progress, logdir) for path in ("broker", "kafka")]
        runs = [lag(path, rate, duration, POOLS[pool], progress, logdir) for _ in range(repeat)
                for path in ("broker", "kafka")]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    p99 = {path: statistics.median(r["lag_ms"]["p99"] for r in runs if r["path"] == path)
           for path in ("broker", "kafka")}
    return {"profile": name, "pool": pool, "throughput": rates, "lag": runs[-2:], "lag_runs": runs,
            "lag_p99_median_ms": p99,
            "throughput_ratio": rates[1]["per_s"] / rates[0]["per_s"],
            "apply_async_ratio": rates[1]["apply_async_ms"] / rates[0]["apply_async_ms"],
            "lag_p99_ratio": p99["kafka"] / max(p99["broker"], 1)}


def io(rate: int, duration: float, seconds: float, repeat: int, pool: str, progress: Progress,
       logdir: Path) -> dict[str, Any]:
    """The I/O-bound load on a worker of ``IO_CONCURRENCY``: ``rate`` tasks due a second, each waiting
    ``seconds``; tasks ended per second and lag on both paths, alternating ``repeat`` times."""
    worker = ("--pool", pool, "-c", IO_CONCURRENCY)
    runs = [lag(path, rate, duration, worker, progress, logdir, seconds) for _ in range(repeat)
            for path in ("broker", "kafka")]
    per_s = {path: statistics.median(r["ended_per_s"] for r in runs if r["path"] == path)
             for path in ("broker", "kafka")}
    p99 = {path: statistics.median(r["lag_ms"]["p99"] for r in runs if r["path"] == path)
           for path in ("broker", "kafka")}
    return {"profile": "io", "pool": pool, "lag": runs[-2:], "lag_runs": runs, "ended_per_s_median": per_s,
            "lag_p99_median_ms": p99, "throughput_ratio": per_s["kafka"] / per_s["broker"],
            "lag_p99_ratio": p99["kafka"] / max(p99["broker"], 1)}


def _table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    """Print one table and return it as Markdown lines."""
    table = Table(*head, title=title)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return [f"### {title}", "", _markdown(head, rows), ""]


def report(result: dict[str, Any], n: int, rate: int, duration: float) -> list[str]:
    """Print one profile's tables (both paths side by side, then the Kafka path's hops) and its
    ratios; return them as Markdown lines."""
    each = {path: ", ".join(f"{r['lag_ms']['p99']:.0f}" for r in result["lag_runs"] if r["path"] == path)
            for path in ("broker", "kafka")}
    worker = " ".join(POOLS[result["pool"]] if result["profile"] != "io" else ("--pool", result["pool"], "-c",
                                                                               IO_CONCURRENCY))
    if result["profile"] == "io":
        seconds = result["lag_runs"][0]["seconds_each"]
        lines = _table(f"io, worker {worker}: {rate} tasks due a second for {duration:.0f} s, each waiting "
                       f"{seconds:g} s", ["run", "path", "tasks", "ended/s", "lag p50", "lag p99", "lag max", "lost"],
                       [[str(i // 2 + 1), r["path"], str(r["tasks"]), f"{r['ended_per_s']:.1f}",
                         f"{r['lag_ms']['p50']:.0f} ms", f"{r['lag_ms']['p99']:.0f} ms", f"{r['lag_ms']['max']:.0f} ms",
                         str(r["tasks"] - r["lag_ms"]["count"])] for i, r in enumerate(result["lag_runs"])])
        per_s = result["ended_per_s_median"]
        ratios = (f"io: tasks ended/s kafka/broker = {result['throughput_ratio']:.3f} (median {per_s['kafka']:.1f} / "
                  f"{per_s['broker']:.1f}); lag p99 kafka/broker = {result['lag_p99_ratio']:.2f} (median of "
                  f"{each['kafka']} ms / of {each['broker']} ms)")
    else:
        rows = [[t["path"], f"{t['per_s']:.0f}", f"{t['apply_async_ms']:.2f}", f"{s['p50']:.0f} ms",
                 f"{s['p99']:.0f} ms", f"{s['max']:.0f} ms", str(l["tasks"] - s["count"])]
                for t, l in zip(result["throughput"], result["lag"]) for s in [l["lag_ms"]]]
        lines = _table(f"{result['profile']}, worker {worker}: {n} tasks; lag at {rate}/s for {duration:.0f} s",
                       ["path", "tasks/s (1 worker)", "apply_async (ms/call)", "lag p50", "lag p99", "lag max",
                        "lost"], rows)
        ratios = (f"{result['profile']}: throughput kafka/broker = {result['throughput_ratio']:.2f}; apply_async "
                  f"with an ETA (store) / without (broker) = {result['apply_async_ratio']:.2f}; lag p99 "
                  f"kafka/broker = {result['lag_p99_ratio']:.2f} (median of {each['kafka']} ms / of "
                  f"{each['broker']} ms; the tables show the last run)")
    lines += _table(f"{result['profile']}: where the lag goes", ["hop (kafka path)", "p50", "p99", "max"],
                    [[name, f"{s['p50']:.0f} ms", f"{s['p99']:.0f} ms", f"{s['max']:.0f} ms"]
                     for name, s in result["lag"][1]["hops_ms"].items()])
    console.print(ratios)
    return [*lines, ratios, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small counts, for CI")
    parser.add_argument("--load", action="store_true", help="measure beside a busy neighbour too (one core spun)")
    parser.add_argument("--tasks", type=int, help="tasks per throughput run (default 3000; quick 500)")
    parser.add_argument("--rate", type=int, help="tasks/s for the lag runs (default 100; quick 50)")
    parser.add_argument("--duration", type=float, help="seconds of the lag runs (default 20; quick 6)")
    parser.add_argument("--repeat", type=int, default=1, help="lag runs per path, alternating (default 1)")
    parser.add_argument("--pool", choices=sorted(POOLS), help="the worker's pool, the same for both paths "
                        "(default prefork -c 2, threads -c 2, solo; green: -c 50; --io: gevent -c 200)")
    parser.add_argument("--io", type=float, nargs="?", const=1.0, metavar="SECONDS",
                        help=f"only the I/O-bound load: each task waits SECONDS (default 1), on a worker of "
                             f"-c {IO_CONCURRENCY}; throughput = tasks ended/s")
    opts = parser.parse_args(argv)
    pool = opts.pool or ("gevent" if opts.io else "prefork")
    n = opts.tasks or (500 if opts.quick else 3000)
    rate = opts.rate or (50 if opts.quick else 100)
    duration = opts.duration or (6.0 if opts.quick else 20.0)

    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"e2e-{'io-' if opts.io else ''}{pool}"
    logdir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    ran_on = versions()
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in ran_on.items()))
    with Progress(console=console) as progress:
        if opts.io:
            results = [io(rate, duration, opts.io, opts.repeat, pool, progress, logdir)]
        else:
            results = [profile(profile_name, n, rate, duration, opts.repeat, pool, progress, logdir)
                       for profile_name in (("quiet", "load") if opts.load else ("quiet",))]
    lines = [f"## python -m bench.e2e {' '.join(argv if argv is not None else sys.argv[1:])}", ""]
    for result in results:
        lines += report(result, n, rate, duration)
    lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in ran_on.items()))
    base = RESULTS / f"{name}-{stamp}"
    plot_lags({f"{r['profile']}: {l['path']} ({l['rate']}/s)": l["points"] for r in results for l in r["lag"]},
              base.with_suffix(".png"),
              f"due time -> task started, one {pool} worker: celery-delayed (kafka) vs Celery ETA (broker)",
              lag_label="task started - due time")
    for r in results:
        for l in r["lag_runs"]:
            l.pop("points", None)
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    base.with_suffix(".json").write_text(json.dumps({"versions": ran_on, "profiles": results, "argv": argv,
                                                     "logs": str(logdir)}, indent=2))
    if not opts.quick:
        for suffix in (".md", ".json", ".png"):
            shutil.copyfile(base.with_suffix(suffix), RESULTS / f"{name}-latest{suffix}")
    console.print(f"results: {base}.md, .json, .png; logs in {logdir}")
    return 0


if __name__ == "__main__":
    with exclusive("bench.e2e"):
        raise SystemExit(main())
