"""Bulk scheduling from signatures: ``apply_many`` against ``apply_async`` in a loop, in one run.

Both send ``tasks.demo.add(i, i)`` of the demo app (its settings: Redis result
backend, task-sent events on) with countdowns spread over a day, on a fresh key
prefix that is removed afterwards.  The loop calls ``apply_async`` ``--loop``
times (default 200k: its per-call cost does not change with the count, and 1M
calls take half an hour here); ``apply_many`` sends ``--signatures`` signatures
(default 1M).  Reported: signatures/s of each, their ratio (goal: >= 5), the 10M
time at ``apply_many``'s rate (goal: <= 180 s), the client's RSS growth and the
result backend's pub/sub channels left open by the returned results.

``python -m bench.bulk [--quick] [--signatures 1000000] [--loop 200000]``
Results (JSON, and a PNG of signatures sent over time) go to ``bench/results/``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from celery_delayed import apply_many, store_of
from celery_delayed.sandbox import installed

from .common import RESULTS, exclusive, versions
from .dispatch import git_state

console = Console(width=None if Console().is_terminal else 150)
#: Countdowns are spread uniformly over this many seconds, from an hour from now.
SPREAD_S = 86_400
#: Sent signatures between two samples of the rate.
SAMPLE_EVERY = 10_000
GOAL_RATIO = 5.0
GOAL_SECONDS_10M = 180


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Signatures sent against seconds elapsed, for the rate and its plot."""

    def __init__(self, progress: Progress, description: str, total: int) -> None:
        self.progress, self.bar = progress, progress.add_task(description, total=total)
        self.started, self.done = time.perf_counter(), 0
        self.samples: list[tuple[int, float]] = [(0, 0.0)]

    def __call__(self, done: int) -> None:
        self.progress.update(self.bar, completed=done)
        self.done = done
        if done - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((done, time.perf_counter() - self.started))

    def result(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self.started
        self.samples.append((self.done, seconds))
        return {"signatures": self.done, "seconds": round(seconds, 2), "per_s": round(self.done / seconds),
                "ms_per_signature": round(seconds / self.done * 1000, 4), "samples": self.samples}


def measure(path: str, n: int, send: Callable[[Sampler], None], progress: Progress) -> dict[str, Any]:
    """Run one path's ``send`` on ``n`` signatures; its rate and the client's RSS growth."""
    rss = rss_bytes()
    sampler = Sampler(progress, f"{path} {n:,}", n)
    send(sampler)
    return {"path": path, **sampler.result(), "rss_growth_mb": round((rss_bytes() - rss) / 2**20, 1)}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from tasks import create_app

    app = create_app()
    add = app.tasks["tasks.demo.add"]
    rng = random.Random(1)
    countdowns = [3600 + rng.random() * SPREAD_S for _ in range(max(opts.signatures, opts.loop))]

    def loop(sampler: Sampler) -> None:
        for i in range(opts.loop):
            add.apply_async((i, i), countdown=countdowns[i])
            if (i + 1) % 1000 == 0 or i + 1 == opts.loop:
                sampler(i + 1)

    def bulk(sampler: Sampler) -> None:
        results.extend(apply_many((add.s(i, i).set(countdown=countdowns[i]) for i in range(opts.signatures)),
                                  app=app, progress=sampler))

    results: list = []  # held until the channels are counted, as a caller holds them
    with installed(app):
        add.apply_async((0, 0), countdown=3600)  # connections, layout check, scripts loaded
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            looped = measure("apply_async loop", opts.loop, loop, progress)
            channels_before = app.backend.client.info("stats").get("pubsub_channels", 0)
            bulked = measure("apply_many", opts.signatures, bulk, progress)
            bulked["pubsub_channels_open"] = app.backend.client.info("stats").get("pubsub_channels", 0) \
                - channels_before
        stored = sum(p["scheduled"] for p in store_of(app).counts())
    expected = 1 + opts.loop + opts.signatures
    ratio = bulked["per_s"] / looped["per_s"]
    return {"paths": [looped, bulked], "stored": stored, "expected": expected, "ratio": round(ratio, 2),
            "seconds_10m": round(10_000_000 / bulked["per_s"]),
            "goals": {f"apply_many >= {GOAL_RATIO}x the loop": ratio >= GOAL_RATIO,
                      f"10M in <= {GOAL_SECONDS_10M} s": 10_000_000 / bulked["per_s"] <= GOAL_SECONDS_10M}}


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for p in result["paths"]:
        ax.plot([s for _, s in p["samples"]], [n for n, _ in p["samples"]],
                label=f"{p['path']}: {p['per_s']:,}/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("signatures sent")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"celery-delayed bulk scheduling: apply_many / apply_async loop = {result['ratio']}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(result: dict[str, Any]) -> None:
    table = Table("path", "signatures", "seconds", "signatures/s", "ms each", "client RSS growth",
                  title="bulk scheduling (one client process, demo app)")
    for p in result["paths"]:
        table.add_row(p["path"], f"{p['signatures']:,}", str(p["seconds"]), f"{p['per_s']:,}",
                      str(p["ms_per_signature"]), f"{p['rss_growth_mb']} MB")
    console.print(table)
    console.print(f"apply_many / loop = {result['ratio']}x; 10M at apply_many's rate: {result['seconds_10m']} s; "
                  f"stored {result['stored']:,} of {result['expected']:,}; result pub/sub channels left open: "
                  f"{result['paths'][1]['pubsub_channels_open']:,}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI profile: 20k signatures, 10k loop calls")
    parser.add_argument("--signatures", type=int, help="signatures for apply_many (default 1000000)")
    parser.add_argument("--loop", type=int, help="apply_async calls in the loop (default 200000)")
    opts = parser.parse_args(argv)
    opts.signatures = opts.signatures or (20_000 if opts.quick else 1_000_000)
    opts.loop = opts.loop or (10_000 if opts.quick else 200_000)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    with exclusive("bench.bulk"):
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        context = {"git": git_state(), "loadavg_start": os.getloadavg(), "argv": sys.argv}
        result = run(opts)
        context["loadavg_end"] = os.getloadavg()
    report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    picture = plot(result, RESULTS / f"bulk-{stamp}.png")
    path = RESULTS / f"bulk-{stamp}.json"
    path.write_text(json.dumps({"started": stamp, "context": context, "versions": versions(), **result,
                                "plot": str(picture)}, indent=2))
    console.print(f"goals: {result['goals']}\nwrote {path} and {picture}")
    return 0 if result["stored"] == result["expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
