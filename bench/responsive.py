"""Where another Redis client's wait comes from while the store dispatches (issue 29's PING goal).

``bench.dispatch`` and ``bench.burst`` measure another client's PING round trips while pollers
dispatch, with Redis, Kafka, the pollers and the workers sharing the machine's cores.  That wait
has two causes, measured here apart, each against PING alone in the same run:

1. **CPU alone**: PING beside one, then two, cores spun by busy processes (a busy machine, no
   Redis work at all);
2. **Redis work alone**: PING beside claims of ``delayed_claim_batch`` tasks sent back to back by
   one client (Redis as busy with claims as it can be, nothing else on the CPU), with the time of
   one claim's script (``INFO commandstats``: no other client is served while it runs) and the CPU
   of Redis' main thread per claim (``INFO cpu``: every command of a claim and its I/O).

``python -m bench.responsive [--quick] [--tasks N] [--seconds S] [--batch N]``
Results (JSON, PNG of each condition's PING distribution) go to ``bench/results/``.
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from celery_delayed.sandbox import unlink_prefix
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore

from .common import RESULTS, PingProbe, cpu_hog, exclusive, new_overrides, save_figure, versions
from .dispatch import capture_template, envelope_bytes, git_state

console = Console(width=None if Console().is_terminal else 150)


def pings(url: str, seconds: float, beside: Callable[[], Any] | None = None) -> tuple[dict, list[float], Any]:
    """PING round trips for ``seconds`` (or while ``beside()`` runs): their summary, the samples, and what
    ``beside`` returned."""
    probe = PingProbe(url)
    probe.start()
    found = beside() if beside else time.sleep(seconds)
    stats = probe.stop()
    return stats, probe.samples, found


def spun(url: str, cores: int, seconds: float) -> tuple[dict, list[float], Any]:
    """PING while ``cores`` busy processes spin."""
    hogs = [cpu_hog(seconds + 5) for _ in range(cores)]
    try:
        time.sleep(0.5)  # spinning
        return pings(url, seconds)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def claims(store: DelayedStore, tasks: int, progress: Callable[[str], None]) -> Callable[[], dict[str, float]]:
    """Store ``tasks`` due tasks (Celery's real message); returns the run that claims them all, partition
    by partition, back to back, and reports the Redis time per claim."""
    template, queue = capture_template(store.settings.partitions), "responsive"
    due = int(time.time() * 1000) - 60_000
    progress(f"storing {tasks:,} due tasks")
    store.schedule_many((f"t-{i}", due + i % 60_000, envelope_bytes(template, queue, f"t-{i}", due + i % 60_000))
                        for i in range(tasks))

    def run() -> dict[str, float]:
        script, cpu = _script_stats(store), _main_thread_cpu(store)
        started, claimed, batch = time.perf_counter(), 0, store.settings.claim_batch
        for partition in range(store.settings.partitions):
            while got := len(store.claim(partition, 1, batch).items):
                claimed += got
        wall = time.perf_counter() - started
        calls, usec = (now - before for now, before in zip(_script_stats(store), script))
        busy = _main_thread_cpu(store) - cpu
        return {"claims": calls, "claimed": claimed, "wall_s": wall, "script_us": usec / max(calls, 1),
                "claim_us": busy * 1e6 / max(calls, 1), "redis_busy": busy / wall}
    return run


def _script_stats(store: DelayedStore) -> tuple[int, int]:
    """Scripts run and their µs in all (``INFO commandstats``): a script blocks every other client."""
    stats = store.redis.info("commandstats").get("cmdstat_evalsha", {})
    return stats.get("calls", 0), stats.get("usec", 0)


def _main_thread_cpu(store: DelayedStore) -> float:
    """CPU seconds of Redis' main thread, the one that serves every client: commands and their I/O."""
    cpu = store.redis.info("cpu")
    return cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]


def plot(samples: dict[str, list[float]], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, values in samples.items():
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("PING round trip (ms)")
    ax.set_ylabel("fraction of PINGs")
    ax.set_title("Another Redis client's PING: CPU load alone vs claims alone")
    save_figure(fig, [ax], path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responsive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small profile: 100k tasks, 4 s per condition")
    parser.add_argument("--tasks", type=int, default=None, help="due tasks claimed back to back (default 400000)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds of each CPU condition (default 15)")
    parser.add_argument("--batch", type=int, default=None, help="tasks per claim (default: delayed_claim_batch's)")
    opts = parser.parse_args(argv)
    tasks = opts.tasks or (100_000 if opts.quick else 400_000)
    seconds = opts.seconds or (4.0 if opts.quick else 15.0)
    with exclusive("bench.responsive"):
        found = versions()
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        overrides = new_overrides(partitions=8)
        if opts.batch:
            overrides["delayed_claim_batch"] = opts.batch
        settings = Settings.from_conf(overrides)
        store = DelayedStore(settings)
        url = settings.redis_url
        rows: dict[str, dict] = {}
        samples: dict[str, list[float]] = {}
        try:
            for label, measure in (("PING alone", lambda: pings(url, seconds)),
                                   ("beside 1 core spun", lambda: spun(url, 1, seconds)),
                                   ("beside 2 cores spun", lambda: spun(url, 2, seconds))):
                console.print(f"{label} ({seconds:g} s)")
                rows[label], samples[label], _ = measure()
            run = claims(store, tasks, console.print)
            label = "beside claims back to back"
            console.print(label)
            rows[label], samples[label], rows[label]["claims"] = pings(url, 0, run)
        finally:
            unlink_prefix(store.redis, settings.key_prefix)
        table = Table(title=f"Another client's PING (ms), {settings.claim_batch} tasks per claim")
        for column in ("condition", "PINGs", "p50", "p90", "p99", "max", "script per claim", "Redis CPU per claim",
                       "Redis busy"):
            table.add_column(column, justify="left" if column == "condition" else "right")
        for label, row in rows.items():
            c = row.get("claims")
            table.add_row(label, f"{row['count']:,}", *(f"{row[k]:.2f}" for k in ("p50", "p90", "p99", "max")),
                          f"{c['script_us']:,.0f} µs" if c else "—",
                          f"{c['claim_us']:,.0f} µs ({c['claims']:,} claims)" if c else "—",
                          f"{c['redis_busy']:.0%}" if c else "—")
        console.print(table)
        base = RESULTS / f"responsive-{datetime.now():%Y%m%d-%H%M%S}{'-quick' if opts.quick else ''}"
        base.with_suffix(".json").write_text(json.dumps({"versions": found, "git": git_state(), "tasks": tasks,
                                                         "seconds": seconds, "claim_batch": settings.claim_batch,
                                                         "results": rows}, indent=1))
        plot(samples, base.with_suffix(".png"))
        console.print(f"results: {base}.json, .png")
        claimed = rows["beside claims back to back"]["claims"]["claimed"]
        if claimed != tasks:
            console.print(f"[red]claimed {claimed:,} of {tasks:,} due tasks")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
