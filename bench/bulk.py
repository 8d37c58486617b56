"""Bulk scheduling: ``apply_many`` against ``schedule_many`` of prebuilt messages (the floor), in one run.

Every path schedules ``tasks.demo.add(i, i)`` of the demo app (its settings:
Redis result backend, task-sent events on) with countdowns spread over a day,
on a fresh key prefix that is removed afterwards:

- ``schedule_many``: the store's own bulk write of messages built beforehand
  (what ``apply_many`` would store for them): the floor; and the same with each
  item's queue given, as ``apply_many`` gives it (the store then does not inflate
  each message to read it);
- ``apply_many per task``: each signature through ``apply_async`` (the path
  before templates, kept as ``apply_many(..., per_task=True)``);
- ``apply_many``: tasks made from their shape's template (``results=False``: the
  client holds no result per task);
- ``apply_many, before_task_publish receiver``: the same with a receiver
  connected, which sends every task by the per-task path.

Reported per path: tasks/s, the client's CPU time per task (all its threads:
steadier than tasks/s on a busy machine; the floor's excludes Redis' own work),
the client's peak RSS growth, and the ratios
``apply_many`` / floor (goal >= 0.8) and ``apply_many`` / per task; the 10M time at
``apply_many``'s rate (goal <= 180 s, >= 55k/s); and how many tasks made from a
template were checked equal, field by field, to the per-task path's stored task
of the same signature.  The machine is shared: read the ratios of one run.

The paths run in ``--rounds`` interleaved rounds (each a share of the tasks), so
each sees the machine's load of the same minutes.

``python -m bench.bulk [--quick] [--tasks N] [--per-task N] [--rounds 3] [--only-per-task]``
Results (JSON, markdown, PNG of tasks stored over time) go to ``bench/results/``;
a full run also as ``bulk-latest.*``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from celery.signals import before_task_publish
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from celery_delayed import apply_many, store_of
from celery_delayed.envelope import Envelope
from celery_delayed.sandbox import installed

from .common import RESULTS, exclusive, versions
from .dispatch import git_state

console = Console(width=None if Console().is_terminal else 150)
#: Countdowns are spread uniformly over this many seconds, from an hour from now.
SPREAD_S = 86_400
#: Sent signatures between two samples of the rate.
SAMPLE_EVERY = 10_000
GOAL_FLOOR_RATIO = 0.8
#: The floor with each item's queue given (as apply_many gives it): the store does not read it from the message.
FLOOR_QUEUED = "schedule_many (floor), queue given"
GOAL_SECONDS_10M = 180


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Tasks stored against seconds elapsed (the rate and its plot), and the client's peak RSS."""

    def __init__(self, progress: Progress, description: str, total: int) -> None:
        self.progress, self.bar = progress, progress.add_task(description, total=total)
        self.rss = self.peak = rss_bytes()
        self.started, self.done = time.perf_counter(), 0
        self.cpu = time.process_time()
        self.samples: list[tuple[int, float]] = [(0, 0.0)]

    def restart(self) -> None:
        """Time from now on."""
        self.started, self.cpu = time.perf_counter(), time.process_time()

    def __call__(self, done: int) -> None:
        self.progress.update(self.bar, completed=done)
        self.done = done
        if done - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((done, time.perf_counter() - self.started))
            self.peak = max(self.peak, rss_bytes())

    def result(self) -> dict[str, Any]:
        seconds, cpu = time.perf_counter() - self.started, time.process_time() - self.cpu
        self.samples.append((self.done, seconds))
        self.peak = max(self.peak, rss_bytes())
        return {"tasks": self.done, "seconds": round(seconds, 2), "per_s": round(self.done / seconds),
                "cpu_s": round(cpu, 2), "cpu_us_per_task": round(cpu / self.done * 1e6, 1),
                "peak_rss_growth_mb": round((self.peak - self.rss) / 2**20, 1), "samples": self.samples}


def measure(path: str, n: int, send: Callable[[Sampler], None], progress: Progress) -> dict[str, Any]:
    """Run one path's ``send`` on ``n`` tasks: its rate and the client's peak RSS growth."""
    gc.collect()
    sampler = Sampler(progress, f"{path} {n:,}", n)
    send(sampler)
    return {"path": path, **sampler.result()}


def same_but_ids(envelope: Envelope) -> tuple:
    """What a worker receives of a stored task, its own id written ``ID``."""
    def unid(value: Any) -> Any:
        return value.replace(envelope.task_id, "ID") if isinstance(value, str) else value
    return ({k: unid(v) for k, v in envelope.headers.items()}, {k: unid(v) for k, v in envelope.properties.items()},
            envelope.body, envelope.queue, envelope.content_type, envelope.content_encoding, envelope.exchange,
            envelope.routing_key)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from tasks import create_app

    app = create_app()
    add = app.tasks["tasks.demo.add"]
    rng = random.Random(1)
    countdowns = [3600 + rng.random() * SPREAD_S for _ in range(max(opts.tasks, opts.per_task))]

    def signatures(n: int) -> Iterator:
        return (add.s(i, i).set(countdown=countdowns[i]) for i in range(n))

    made_ids: list[str] = []
    per_task_ids: list[str] = []
    tasks, few = opts.tasks // opts.rounds, opts.per_task // opts.rounds

    def bulk(sampler: Sampler) -> None:
        apply_many(signatures(tasks), app=app, progress=sampler, results=False)

    def per_task(sampler: Sampler) -> None:
        per_task_ids.extend(apply_many(signatures(few), app=app, progress=sampler, per_task=True).ids)

    def receiver_connected(sampler: Sampler) -> None:
        def noop(**_: Any) -> None:
            """A receiver that could change each message: every task takes the per-task path."""
        before_task_publish.connect(noop, weak=False)
        try:
            apply_many(signatures(few), app=app, progress=sampler, results=False)
        finally:
            before_task_publish.disconnect(noop)

    rounds: list[dict[str, Any]] = []
    with installed(app):
        store = store_of(app)
        add.apply_async((0, 0), countdown=3600)  # connections, layout check, scripts loaded
        message = store.message(add.apply_async((1, 1), countdown=3600).id)  # what apply_many stores for one

        queue = Envelope.decode(message).queue

        def floor(sampler: Sampler, queued: bool = False) -> None:
            now_ms = int(time.time() * 1000)
            items = [(str(uuid.uuid4()), now_ms + int(countdowns[i] * 1000), message, *([queue] if queued else []))
                     for i in range(tasks)]
            sampler.restart()  # the messages are prebuilt: only their writing is timed
            store.schedule_many(items, progress=_adding(sampler))

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            for n in range(opts.rounds):  # interleaved: each path sees the machine's load of the same minutes
                rounds.append(measure(f"apply_many per task #{n + 1}", few, per_task, progress))
                if not opts.only_per_task:
                    rounds.append(measure(f"schedule_many (floor) #{n + 1}", tasks, floor, progress))
                    rounds.append(measure(f"{FLOOR_QUEUED} #{n + 1}", tasks, lambda s: floor(s, queued=True),
                                          progress))
                    rounds.append(measure(f"apply_many #{n + 1}", tasks, bulk, progress))
                    rounds.append(measure(f"apply_many, before_task_publish receiver #{n + 1}", few,
                                          receiver_connected, progress))
        made_ids.extend(apply_many(signatures(few), app=app).ids)  # the same signatures, to compare
        checked = sum(same_but_ids(Envelope.decode(store.message(a))) == same_but_ids(Envelope.decode(store.message(b)))
                      for a, b in zip(per_task_ids[1:few], made_ids[1:]))  # the first of each: a template's own
        stored = sum(p["scheduled"] for p in store.counts())
    paths = [_merged([r for r in rounds if r["path"].rsplit(" #", 1)[0] == name])
             for name in dict.fromkeys(r["path"].rsplit(" #", 1)[0] for r in rounds)]
    expected = 2 + sum(p["tasks"] for p in paths) + len(made_ids)
    rates = {p["path"]: p["per_s"] for p in paths}
    result: dict[str, Any] = {"paths": paths, "stored": stored, "expected": expected,
                              "checked_equal": checked, "checked": min(few, len(made_ids)) - 1}
    if "apply_many" in rates:
        made = rates["apply_many"]
        result.update(floor_ratio=round(made / rates["schedule_many (floor)"], 2),
                      queued_floor_ratio=round(made / rates[FLOOR_QUEUED], 2),
                      per_task_ratio=round(made / rates["apply_many per task"], 1),
                      seconds_10m=round(10_000_000 / made),
                      goals={f"apply_many >= {GOAL_FLOOR_RATIO}x schedule_many":
                             made >= GOAL_FLOOR_RATIO * rates["schedule_many (floor)"],
                             f"10M in <= {GOAL_SECONDS_10M} s": 10_000_000 / made <= GOAL_SECONDS_10M})
    return result


def _merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's rounds as one measurement: its tasks over its seconds, its samples end to end."""
    samples: list[tuple[int, float]] = []
    done, seconds = 0, 0.0
    for r in rounds:
        samples += [(done + n, seconds + s) for n, s in r["samples"]]
        done, seconds = done + r["tasks"], seconds + r["seconds"]
    cpu = sum(r["cpu_s"] for r in rounds)
    return {"path": rounds[0]["path"].rsplit(" #", 1)[0], "tasks": done, "seconds": round(seconds, 2),
            "per_s": round(done / seconds), "cpu_s": round(cpu, 2), "cpu_us_per_task": round(cpu / done * 1e6, 1),
            "peak_rss_growth_mb": max(r["peak_rss_growth_mb"] for r in rounds),
            "samples": samples}


def _adding(sampler: Sampler) -> Callable[[int], None]:
    """``schedule_many``'s progress (tasks per batch) as a running total."""
    done = [0]

    def add(n: int) -> None:
        done[0] += n
        sampler(done[0])
    return add


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for p in result["paths"]:
        ax.plot([s for _, s in p["samples"]], [n for n, _ in p["samples"]], label=f"{p['path']}: {p['per_s']:,}/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tasks stored")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"celery-delayed bulk scheduling: apply_many / schedule_many = {result.get('floor_ratio')}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(result: dict[str, Any]) -> str:
    """Print the results; return them as markdown."""
    head = ["path", "tasks", "seconds", "tasks/s", "client CPU per task", "client peak RSS growth"]
    rows = [[p["path"], f"{p['tasks']:,}", str(p["seconds"]), f"{p['per_s']:,}", f"{p['cpu_us_per_task']} µs",
             f"{p['peak_rss_growth_mb']} MB"]
            for p in result["paths"]]
    table = Table(*head, title="bulk scheduling (one client process, demo app)")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    summary = (f"apply_many / schedule_many = {result.get('floor_ratio')}x (goal >= {GOAL_FLOOR_RATIO}), "
               f"/ {FLOOR_QUEUED} = {result.get('queued_floor_ratio')}x; "
               f"apply_many / per task = {result.get('per_task_ratio')}x; 10M at apply_many's rate: "
               f"{result.get('seconds_10m')} s (goal <= {GOAL_SECONDS_10M}); made from a template and checked "
               f"equal to the per-task path's: {result['checked_equal']:,} of {result['checked']:,}; "
               f"stored {result['stored']:,} of {result['expected']:,}")
    console.print(summary)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + f"\n\n{summary}\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI profile: 100k tasks, 5k per task (minutes)")
    parser.add_argument("--tasks", type=int, help="tasks for apply_many and schedule_many (default 1000000)")
    parser.add_argument("--per-task", type=int, help="tasks for the per-task path (default 50000)")
    parser.add_argument("--only-per-task", action="store_true", help="measure the per-task path alone")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the paths, interleaved (default 3)")
    opts = parser.parse_args(argv)
    opts.tasks = opts.tasks or (100_000 if opts.quick else 1_000_000)
    opts.per_task = opts.per_task or (5_000 if opts.quick else 50_000)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    with exclusive("bench.bulk"):
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        context = {"git": git_state(), "loadavg_start": os.getloadavg(), "argv": sys.argv}
        result = run(opts)
        context["loadavg_end"] = os.getloadavg()
    table = report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"bulk-{stamp}{'-quick' if opts.quick else ''}"
    plot(result, base.with_suffix(".png"))
    base.with_suffix(".md").write_text(f"# bench.bulk {' '.join(sys.argv[1:])}\n\n"
                                       f"versions: {', '.join(f'{k} {v}' for k, v in versions().items())}; "
                                       f"load average {context['loadavg_start']} -> {context['loadavg_end']}\n\n"
                                       + table)
    base.with_suffix(".json").write_text(json.dumps({"started": stamp, "context": context, "versions": versions(),
                                                     **result}, indent=2))
    if not opts.quick:
        for suffix in (".md", ".json", ".png"):
            shutil.copyfile(base.with_suffix(suffix), RESULTS / f"bulk-latest{suffix}")
    console.print(f"goals: {result.get('goals')}\nwrote {base}.md, .json, .png")
    return 0 if result["stored"] == result["expected"] and result["checked_equal"] == result["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
