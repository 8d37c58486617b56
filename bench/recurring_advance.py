"""Recurring schedules' hot paths in the poller, measured alone against the store's Redis (no Kafka, no
worker): how many occurrences a poller advances a second, and how long a poller's start (its
``beat_schedule`` sync) takes over N schedules that need nothing.

1. **Advance**: ``--occurrences`` schedules (an interval of an hour), their pending occurrences due now;
   claimed ``delayed_claim_batch`` at a time as a poller does, each claim's occurrences advanced (their
   successors written, the chain moved on: ``Definitions.advance_many``), then acked.  Occurrences/s =
   occurrences / the time spent advancing them.
2. **Dispatch**: ``--dispatch`` schedules every minute (``crontab()``, UTC), their pending occurrences due at
   the last minute boundary (as at a boundary of bench.recurring, the chains' due time), and one poller
   (``Poller.run`` in this process: etcd leadership, the Kafka producer, every partition): occurrences/s =
   occurrences sent to run / the time from its start to the last one's delivery report.
3. **Start**: ``--schedules`` healthy schedules (not from ``beat_schedule``); the time of
   ``Definitions.sync({})``, what a poller does before it leads anything, and how many pending
   occurrences it wrote again.

The schedules are written straight into the store (their definitions and occurrences, in bulk), under
a key prefix of the run, removed at the end.

    python -m bench.recurring_advance [--occurrences N] [--dispatch N] [--schedules N] [--partitions P]
                                      [--baseline JSON]

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
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from celery.schedules import crontab
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from celery_delayed.client.schedules import template_of
from celery_delayed.envelope import Envelope
from celery_delayed.kafka import ensure_topics
from celery_delayed.poller.loop import Poller
from celery_delayed.recurring.definitions import BEAT, Definition, Definitions
from celery_delayed.recurring.occurrences import occurrence
from celery_delayed.recurring.rules import Every, Rule, rule_data, rule_of
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from tasks import create_app
from tasks.processes import wait_for

from .common import RESULTS, new_overrides, save_figure, versions

console = Console(width=None if Console().is_terminal else 150)
HOUR_MS, MINUTE_MS = 3_600_000, 60_000


def write_schedules(store: DelayedStore, count: int, due_ms: int | None, progress: Progress,
                    rule: Rule | None = None, pending_ms: int | None = None) -> str:
    """``count`` schedules ``bench:<i>`` every hour from an hour ahead (or by ``rule``, pending at
    ``pending_ms``), written as ``Definitions.put`` would (version 1), their pending occurrences due at
    ``due_ms`` (None: at their time).  Returns their queue."""
    app = create_app()
    template = template_of(app, app.signature("recurring.noop", args=(0,)))
    anchor = store.now_ms() + HOUR_MS if pending_ms is None else pending_ms
    stored_rule = rule_data(rule or Every(HOUR_MS, anchor))
    task = progress.add_task("writing schedules", total=count)
    for start in range(0, count, 2000):
        pipe = store.redis.pipeline(transaction=False)
        items = []
        for i in range(start, min(start + 2000, count)):
            definition = Definition(f"bench:{i}", stored_rule, template, "api", 1, anchor)
            pipe.hset(store.keys.recurring(store.partition(definition.schedule_id)), definition.schedule_id,
                      definition.encode())
            task_id, message = occurrence(Envelope.decode(template), definition.schedule_id, 1, anchor,
                                          store.settings.compress_min_bytes)
            items.append((task_id, anchor if due_ms is None else due_ms, message))
        store.execute(pipe)
        store.schedule_many(items, attempt=1)
        progress.advance(task, len(items))
    return Envelope.decode(template).queue


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


def measure_dispatch(settings: Settings, count: int, progress: Progress) -> dict[str, Any]:
    """One poller dispatching ``count`` occurrences due at once; their queue is paused until it leads every
    partition, so its start (preflight, leadership) is not counted."""
    store = DelayedStore(settings)
    left = MINUTE_MS - store.now_ms() % MINUTE_MS
    if left < 30_000:  # the run's successors (the next boundary's) must not come due during it
        time.sleep(left / 1000 + 0.1)
    boundary = store.now_ms() // MINUTE_MS * MINUTE_MS
    queue = write_schedules(store, count, None, progress, rule_of(crontab()), boundary)
    ensure_topics(settings, [queue])
    store.pause(queue)
    poller = Poller(settings, store=store)
    running = threading.Thread(target=poller.run, daemon=True)
    running.start()
    try:
        wait_for(lambda: len(poller.leadership.owned()) == settings.partitions, 30, "the poller to lead")
        store.resume(queue)
        began = time.perf_counter()
        task = progress.add_task("dispatching", total=count)
        while poller.stats["dispatched"] < count and time.perf_counter() - began < 300 and running.is_alive():
            progress.update(task, completed=poller.stats["dispatched"])
            time.sleep(0.005)
        spent = time.perf_counter() - began
    finally:
        poller.stop()
        running.join(30)
    fired = poller.stats["occurrences_fired"]
    return {"occurrences": fired, "dispatched": poller.stats["dispatched"], "seconds": spent,
            "per_s": fired / spent}


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
            ("occurrences dispatched / s, one poller (crontab)", results["dispatch"]["per_s"],
             baseline and baseline.get("dispatch", {}).get("per_s"), "{:.0f}"),
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
            f"{opts.dispatch} dispatched by one poller; "
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
    parser.add_argument("--dispatch", type=int, default=10_000)
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--baseline", type=Path, help="the JSON of an earlier run (say, of main) to compare with")
    opts = parser.parse_args(argv)
    found = versions()
    console.print(found)
    results: dict[str, Any] = {}
    for name, measure, count in (("advance", measure_advance, opts.occurrences),
                                 ("dispatch", measure_dispatch, opts.dispatch),
                                 ("start", measure_start, opts.schedules)):
        settings = Settings.from_conf(new_overrides(opts.partitions))
        try:
            with Progress(console=console, transient=True) as progress:
                results[name] = measure(settings, count, progress)
        finally:
            remove_everything(settings, topics=None if name == "dispatch" else [])
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
