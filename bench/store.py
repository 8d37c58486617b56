"""Store benchmark: bulk scheduling into the real Redis, insert rate and memory per task.

For each size N (1M and 10M; ``--quick``: 200k) the real message Celery builds
for ``tasks.demo.add(2, 2)`` is cloned N times with fresh task ids and due times
spread over a day (``--spread-hours``), encoded exactly as the client stores it
(compact, deflated when at least ``delayed_compress_min_bytes``) by a pool of
processes, then stored by one client process with one ``DelayedStore.schedule_many``
call.
Reported: tasks/s of that call, Redis memory per task (``used_memory`` delta / N)
and what of it lies beyond the stored message and beyond Celery's body.  The
keys are UNLINKed right after each size is measured.

``python -m bench.store [--quick] [--tasks 1000000,10000000] [--partitions 16] [--spread-hours 24]``
Results (JSON and a PNG of memory and insert rate against tasks stored) go to
``bench/results/``.  Refuses to start while another ``bench.*`` process runs.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from celery_delayed.envelope import Envelope, deflate
from celery_delayed.sandbox import unlink_prefix
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore

from .common import RESULTS, exclusive, new_overrides
from .dispatch import capture_template, envelope_bytes, git_state

console = Console(width=None if Console().is_terminal else 150)
#: Due times are spread uniformly over this many hours (``--spread-hours``), from an hour from now.
SPREAD_HOURS = 24.0
ENCODE_CHUNK = 50_000
#: Memory and time are sampled every this many stored tasks.
SAMPLE_EVERY = 100_000
GOAL_SECONDS_10M = 180
GOAL_BEYOND_BODY = 200


# -- messages ----------------------------------------------------------------------
def encode_chunk(job: tuple[Envelope, str, int, int, int, int, int]) -> list[tuple[str, int, bytes]]:
    """``count`` stored items cloned from ``template`` (run in a pool process)."""
    template, queue, first_due_ms, spread_ms, count, seed, compress_min_bytes = job
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        task_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        due_ms = first_due_ms + rng.randrange(spread_ms)
        items.append((task_id, due_ms, deflate(envelope_bytes(template, queue, task_id, due_ms), compress_min_bytes)))
    return items


def encode(template: Envelope, queue: str, n: int, spread_hours: float, compress_min_bytes: int,
           progress: Progress) -> tuple[list[tuple[str, int, bytes]], float]:
    """``n`` items encoded by a process pool, and the seconds it took."""
    first_due = int(time.time() * 1000) + 3_600_000
    spread_ms = int(spread_hours * 3_600_000)
    jobs = [(template, queue, first_due, spread_ms, min(ENCODE_CHUNK, n - start), start, compress_min_bytes)
            for start in range(0, n, ENCODE_CHUNK)]
    bar = progress.add_task(f"encode {n:,}", total=n)
    items: list[tuple[str, int, bytes]] = []
    started = time.perf_counter()
    with mp.get_context("fork").Pool(os.cpu_count() or 2) as pool:
        for chunk in pool.imap(encode_chunk, jobs):
            items.extend(chunk)
            progress.advance(bar, len(chunk))
    return items, time.perf_counter() - started


# -- one size ------------------------------------------------------------------------
def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def wait_for_lazyfree(client: redis.Redis, timeout: float = 300.0) -> None:
    """Wait until Redis has freed what UNLINK handed to its background thread."""
    deadline = time.monotonic() + timeout
    while client.info("memory").get("lazyfree_pending_objects", 0) and time.monotonic() < deadline:
        time.sleep(0.5)


def measure(template: Envelope, n: int, partitions: int, spread_hours: float, progress: Progress) -> dict[str, Any]:
    """Encode and store ``n`` tasks in a fresh key prefix; rate, memory, then UNLINK everything."""
    overrides = new_overrides(partitions)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    items, encode_s = encode(template, overrides["task_default_queue"], n, spread_hours, settings.compress_min_bytes,
                             progress)
    stored_bytes = sum(len(data) for _, _, data in items) / n
    wait_for_lazyfree(store.redis)
    before = used_memory(store.redis)
    samples: list[dict[str, float]] = [{"tasks": 0, "seconds": 0.0, "memory": 0}]
    bar = progress.add_task(f"schedule_many {n:,}", total=n)
    done = [0]
    started = time.perf_counter()

    def on_progress(count: int) -> None:
        progress.advance(bar, count)
        done[0] += count
        if done[0] - samples[-1]["tasks"] >= SAMPLE_EVERY or done[0] == n:
            samples.append({"tasks": done[0], "seconds": time.perf_counter() - started,
                            "memory": used_memory(store.redis) - before})

    try:
        added = store.schedule_many(items, progress=on_progress)
        seconds = time.perf_counter() - started
        delta = used_memory(store.redis) - before
        counted = sum(r["scheduled"] for r in store.counts())
    finally:
        del items
        unlink_prefix(store.redis, settings.key_prefix)
        wait_for_lazyfree(store.redis)
    per_task = delta / n
    return {"tasks": n, "added": added, "counted": counted, "partitions": partitions, "spread_hours": spread_hours,
            "seconds": round(seconds, 2),
            "tasks_per_s": round(n / seconds), "encode_seconds": round(encode_s, 2),
            "used_memory_delta": delta, "bytes_per_task": round(per_task, 1),
            "stored_message_bytes": round(stored_bytes, 1), "celery_body_bytes": len(template.body),
            "celery_message_bytes": len(celery_message(template)),
            "beyond_stored_message": round(per_task - stored_bytes, 1),
            "beyond_celery_body": round(per_task - len(template.body), 1),
            "compress_min_bytes": settings.compress_min_bytes, "samples": samples}


def celery_message(template: Envelope) -> bytes:
    """The message as Celery built it, for comparison: every header and property as one JSON
    line, then the body (the store's first form, which dropped only a few empty headers)."""
    meta = {"id": template.task_id, "q": template.queue, "h": template.headers, "ct": template.content_type,
            "ce": template.content_encoding, "p": template.properties}
    return json.dumps(meta, separators=(",", ":")).encode() + b"\n" + template.body


# -- report ---------------------------------------------------------------------------
def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Memory per task and insert rate against tasks stored, one line per size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, rate) = plt.subplots(1, 2, figsize=(14, 4.8))
    for r in results:
        points = r["samples"][1:]
        label = f"{r['tasks']:,} tasks"
        memory.plot([p["tasks"] for p in points], [p["memory"] / p["tasks"] for p in points], label=label)
        rates = [(b["tasks"], (b["tasks"] - a["tasks"]) / max(b["seconds"] - a["seconds"], 1e-9))
                 for a, b in zip(r["samples"], r["samples"][1:])]
        rate.plot([t for t, _ in rates], [v for _, v in rates], label=label)
        memory.axhline(r["stored_message_bytes"], linestyle=":", color="grey")
    memory.set_ylabel("Redis used_memory per task (B)")
    rate.set_ylabel("schedule_many insert rate (tasks/s)")
    for ax in (memory, rate):
        ax.set_xlabel("tasks stored")
        ax.grid(alpha=0.3)
        ax.legend()
    memory.set_ylim(bottom=0)
    rate.set_ylim(bottom=0)
    fig.suptitle("celery-delayed store: memory per task (dotted: stored message) and insert rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(results: list[dict[str, Any]]) -> None:
    table = Table("tasks", "seconds", "tasks/s", "B/task", "stored msg B", "beyond msg", "beyond body",
                  "Celery msg B", title="store benchmark (one client process, schedule_many)")
    for r in results:
        table.add_row(f"{r['tasks']:,}", str(r["seconds"]), f"{r['tasks_per_s']:,}", str(r["bytes_per_task"]),
                      str(r["stored_message_bytes"]), str(r["beyond_stored_message"]),
                      str(r["beyond_celery_body"]), str(r["celery_message_bytes"]))
    console.print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI profile: 200k tasks")
    parser.add_argument("--tasks", help="comma-separated sizes (default 1000000,10000000)")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--spread-hours", type=float, default=SPREAD_HOURS,
                        help="due times spread over this many hours (default 24; denser buckets cost more memory)")
    opts = parser.parse_args(argv)
    opts.sizes = [int(s) for s in (opts.tasks or ("200000" if opts.quick else "1000000,10000000")).split(",")]
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    with exclusive("bench.store"):
        return run(opts)


def run(opts: argparse.Namespace) -> int:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    context: dict[str, Any] = {"git": git_state(), "loadavg_start": os.getloadavg(), "argv": sys.argv}
    template = capture_template(opts.partitions)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for n in opts.sizes:
            results.append(measure(template, n, opts.partitions, opts.spread_hours, progress))
    context["loadavg_end"] = os.getloadavg()
    report(results)
    goals = {f"{r['tasks']:,} tasks": {"10M in under 180 s at this rate": r["seconds"] * 10_000_000 / r["tasks"]
                                       < GOAL_SECONDS_10M,
                                       f"under {GOAL_BEYOND_BODY} B beyond the body": r["beyond_celery_body"]
                                       < GOAL_BEYOND_BODY} for r in results}
    picture = plot(results, RESULTS / f"store-{stamp}.png")
    path = RESULTS / f"store-{stamp}.json"
    path.write_text(json.dumps({"started": stamp, "context": context, "goals": goals, "results": results,
                                "plot": str(picture)}, indent=2))
    console.print(f"goals: {goals}\nwrote {path} and {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
