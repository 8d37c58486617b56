"""Recurring schedules' hot paths in the poller, measured alone against the store's Redis (no Kafka, no
worker): how many occurrences a poller advances a second, and how long a poller's start (its
``beat_schedule`` sync) takes over N schedules that need nothing.

1. **Advance**: ``--occurrences`` schedules (an interval of an hour), their pending occurrences due now;
   claimed ``delayed_claim_batch`` at a time as a poller does, each claim's occurrences advanced (their
   successors written, the chain moved on: ``Definitions.advance_many``), then acked.  Occurrences/s =
   occurrences / the time spent advancing them.
2. **Start**: ``--schedules`` healthy schedules (not from ``beat_schedule``); the time of
   ``Definitions.sync({})``, what a poller does before it leads anything, and how many pending
   occurrences it wrote again.

The schedules are written straight into the store (their definitions and occurrences, in bulk), under
a key prefix of the run, removed at the end.

    python -m bench.recurring_advance [--occurrences N] [--schedules N] [--partitions P] [--baseline JSON]

On a checkout before ``advance_many`` (main before issue 43's batching), the occurrences are advanced one
at a time (``Definitions.advance``): run it there first, then here with ``--baseline`` its JSON, in one
sitting, for ratios.  Writes bench/results/recurring-advance-<time>.md, .json and .png (and
recurring-advance-latest.* copies).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from celery_delayed.client.schedules import template_of
from celery_delayed.envelope import Envelope
from celery_delayed.recurring.definitions import BEAT, Definition, Definitions
from celery_delayed.recurring.occurrences import occurrence
from celery_delayed.recurring.rules import Every, rule_data
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from tasks import create_app

from .common import RESULTS, new_overrides, save_figure, versions

console = Console(width=None if Console().is_terminal else 150)
HOUR_MS = 3_600_000


def write_schedules(store: DelayedStore, count: int, due_ms: int | None, progress: Progress) -> None:
    """``count`` schedules ``bench:<i>`` every hour from an hour ahead, written as ``Definitions.put``
    would (version 1), their pending occurrences due at ``due_ms`` (None: at their time)."""
    app = create_app()
    template = template_of(app, app.signature("recurring.noop", args=(0,)))
    anchor = store.now_ms() + HOUR_MS
    rule = rule_data(Every(HOUR_MS, anchor))
    task = progress.add_task("writing schedules", total=count)
    for start in range(0, count, 2000):
        pipe = store.redis.pipeline(transaction=False)
        items = []
        for i in range(start, min(start + 2000, count)):
            definition = Definition(f"bench:{i}", rule, template, "api", 1, anchor)
            pipe.hset(store.keys.recurring(store.partition(definition.schedule_id)), definition.schedule_id,
                      definition.encode())
            task_id, message = occurrence(Envelope.decode(template), definition.schedule_id, 1, anchor,
                                          store.settings.compress_min_bytes)
            items.append((task_id, anchor if due_ms is None else due_ms, message))
        store.execute(pipe)
        store.schedule_many(items, attempt=1)
        progress.advance(task, len(items))


def measure_advance(settings: Settings, count: int, progress: Progress) -> dict[str, Any]:
    store = DelayedStore(settings)
    definitions = Definitions(store)
    write_schedules(store, count, store.now_ms() - 1000, progress)
    task = progress.add_task("advancing", total=count)
    advanced, spent = 0, 0.0
    for partition in range(settings.partitions):
        while (claim := store.claim(partition, 1, settings.claim_batch)).items:
            began = time.perf_counter()
            advance = getattr(definitions, "advance_many", None)
            if advance is not None:
                advance([data for _, _, data in claim.items], claim.now_ms)
            else:
                for _, _, data in claim.items:
                    definitions.advance(data, claim.now_ms)
            spent += time.perf_counter() - began
            store.ack(partition, [(task_id, claim.stamp) for task_id, _, _ in claim.items])
            advanced += len(claim.items)
            progress.advance(task, len(claim.items))
    moved = sum(1 for d in definitions.all() if d.pending_ms is not None and d.pending_ms > d.rule["anchor_ms"])
    return {"occurrences": advanced, "seconds": spent, "per_s": advanced / spent, "chains_moved": moved}


def measure_start(settings: Settings, count: int, progress: Progress) -> dict[str, Any]:
    store = DelayedStore(settings)
    write_schedules(store, count, None, progress)
    written, pipelines = [0], store._schedule_pipelines

    def counted(items: Any, *args: Any, **kwargs: Any) -> Any:  # the tasks the start writes (again)
        items = list(items)
        written[0] += len(items)
        return pipelines(items, *args, **kwargs)

    store._schedule_pipelines = counted  # type: ignore[method-assign]
    began = time.perf_counter()
    Definitions(store).sync({}, BEAT)
    spent = time.perf_counter() - began
    return {"schedules": count, "seconds": spent, "occurrences_written": written[0]}


def report(results: dict[str, Any], baseline: dict[str, Any] | None, opts: argparse.Namespace,
           found: dict[str, str]) -> tuple[str, Table]:
    """The markdown report and the console's table: this run, and beside it the ``--baseline`` run's."""
    rows = [("occurrences advanced / s, one poller", results["advance"]["per_s"],
             baseline and baseline["advance"]["per_s"], "{:.0f}"),
            (f"poller start over {opts.schedules} schedules (s)", results["start"]["seconds"],
             baseline and baseline["start"]["seconds"], "{:.2f}"),
            ("occurrences that start wrote again", results["start"]["occurrences_written"],
             baseline and baseline["start"]["occurrences_written"], "{}")]
    table = Table("measure", "this run", "baseline", "this / baseline")
    lines = ["| measure | this run | baseline | this / baseline |", "|---|---|---|---|"]
    for name, value, before, form in rows:
        cells = [form.format(value), "" if before is None else form.format(before),
                 f"{value / before:.3g}" if before else ""]
        table.add_row(name, *cells)
        lines.append(f"| {name} | {' | '.join(cells)} |")
    head = [f"# Recurring schedules: a poller's advance and start ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
            "", f"`python -m bench.recurring_advance {' '.join(sys.argv[1:])}`", "",
            ", ".join(f"{k} {v}" for k, v in found.items()), "",
            f"{opts.occurrences} occurrences due, claimed {opts.partitions} partitions x claim batch; "
            f"{opts.schedules} healthy schedules synced.  Baseline: "
            + (opts.baseline.name if opts.baseline else "none"), ""]
    return "\n".join(head + lines) + "\n", table


def plot(results: dict[str, Any], baseline: dict[str, Any] | None, path: Path) -> Path:
    """Two bars per panel (baseline, this run): occurrences advanced a second, a start's seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, (name, key, label) in zip(axes, (("advance", "per_s", "occurrences advanced / s"),
                                             ("start", "seconds", "start over N schedules (s)"))):
        runs = [("baseline", baseline)] if baseline else []
        for i, (run, data) in enumerate([*runs, ("this run", results)]):
            ax.bar(i, data[name][key], label=run, color=f"C{i}")
        ax.set_ylabel(label)
        ax.set_xticks([])
    return save_figure(fig, axes, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--occurrences", type=int, default=5000)
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--baseline", type=Path, help="the JSON of an earlier run (say, of main) to compare with")
    opts = parser.parse_args(argv)
    found = versions()
    console.print(found)
    results: dict[str, Any] = {}
    for name, measure, count in (("advance", measure_advance, opts.occurrences),
                                 ("start", measure_start, opts.schedules)):
        settings = Settings.from_conf(new_overrides(opts.partitions))
        try:
            with Progress(console=console, transient=True) as progress:
                results[name] = measure(settings, count, progress)
        finally:
            remove_everything(settings, topics=[])
    baseline = json.loads(opts.baseline.read_text()) if opts.baseline else None
    markdown, table = report(results, baseline, opts, found)
    console.print(table)
    base = RESULTS / f"recurring-advance-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    base.with_suffix(".json").write_text(json.dumps({"versions": found, **results}, indent=1))
    base.with_suffix(".md").write_text(markdown + f"\n![plot]({base.name}.png)\n")
    plot(results, baseline, base.with_suffix(".png"))
    for suffix in (".json", ".png"):
        shutil.copyfile(base.with_suffix(suffix), RESULTS / f"recurring-advance-latest{suffix}")
    (RESULTS / "recurring-advance-latest.md").write_text(markdown + "\n![plot](recurring-advance-latest.png)\n")
    console.print(f"written: {base}.md, .json, .png (and recurring-advance-latest.*)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
