"""A campaign on one queue against another queue's tasks (issue 29): how late does a burst of
tasks all due at one instant make the tasks of a queue that has nothing to do with it?

Dispatch claims a store partition's due tasks in due order across all of its queues, so N tasks
due at one instant T on queue ``bulk`` are all ahead of another queue's tasks due just after T.
What a user would see, per case:

1. a poller (one, leading every store partition) and a worker (``celery worker -c 2``) of the
   default queue only are started; no worker reads ``bulk``, so only dispatch is shared;
2. **campaign** cases: N ``compare.noop`` tasks stored with ``celery_delayed.apply_many`` (bulk
   scheduling, bench.scale's ``send``) on queue ``bulk``, all due at one instant T, chosen a few
   seconds past when storing should end (apply_many's rate measured first on
   :data:`CALIBRATE` tasks due tomorrow, which stay in the store for the case).  Storing stops
   ``delayed_min_delay`` + :data:`CUTOFF` s before T even if it is slower than measured (a task
   sent later would go straight to the broker, as ``apply_async`` sends one due that soon): the
   campaign is then the tasks stored by then, and the report says so;
3. ``compare.noop`` (bench.compare_app: it records its first start behind its due time) sent one
   by one with ``apply_async(countdown=3)`` at ``--rate`` tasks/s, due from T - 5 s to T + 15 s,
   on the default queue (bench.fleet's ``Sender``);
4. meanwhile the records on the ``bulk`` topic are counted every 50 ms (the sum of its
   partitions' high watermarks), and another Redis client PINGs every 5 ms from T - 1 s until the
   campaign is all on its topic (``PingProbe``; the slow log says what blocked Redis longest);
5. the default queue's tasks are waited for.

The **baseline** case is the same run without the campaign (its PINGs from T - 1 s to T + 1 s).
Reported per case: the default queue's lateness (first start - due) p50/p99/max, also of the
tasks due while the campaign was dispatched, against the baseline's (ratio); the campaign's
storing time and its dispatch (first record, all records, tasks/s); PING p99/max.

Last, the **paused** case: queue ``bulk`` paused and limited to :data:`PAUSED_RATE` tasks/s
(``delayed_queue_rates``), :data:`PAUSED_POLLERS` pollers, ``--paused`` tasks on it all due at once
and held :data:`PAUSED_HOLD` s past due: its records on its topic meanwhile (0 expected), then,
resumed, its drain rate against the limit, while the same pollers dispatch a campaign of
``--beside`` tasks of another queue (:data:`BESIDE`, no limit) due at the resume instant.

    python -m bench.burst [--quick] [--tasks 100000 1000000] [--rate 20] [--paused 60000] [--beside 40000]

``--tasks`` with no sizes runs the paused case alone (``python -m bench.burst --tasks --paused 20000``).

Full profile: 100k and 1M (1M takes ~5 min to store here, ~3,300 tasks/s, and the run ~9 min in
all; ``--tasks 100000`` skips it); ``--quick``: 20k, and a paused 20k beside 10k (CI, ~2 min).  Writes
bench/results/burst-<time>.json, .md and .png (the default queue's lateness over due time, and the
campaign's records on its topic over time), burst-<time>-paused.png (the paused queue's drain against
its limit), the processes' logs in burst-<time>.logs/; a full run also as burst-latest.*.  Exits 1 when
a default-queue task was not run, a paused task reached its topic before resume, or a case failed.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import shutil
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import (RESULTS, PingProbe, RedisMeter, exclusive, high_watermark, make_consumer, new_overrides,
                          percentile, save_figure, summary, topic_partitions, versions)
from bench.compare import System, _clean, _ms, start_worker, wait_runs
from bench.compare_app import RECORDS, create_app, read_run, read_starts
from bench.dispatch import git_state, leadership_changes
from bench.fleet import Sender, _markdown
from bench.scale import send
from celery_delayed import store_of
from celery_delayed.kafka import ensure_topics
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import TOKEN_BURST_S
from tasks.processes import Processes, wait_for

console = Console(width=None if Console().is_terminal else 160)
#: The campaign's queue (no worker reads it).
BULK = "bulk"
#: The paused case's other queue, not limited: its campaign is due when the paused queue resumes.
BESIDE = "beside"
#: Store partitions, as config/ has them.
PARTITIONS = 8
#: The other queue's tasks are due from T - BEFORE to T + AFTER (s).
BEFORE, AFTER = 5.0, 15.0
#: Their countdown (s): above ``delayed_min_delay``, so each goes through the store.
COUNTDOWN = 3.0
#: Tasks stored first (due tomorrow) to measure apply_many's rate, from which T is chosen.
CALIBRATE = 5000
#: T leaves the storing time this rate predicts times SAFETY, then MARGIN s, before the first send
#: (the rate falls as the store grows, and with the machine's other work: 1M ran at 65% of it once).
SAFETY, MARGIN = 1.4, 3.0
#: Storing stops this long before T, less ``delayed_min_delay`` (s): apply_many sends a task due
#: sooner straight to the broker, where it would not be dispatched at all.
CUTOFF = 1.5
#: How often the campaign's topic is counted (s).
SAMPLE_S = 0.05
#: The paused case: its queue's rate limit (tasks/s, delayed_queue_rates), its pollers, and how
#: long its tasks stay paused once due (s).
PAUSED_RATE, PAUSED_POLLERS, PAUSED_HOLD = 2000, 2, 3.0


def run_case(n: int, opts: argparse.Namespace, progress: Progress, logdir: Path) -> dict[str, Any]:
    """One case: the campaign of ``n`` tasks (0: the baseline) beside the default queue's tasks."""
    label = f"campaign {n:,}" if n else "baseline"
    overrides = new_overrides(partitions=PARTITIONS)
    settings = Settings.from_conf(overrides)
    env = {"COMPARE_SYSTEM": "celery-delayed"}
    records = redis.Redis.from_url(RECORDS)
    run, campaign = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    procs = Processes(logdir / (f"campaign-{n}" if n else "baseline"), overrides, app="bench.compare_app")
    procs.logdir.mkdir(parents=True)
    sender = Sender(create_app("celery-delayed", **overrides).tasks["compare.noop"], run, opts.rate, COUNTDOWN)
    consumer = make_consumer(settings)
    probe: PingProbe | None = None
    meter = RedisMeter(redis.Redis.from_url(settings.redis_url))
    try:
        poller = procs.start("poller", "delayed", "poller", "-l", "INFO", env=env)
        start_worker(procs, env)
        poller_log = next(log for proc, log in procs.procs if proc is poller)
        wait_for(lambda: any(len(c["partitions"]) == PARTITIONS for c in leadership_changes(poller_log, 0)), 60,
                 "the poller to lead every store partition")
        store: dict[str, Any] = {}
        if n:
            ensure_topics(settings, [BULK])
            parts = topic_partitions(settings, settings.topic(BULK))
            storer = create_app("celery-delayed", **overrides)  # its own app: the sender's runs in its thread
            seconds, _ = send(storer, campaign, CALIBRATE, time.time() + 86_400, 0.0, progress,
                              f"{label}: calibrate ({CALIBRATE:,} due tomorrow)", queue=BULK)
            rate = CALIBRATE / seconds
            due = time.time() + n / rate * SAFETY + MARGIN + BEFORE + COUNTDOWN
            store_thread = threading.Thread(target=_store, daemon=True, name="burst-store",
                                            args=(store, storer, campaign, n, due, progress, f"{label}: store"))
            store_thread.start()
        else:
            due = time.time() + MARGIN + BEFORE + COUNTDOWN
        timeline: list[tuple[float, int]] = []
        on_topic, first_at, all_at, probe_end = 0, None, None, None
        deadline = due + AFTER + 60 + n / 5000  # the campaign is on its topic by then, or the case failed
        sending = progress.add_task(f"{label}: send {opts.rate:g}/s, due T-{BEFORE:g}..T+{AFTER:g} s",
                                    total=round((BEFORE + AFTER) * opts.rate))
        while True:
            now = time.time()
            procs.check_alive()
            if store.get("error"):
                raise RuntimeError(f"storing the campaign failed: {store['error']}")
            if not sender.is_alive() and sender.ident is None and now >= due - BEFORE - COUNTDOWN:
                sender.start()
            progress.update(sending, completed=len(sender.sent))
            if probe is None and now >= due - 1:
                probe = PingProbe(settings.redis_url)
                meter.start()
                probe.start()
            if n and all_at is None and now >= due - 2:  # none is claimed before T - delayed_dispatch_lead
                on_topic = high_watermark(consumer, settings.topic(BULK), parts)
                timeline.append((round(now - due, 3), on_topic))
                first_at = first_at if first_at is not None or not on_topic else now - due
                if "stored" in store and on_topic >= store["stored"]:
                    all_at = now - due
            if probe is not None and probe_end is None and (all_at is not None if n else now >= due + 1):
                probe_end = now - due
                ping, redis_calls = probe.stop(), meter.stop()
            if now >= due + AFTER - COUNTDOWN and sender.is_alive():
                sender.stop()
            if sender.ident is not None and not sender.is_alive() and (not n or all_at is not None):
                break
            if now > deadline:
                raise RuntimeError(f"only {on_topic:,} of {store.get('stored', n):,} campaign tasks on "
                                   f"{settings.topic(BULK)} {now - due:.0f} s after they were due")
            time.sleep(SAMPLE_S)
        progress.remove_task(sending)
        if sender.error:
            raise RuntimeError(f"sending the default queue's tasks failed: {sender.error}")
        if n:
            store_thread.join()
        last_due = max(d for _, d in sender.sent) / 1000
        wait_runs(records, run, len(sender.sent), last_due + opts.grace + n / 20_000, progress, f"{label}: run",
                  procs)
        runs, _, _ = read_run(records, run)
        starts = read_starts(records, run)
        return {"case": label, "campaign": n, **store, "due": due, "calibrated_per_s": round(rate) if n else None,
                "sent": len(sender.sent), "sender_behind_s": round(sender.behind_s, 3),
                "not_run": sum(task_id not in starts for task_id, _ in sender.sent),
                "ran_twice": sum(count > 1 for count in runs.values()),
                "ping_ms": ping, "ping_window_s": [-1, round(probe_end, 2)],
                "redis_slowest_ms": redis_calls["slowest_ms"], "redis_slowest": redis_calls["slowest"][:3],
                "dispatch": {"first_s": _round(first_at), "all_s": _round(all_at),
                             "per_s": round(store["stored"] / (all_at - first_at)) if n and all_at > first_at
                             else None},
                "timeline": timeline,
                "points": [(round(d / 1000 - due, 3), starts[t][0] if t in starts else None) for t, d in sender.sent]}
    finally:
        sender.stop()
        if probe is not None and probe_end is None:
            probe.stop()
        meter.close()
        procs.stop_all()
        consumer.close()
        _clean(System("celery-delayed", "", "celery-delayed"), overrides, records, run)  # the broker db too
        remove_everything(settings, [settings.topic(BULK)])


def run_paused_case(n: int, beside: int, progress: Progress, logdir: Path) -> dict[str, Any]:
    """A campaign of ``n`` tasks on a paused queue limited to :data:`PAUSED_RATE` tasks/s, all due at
    once, :data:`PAUSED_POLLERS` pollers: records on its topic while it stays paused
    :data:`PAUSED_HOLD` s past due (none may come), then, resumed, how fast it drains (the slope of
    its records between a tenth and nine tenths of them, after the bucket's first quarter second),
    while the same pollers dispatch ``beside`` tasks of queue :data:`BESIDE` due at the resume instant
    (the limit must hold for a poller busy with another queue, issue 41)."""
    label = f"paused {n:,}, resumed at {PAUSED_RATE:,}/s" + (f", {beside:,} of {BESIDE} due then" if beside else "")
    overrides = {**new_overrides(partitions=PARTITIONS), "delayed_queue_rates": {BULK: PAUSED_RATE}}
    settings = Settings.from_conf(overrides)
    procs = Processes(logdir / "paused", overrides, app="bench.compare_app")
    procs.logdir.mkdir(parents=True)
    consumer = make_consumer(settings)
    app = create_app("celery-delayed", **overrides)
    store = store_of(app)
    try:
        store.pause(BULK)
        pollers = [procs.start(f"poller{i}", "delayed", "poller", "-l", "INFO",
                               env={"COMPARE_SYSTEM": "celery-delayed"}) for i in range(PAUSED_POLLERS)]
        for proc in pollers:
            log = next(log for p, log in procs.procs if p is proc)
            wait_for(lambda log=log: any(c["partitions"] for c in leadership_changes(log, 0)), 60,
                     "every poller to lead store partitions")
        ensure_topics(settings, [BULK, BESIDE])
        parts = topic_partitions(settings, settings.topic(BULK))
        beside_parts = topic_partitions(settings, settings.topic(BESIDE))
        due = time.time() + settings.min_delay + CUTOFF + (n + beside) / 1000  # apply_many stores 1,300-4,000/s here
        until = due - settings.min_delay - CUTOFF  # later ones would go to the broker
        seconds, stored = send(app, uuid.uuid4().hex[:8], n, due, 0.0, progress, f"{label}: store", queue=BULK,
                               until=until)
        _, beside_stored = send(app, uuid.uuid4().hex[:8], beside, due + PAUSED_HOLD, 0.0, progress,
                                f"{label}: store {BESIDE}", queue=BESIDE, until=until)
        wait_for(lambda: time.time() >= due + PAUSED_HOLD, due + PAUSED_HOLD - time.time() + 10, "the pause to be held")
        while_paused = high_watermark(consumer, settings.topic(BULK), parts)
        store.resume(BULK)
        resumed = time.time()
        timeline: list[tuple[float, int]] = []
        beside_timeline: list[tuple[float, int]] = []
        draining = progress.add_task(f"{label}: drain", total=stored)
        while not timeline or timeline[-1][1] < stored or beside_timeline[-1][1] < beside_stored:
            procs.check_alive()
            if time.time() - resumed > 2 * stored / PAUSED_RATE + 30:
                raise RuntimeError(f"only {timeline[-1][1]:,} of {stored:,} on {settings.topic(BULK)} and "
                                   f"{beside_timeline[-1][1]:,} of {beside_stored:,} on {settings.topic(BESIDE)} "
                                   "after resume")
            at = round(time.time() - resumed, 3)
            timeline.append((at, high_watermark(consumer, settings.topic(BULK), parts)))
            beside_timeline.append((at, high_watermark(consumer, settings.topic(BESIDE), beside_parts)))
            progress.update(draining, completed=timeline[-1][1])
            time.sleep(SAMPLE_S)
        progress.remove_task(draining)
        # rates by when the pollers produced each record, not by when Kafka showed it (a campaign's
        # records ahead of them in the producer's queue would hold the limited queue's back, then all at once)
        limited = [at - resumed for at in _produced(consumer, settings.topic(BULK), parts, stored)]
        other = [at - resumed for at in _produced(consumer, settings.topic(BESIDE), beside_parts, beside_stored)]
        burst = int(PAUSED_RATE * TOKEN_BURST_S)  # the bucket's first tokens, there at once
        low, high = max(stored // 10, burst), stored * 9 // 10
        # while the other queue's campaign went: from resume until its last record, less the bucket's first
        # tokens (a limit held exactly makes it the limit; counted from the burst's last record instead, the
        # tokens earned while the burst was produced would count twice)
        during = bisect.bisect(limited, other[-1]) - burst if other else 0
        return {"case": label, "paused": n, "stored": stored, "store_s": round(seconds, 1),
                "records_while_paused": while_paused, "drain_s": next(t for t, k in timeline if k >= stored),
                "drain_per_s": round((high - low) / (limited[high] - limited[low])), "rate": PAUSED_RATE,
                "pollers": PAUSED_POLLERS, "beside": beside_stored,
                "beside_s": next((t for t, k in beside_timeline if k >= beside_stored), None),
                "beside_per_s": round(len(other) / (other[-1] - other[0])) if len(other) > 1 else None,
                "drain_beside_per_s": round(during / other[-1]) if during > PAUSED_RATE / 2 else None,
                "timeline": timeline, "beside_timeline": beside_timeline}
    finally:
        procs.stop_all()
        consumer.close()
        remove_everything(settings, [settings.topic(BULK), settings.topic(BESIDE)])


def _produced(consumer: Consumer, topic: str, partitions: list[int], n: int) -> list[float]:
    """When the pollers produced each of the ``n`` records on ``topic`` (their CreateTime, epoch s), sorted."""
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    stamps: list[float] = []
    deadline = time.time() + 60
    while len(stamps) < n and time.time() < deadline:
        stamps += [record.timestamp()[1] / 1000 for record in consumer.consume(10_000, timeout=1.0)
                   if not record.error()]
    consumer.unassign()
    if len(stamps) < n:
        raise RuntimeError(f"only {len(stamps):,} of {n:,} records read back from {topic}")
    return sorted(stamps)


def _store(out: dict[str, Any], app: Any, run: str, n: int, due: float, progress: Progress, label: str) -> None:
    """The campaign: ``n`` tasks on :data:`BULK` all due at ``due`` (epoch s), those built by
    :data:`CUTOFF` s and ``delayed_min_delay`` before it; how many are in the store (``stored``),
    how long storing took and how long before ``due`` it ended into ``out``, or the error."""
    try:
        seconds, stored = send(app, run, n, due, 0.0, progress, label, queue=BULK,
                               until=due - store_of(app).settings.min_delay - CUTOFF)
        out.update(store_s=round(seconds, 1), store_per_s=round(stored / seconds),
                   stored_before_due_s=round(due - time.time(), 1), stored=stored)
    except Exception as exc:  # raised by the case's loop
        out["error"] = f"{type(exc).__name__}: {exc}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def lateness(result: dict[str, Any], during: tuple[float, float] | None = None) -> dict[str, float]:
    """Summary of the default queue's lateness (ms), of the tasks due within ``during`` (s from T) if given."""
    return summary([lag for t, lag in result["points"]
                    if lag is not None and (during is None or during[0] <= t <= during[1])])


# -- report --------------------------------------------------------------------
def report(results: list[dict[str, Any]], opts: argparse.Namespace, found: dict[str, str]) -> str:
    """The results as Markdown (also printed): a row per case, ratios against the baseline."""
    base = next((lateness(r) for r in results if not r["campaign"]), None)
    head = ["case", "campaign stored: tasks in s (tasks/s), ended before T", "default queue: sent / not run",
            "lateness p50 / p99 / max ms", "p99 / max vs baseline", "due during dispatch: tasks, p99 / max ms",
            "campaign on its topic: first / all s after T (tasks/s)", "PING p99 / max ms", "Redis slowest ms"]
    rows = []
    for r in results:
        lag = lateness(r)
        ratio, stored, during, dispatched = "—", "—", "—", "—"
        if r["campaign"]:
            d = r["dispatch"]
            cut = "" if r["stored"] == r["campaign"] else f" of {r['campaign']:,} (cut)"
            stored = (f"{r['stored']:,}{cut} in {r['store_s']} s ({r['store_per_s']:,}/s), "
                      f"{r['stored_before_due_s']} s")
            window = lateness(r, (min(d["first_s"], 0.0), d["all_s"]))
            during = f"{window['count']}, {_ms(window['p99'])} / {_ms(window['max'])}"
            dispatched = f"{d['first_s']} / {d['all_s']} ({d['per_s']:,})"
            if base and base["count"]:
                ratio = f"{_ratio(lag['p99'], base['p99'])} / {_ratio(lag['max'], base['max'])}"
        rows.append([r["case"], stored, f"{r['sent']} / {r['not_run']}",
                     f"{_ms(lag['p50'])} / {_ms(lag['p99'])} / {_ms(lag['max'])}", ratio, during, dispatched,
                     f"{r['ping_ms']['p99']:.1f} / {r['ping_ms']['max']:.1f}",
                     f"{r['redis_slowest_ms']:.1f}" if r["redis_slowest_ms"] else f"< {RedisMeter.SLOW_US / 1000:g}"])
    title = (f"bench.burst: a campaign due at one instant T on queue {BULK} (no worker), the default queue's tasks "
             f"at {opts.rate:g}/s due T-{BEFORE:g}..T+{AFTER:g} s (countdown {COUNTDOWN:g} s), one worker -c 2, "
             f"one poller, {PARTITIONS} store partitions")
    table = Table(*head, title=title)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    notes = ("Lateness: first start - due time of the default queue's tasks; not run by the end: left out of the "
             "percentiles.  Due during dispatch: due between the campaign's first record on its topic (or T) and "
             "its last.  Campaign on its topic: the sum of its topic's high watermarks, sampled every "
             f"{SAMPLE_S * 1000:.0f} ms (a record can be on the topic before T: the poller claims "
             "delayed_dispatch_lead ahead).  PING: another Redis client's round trips every 5 ms from T - 1 s until "
             "the campaign was all on its topic (baseline: until T + 1 s); Redis slowest: the longest command of "
             "the slow log then (what blocked every client).")
    return "\n".join([f"### {title}", "", _markdown(head, rows), "", notes, "",
                      "Versions: " + ", ".join(f"{k} {v}" for k, v in found.items())]) + "\n"


def paused_report(result: dict[str, Any]) -> str:
    """The paused case as Markdown (also printed)."""
    head = ["case", "stored: tasks in s", "records on its topic while paused", "drain after resume: tasks/s (vs limit)",
            "all on its topic after resume, s", f"{BESIDE}, due at resume: all on its topic after, s (produced/s)",
            f"drain while {BESIDE} went: tasks/s (vs limit)"]
    beside = f"{result['beside_s']} ({result['beside_per_s']:,})" if result.get("beside_per_s") else "—"
    during = result.get("drain_beside_per_s")
    row = [result["case"], f"{result['stored']:,} in {result['store_s']} s", f"{result['records_while_paused']:,}",
           _against(result["drain_per_s"], result["rate"]), f"{result['drain_s']}", beside,
           _against(during, result["rate"]) if during else "—"]
    title = (f"bench.burst: a paused queue ({BULK}, limited to {result['rate']:,} tasks/s), its tasks all due at once, "
             f"{result['pollers']} pollers; resumed {PAUSED_HOLD:g} s after they were due")
    table = Table(*head, title=title)
    table.add_row(*row)
    console.print(table)
    notes = ("Drain: its records produced a second (by their CreateTime, when a poller produced them) between "
             "a tenth and nine tenths of them, once the token bucket's first quarter second is spent; while "
             f"{BESIDE} went: from resume until {BESIDE}'s last record, less the bucket's first quarter second.  "
             f"All on its topic: by the topics' high watermarks, every {SAMPLE_S * 1000:.0f} ms.  The limit is one "
             "token bucket in Redis that both pollers draw on.")
    return "\n".join([f"### {title}", "", _markdown(head, [row]), "", notes]) + "\n"


def _against(rate: int, limit: float) -> str:
    return f"{rate:,} ({rate / limit - 1:+.1%})"


def paused_plot(result: dict[str, Any], path: Path) -> Path:
    """The paused queue's records on its topic after resume, against its rate limit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot([t for t, _ in result["timeline"]], [k for _, k in result["timeline"]],
            label=f"records on {BULK}'s topic: {result['drain_per_s']:,}/s")
    end = result["timeline"][-1][0]
    ax.plot([0, end], [0, end * result["rate"]], "--", color="grey", label=f"the limit, {result['rate']:,}/s")
    if result.get("beside_timeline"):
        ax.plot([t for t, _ in result["beside_timeline"]], [k for _, k in result["beside_timeline"]],
                label=f"records on {BESIDE}'s topic (no limit, due at resume)")
    ax.set(title=f"{result['case']}: {result['records_while_paused']} records while paused",
           xlabel="seconds after resume", ylabel="records")
    return save_figure(fig, (ax,), path)


def _ratio(value: float, base: float) -> str:
    return "—" if math.isnan(value) or math.isnan(base) else f"{value / max(base, 1.0):,.1f}x"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """The default queue's lateness over its due time (s from T), each case; the campaigns' records
    on their topic over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (late, topic) = plt.subplots(2, 1, figsize=(13, 9), sharex=True)
    for r in results:
        ran = [(t, lag) for t, lag in r["points"] if lag is not None]
        (line,) = late.plot([t for t, _ in ran], [max(lag, 0) for _, lag in ran], ".-", markersize=3, linewidth=0.6,
                            alpha=0.8, label=f"{r['case']}: p99 {_ms(percentile([lag for _, lag in ran], .99))} ms")
        if r["campaign"]:
            d = r["dispatch"]
            late.axvspan(min(d["first_s"], 0.0), d["all_s"], color=line.get_color(), alpha=0.12)
            topic.plot([t for t, _ in r["timeline"]], [k for _, k in r["timeline"]], color=line.get_color(),
                       label=f"{r['case']}: all on the topic {d['all_s']} s after T ({d['per_s']:,}/s)")
    late.axvline(0, color="black", linestyle="--", linewidth=0.8)
    topic.axvline(0, color="black", linestyle="--", linewidth=0.8)
    late.set(title="the default queue's tasks: lateness by due time (shaded: the campaign being dispatched)",
             ylabel="first start - due, ms (symlog)", yscale="symlog")
    late.set_yscale("symlog", linthresh=10)
    late.set_ylim(0, None)
    topic.set(title=f"the campaign: records on its topic ({BULK})", xlabel="seconds from T (the campaign's due time)",
              ylabel="records")
    return save_figure(fig, (late, topic), path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a campaign of 20,000 (CI, ~2 min)")
    parser.add_argument("--tasks", type=int, nargs="*", default=[100_000, 1_000_000],
                        help="campaign sizes, one case each after the baseline (default 100000 1000000; "
                             "none: the paused case alone)")
    parser.add_argument("--rate", type=float, default=20.0, help="the default queue's tasks sent a second")
    parser.add_argument("--paused", type=int, default=60_000,
                        help="tasks of the paused, rate-limited case (0: none; default 60000, --quick 20000)")
    parser.add_argument("--beside", type=int, default=40_000,
                        help=f"tasks of queue {BESIDE} due when the paused case resumes (default 40000, "
                             "--quick 10000)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="wait this long past the last due time (plus 1 s per 20,000 campaign tasks)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.tasks, opts.paused, opts.beside = [20_000], 20_000, 10_000
    if any(n < 1 or n > 2_000_000 for n in opts.tasks):
        parser.error("--tasks: each between 1 and 2,000,000")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    with exclusive("bench.burst"):
        found = versions()
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = RESULTS / f"burst-{stamp}{'-quick' if opts.quick else ''}"
        results, failed = [], []
        began = time.monotonic()
        logdir = base.with_suffix(".logs")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            for n in [0, *opts.tasks] if opts.tasks else []:
                try:
                    results.append(run_case(n, opts, progress, logdir))
                except (RuntimeError, AssertionError) as exc:  # the other cases still run
                    failed.append(f"{'campaign ' + format(n, ',') if n else 'baseline'}: {exc}")
                    console.print(f"[red]failed[/]: {failed[-1]}")
            paused = None
            if opts.paused:
                try:
                    paused = run_paused_case(opts.paused, opts.beside, progress, logdir)
                except (RuntimeError, AssertionError) as exc:
                    failed.append(f"paused {opts.paused:,}: {exc}")
                    console.print(f"[red]failed[/]: {failed[-1]}")
        table = (report(results, opts, found) if results else "") + (f"\n{paused_report(paused)}" if paused else "") \
            + "".join(f"\nFailed: {f}\n" for f in failed)
        wall = round(time.monotonic() - began)
        base.with_suffix(".md").write_text(table + f"\nWall time: {wall} s.\n")
        base.with_suffix(".json").write_text(json.dumps(
            {"versions": found, "git": git_state(), "options": vars(opts), "wall_s": wall, "failed": failed,
             "results": results, "paused": paused}, indent=1, default=str))
        if results:
            plot(results, base.with_suffix(".png"))
        if paused:
            paused_plot(paused, base.parent / f"{base.name}-paused.png")
        if not opts.quick and results:  # a full run
            for suffix in (".md", ".json", ".png"):
                shutil.copyfile(base.with_suffix(suffix), RESULTS / f"burst-latest{suffix}")
            if paused:
                shutil.copyfile(base.parent / f"{base.name}-paused.png", RESULTS / "burst-latest-paused.png")
        console.print(f"results: {base}.md, .json, .png; logs in {logdir}/ ({wall} s)")
        lost = sum(r["not_run"] for r in results)
        if lost:
            console.print(f"[red]{lost} default-queue task(s) not run")
        leaked = paused["records_while_paused"] if paused else 0
        if leaked:
            console.print(f"[red]{leaked} record(s) of the paused queue on its topic before it was resumed")
        return 1 if lost or failed or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
