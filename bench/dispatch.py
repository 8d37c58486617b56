"""Dispatch benchmark: real pollers moving due tasks from the Redis store to Kafka.

1. Throughput: N due tasks preloaded with ``DelayedStore.schedule_many`` (beside
   ``--backlog`` tasks due tomorrow, to measure with a big store), then 1 (and then
   2) ``celery -A tasks delayed poller`` processes are started; tasks/s until every
   due record is on the topic and left the store, and the PING round trips another
   Redis client sees meanwhile.  ``--load`` runs each a second time beside a busy
   neighbour (one core spun).
2. Lag: one poller leading every partition; a separate process schedules tasks at a
   fixed rate, each due ~2 s later; lag = Kafka CreateTime - due time, per record.

``python -m bench.dispatch [--quick] [--load] [--tasks N] [--backlog N] [--rates 1000,5000] [--duration S]``
Results (JSON, PNG, poller logs) go to ``bench/results/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue as queue_mod
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Iterator

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from celery_delayed.envelope import Envelope
from celery_delayed.kafka import ensure_topics
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.layout import partition_of
from tasks.processes import Processes

from .common import (RESULTS, CpuMeter, PingProbe, RedisMeter, cpu_hog, exclusive,
                     high_watermark, make_consumer, new_overrides, plot_lags, profile_top, service_pids,
                     start_py_spy, stop_py_spy, summary, topic_partitions)

console = Console(width=None if Console().is_terminal else 150)
#: MEASURED.md: Lua claim end to end into Python, ~125k tasks/s at 100k tasks in the set.
CLAIM_CEILING = 125_000
LEAD_S = 2.0  # how far in the future the lag scenario's tasks are due


@dataclasses.dataclass(frozen=True)
class Profile:
    """What one run measures."""

    tasks: int
    backlog: int  # tasks due tomorrow beside the due ones of the throughput runs
    rates: list[int]
    duration: float
    partitions: int
    pollers: list[int]


# -- messages --------------------------------------------------------------------
def capture_template(partitions: int) -> Envelope:
    """The envelope Celery really stores for ``add.apply_async((2, 2), countdown=3600)``."""
    from celery_delayed import store_of
    from tasks import create_app

    overrides = new_overrides(partitions)
    app = create_app(**overrides)
    store = store_of(app)
    try:
        result = app.tasks["tasks.demo.add"].apply_async((2, 2), countdown=3600)
        data = store.message(result.id)
        if not isinstance(data, bytes):
            raise RuntimeError("the captured countdown task is not in the delayed store")
        store.cancel(result.id)
        return Envelope.decode(data)
    finally:
        remove_everything(store.settings, [])


def envelope_bytes(template: Envelope, queue: str, task_id: str, due_ms: int) -> bytes:
    """``template`` as a new task: its own id (meta, headers, correlation id), queue and ETA."""
    headers = {**template.headers, "id": task_id, "root_id": task_id,
               "eta": datetime.fromtimestamp(due_ms / 1000, timezone.utc).isoformat()}
    properties = dict(template.properties)
    if "correlation_id" in properties:
        properties["correlation_id"] = task_id
    return dataclasses.replace(template, task_id=task_id, queue=queue, routing_key=queue, headers=headers,
                               properties=properties).encode()


# -- reading the topic -------------------------------------------------------------
def key_of(record: Message) -> str:
    """A record's key (the task id) as text."""
    return (record.key() or b"").decode()


def assign_from_start(consumer: Consumer, topic: str, partitions: list[int]) -> None:
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])


def read_all(consumer: Consumer, topic: str, partitions: list[int], total: int,
             timeout: float) -> Iterator[tuple[str, int]]:
    """``(key, CreateTime ms)`` of the first ``total`` records of ``topic``."""
    assign_from_start(consumer, topic, partitions)
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < total and time.monotonic() < deadline:
        for record in consumer.consume(num_messages=10_000, timeout=0.5):
            if record.error():
                continue
            seen += 1
            yield key_of(record), record.timestamp()[1]


# -- poller logs -------------------------------------------------------------------
_LEADS = re.compile(r"^\[(\S+ \S+): INFO/[\w.]+\] poller (\S+) leads partitions \[([\d, ]*)\]")


def leadership_changes(log: Path, since: float) -> list[dict[str, Any]]:
    """The ``leads partitions`` lines of a poller log, ``t`` in seconds since ``since`` (epoch)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        match = _LEADS.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
            out.append({"t": round(stamp - since, 3), "poller": match[2],
                        "partitions": [int(p) for p in match[3].split(",") if p.strip()]})
    return out


# -- scenario 1: throughput ------------------------------------------------------------
def throughput(template: Envelope, profile: Profile, pollers: int, procs: Processes, progress: Progress,
               py_spy: bool, loaded: bool = False) -> dict[str, Any]:
    """Preload ``profile.tasks`` due tasks (and the backlog), start ``pollers`` pollers, time until
    all due ones are on Kafka; beside a CPU hog when ``loaded``."""
    n, backlog = profile.tasks, profile.backlog
    name = f"{pollers} poller(s){', loaded' if loaded else ''}"
    overrides = new_overrides(profile.partitions)
    settings = Settings.from_conf(overrides)
    queue = overrides["task_default_queue"]
    topic = settings.topic(queue)
    store = DelayedStore(settings)
    consumer = make_consumer(settings)
    spies: list[subprocess.Popen | None] = []
    spy_files: list[str] = []
    hog: subprocess.Popen | None = None
    calls: RedisMeter | None = None
    ping: PingProbe | None = None
    try:
        ensure_topics(settings, [queue])
        parts = topic_partitions(settings, topic)
        load = progress.add_task(f"{name}: preload", total=n + backlog)
        base_ms = int(time.time() * 1000) - 60_000  # due over the past minute, increasing scores
        ids = [str(uuid.uuid4()) for _ in range(n)]
        memory = store.redis.info("memory")["used_memory"]
        t_load = time.time()
        added = store.schedule_many(
            ((tid, base_ms + i * 60_000 // n, envelope_bytes(template, queue, tid, base_ms + i * 60_000 // n))
             for i, tid in enumerate(ids)), progress=lambda k: progress.advance(load, k))
        load_s = time.time() - t_load
        redis_bytes = store.redis.info("memory")["used_memory"] - memory
        tomorrow_ms = base_ms + 86_400_000
        added += store.schedule_many(
            ((tid, tomorrow_ms + i, envelope_bytes(template, queue, tid, tomorrow_ms + i))
             for i, tid in ((i, str(uuid.uuid4())) for i in range(backlog))),
            progress=lambda k: progress.advance(load, k))
        if added != n + backlog:
            raise RuntimeError(f"preloaded {added} of {n + backlog} tasks")
        msg_bytes = sum(store.redis.memory_usage(store.keys.msgs(p)) or 0 for p in range(settings.partitions))

        job = progress.add_task(f"{name}: dispatch", total=n)
        if loaded:
            hog = cpu_hog(600)
        meter = CpuMeter({**service_pids(), "bench": os.getpid(), **({"hog": hog.pid} if hog else {})})
        calls = RedisMeter(store.redis)
        ping = PingProbe(settings.redis_url)
        meter.start()
        calls.start()
        ping.start()
        t0 = time.time()
        started = [procs.poller(f"throughput-{pollers}p-{k}", overrides) for k in range(pollers)]
        for k, proc in enumerate(started):
            meter.add(f"poller-{k}", proc.pid)
        if py_spy:
            spy_files = [str(procs.logdir / f"py-spy-throughput-{pollers}p-{k}.txt") for k in range(pollers)]
            spies = [start_py_spy(proc.pid, Path(out)) for proc, out in zip(started, spy_files)]
        deadline = t0 + 60 + n / 1000
        on_topic, t_all_on_topic, t_done = 0, 0.0, None
        cpu: dict[str, float] = {}
        redis_calls: dict[str, float] = {}
        stalls: dict[str, float] = {}
        while time.time() < deadline:
            procs.check_alive()
            on_topic = high_watermark(consumer, topic, parts)
            progress.update(job, completed=min(on_topic, n))
            if on_topic >= n:
                t_all_on_topic = t_all_on_topic or time.time()
                counts = store.counts()
                if sum(r["scheduled"] for r in counts) == backlog and not any(r["inflight"] for r in counts):
                    t_done = time.time()
                    cpu = meter.stop()
                    redis_calls = calls.stop()
                    stalls = ping.stop()
                    break
            time.sleep(0.05)
        if t_done is None:
            raise RuntimeError(f"{name}: only {on_topic} of {n} records on {topic} "
                               f"after {time.time() - t0:.0f} s; logs in {procs.logdir}")
        leftover = sum(store.redis.hlen(store.keys.msgs(p)) for p in range(settings.partitions))

        verify = progress.add_task(f"{name}: verify topic", total=on_topic)
        keys: set[str] = set()
        first_ms, last_ms, records = None, 0, 0
        for key, ts in read_all(consumer, topic, parts, on_topic, timeout=120):
            keys.add(key)
            records += 1
            first_ms = ts if first_ms is None else min(first_ms, ts)
            last_ms = max(last_ms, ts)
            if records % 10_000 == 0:
                progress.update(verify, completed=records)
        progress.update(verify, completed=records)
        lost = sum(1 for tid in ids if tid not in keys)
        wall = t_done - t0
        dispatch_s = max((last_ms - (first_ms or last_ms)) / 1000, 1e-3)
        logs = [log for p, log in procs.procs if p in started]
        return {"pollers": pollers, "loaded": loaded, "tasks": n, "backlog": backlog, "ping_ms": stalls,
                "partitions": settings.partitions, "preload_s": round(load_s, 3),
                "preload_per_s": round(n / load_s), "msg_hash_bytes": msg_bytes,
                "redis_bytes_per_task": round(redis_bytes / n),
                "envelope_bytes": len(envelope_bytes(template, queue, ids[0], base_ms)),
                "wall_s": round(wall, 3), "per_s_wall": round(n / wall),
                "all_on_topic_s": round(t_all_on_topic - t0, 3),
                "first_record_s": round((first_ms or 0) / 1000 - t0, 3), "dispatch_s": round(dispatch_s, 3),
                "per_s_dispatch": round(n / dispatch_s), "cpu_cores": cpu, "redis_calls": redis_calls,
                "evalsha_per_task": round(redis_calls["evalsha"] / n, 3), "restarted": meter.restarted(),
                "records": records, "lost": lost,
                "duplicates": records - len(keys), "msg_left_in_store": leftover,
                "leadership": [c for log in logs for c in leadership_changes(log, t0)],
                "py_spy": spy_files,
                "logs": [str(log) for log in logs]}
    finally:
        stop_py_spy(spies)
        if calls is not None:  # a run that failed still gives Redis its settings back
            calls.close()
        if ping is not None:
            ping.stop()
        if hog is not None:
            hog.kill()
            hog.wait()
        procs.stop_all()
        consumer.close()
        remove_everything(settings, [topic])


# -- scenario 2: lag at a fixed rate --------------------------------------------------------
def schedule_at_rate(settings_map: dict[str, Any], template: Envelope, queue: str, rate: int, duration: float,
                     out: "mp.Queue[Any]") -> None:
    """Child process: schedule ``rate`` tasks/s for ``duration`` s, task i due at ``start + LEAD_S + i/rate``.

    ``start`` is taken once the child is connected to Redis, so its start-up is not counted as lateness.

    Sends each batch's ``[(task_id, due_ms), ...]`` to ``out`` before storing it, then
    ``("done", stats)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    store = DelayedStore(Settings.from_mapping(settings_map))
    store.redis.ping()
    envelope_bytes(template, queue, str(uuid.uuid4()), 0)  # warm the encoder before the clock starts
    total = int(rate * duration)
    done, min_headroom_ms = 0, float("inf")
    behind_ms: list[float] = []
    start = time.time()
    while done < total:
        now = time.time()
        target = min(total, int((now - start) * rate) + 1)
        if target > done:
            batch = []
            for i in range(done, target):
                tid = str(uuid.uuid4())
                due_ms = int((start + LEAD_S + i / rate) * 1000)
                batch.append((tid, due_ms, envelope_bytes(template, queue, tid, due_ms)))
            out.put([(tid, due_ms) for tid, due_ms, _ in batch])
            store.schedule_many(batch)
            stored_ms = time.time() * 1000
            behind_ms.append(now * 1000 - (start + done / rate) * 1000)
            min_headroom_ms = min(min_headroom_ms, batch[0][1] - stored_ms)
            done = target
        time.sleep(0.005)
    out.put(("done", {"scheduled": done, "elapsed_s": time.time() - start,
                      "batches": len(behind_ms), "behind_ms": summary(behind_ms),
                      "min_headroom_ms": round(min_headroom_ms, 1)}))


def warm_up(settings: Settings, template: Envelope, queue: str, consumer: Consumer, procs: Processes,
            timeout: float = 60.0) -> float:
    """Schedule one task due now in every partition; wait until all are on Kafka (the poller leads all)."""
    store = DelayedStore(settings)
    ids: dict[int, str] = {}
    while len(ids) < settings.partitions:
        tid = str(uuid.uuid4())
        ids.setdefault(partition_of(tid, settings.partitions), tid)
    now_ms = int(time.time() * 1000)
    store.schedule_many([(tid, now_ms, envelope_bytes(template, queue, tid, now_ms)) for tid in ids.values()])
    waiting = set(ids.values())
    t0 = time.time()
    while waiting and time.time() < t0 + timeout:
        procs.check_alive()
        for record in consumer.consume(num_messages=100, timeout=0.2):
            if not record.error():
                waiting.discard(key_of(record))
    if waiting:
        raise RuntimeError(f"warm-up: {len(waiting)} partition(s) not dispatched after {timeout:.0f} s")
    return time.time() - t0


def lag(template: Envelope, profile: Profile, rate: int, procs: Processes, progress: Progress,
        py_spy: bool) -> dict[str, Any]:
    """One poller; tasks scheduled at ``rate``/s for ``profile.duration`` s; lag of every record."""
    overrides = new_overrides(profile.partitions)
    settings = Settings.from_conf(overrides)
    queue = overrides["task_default_queue"]
    topic = settings.topic(queue)
    consumer = make_consumer(settings)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    scheduler: BaseProcess | None = None
    spy: subprocess.Popen | None = None
    calls: RedisMeter | None = None
    spy_file = procs.logdir / f"py-spy-lag-{rate}.txt"
    try:
        ensure_topics(settings, [queue])
        assign_from_start(consumer, topic, topic_partitions(settings, topic))
        poller = procs.poller(f"lag-{rate}", overrides)
        warm_s = warm_up(settings, template, queue, consumer, procs)
        if py_spy:
            spy = start_py_spy(poller.pid, spy_file)

        total = int(rate * profile.duration)
        job = progress.add_task(f"lag @ {rate}/s: delivered", total=total)
        settings_map = {k[len("delayed_"):]: v for k, v in overrides.items() if k.startswith("delayed_")}
        scheduler = child = ctx.Process(target=schedule_at_rate, name=f"scheduler-{rate}", daemon=True,
                                        args=(settings_map, template, queue, rate, profile.duration, out))
        child.start()
        meter = CpuMeter({**service_pids(), "bench": os.getpid(), "poller": poller.pid,
                          "scheduler": child.pid or 0})
        calls = RedisMeter(redis.Redis.from_url(settings.redis_url))
        redis_calls: dict[str, float] = {}
        cpu: dict[str, float] | None = None
        due: dict[str, int] = {}
        seen: dict[str, list[tuple[int, int]]] = {}  # task id -> [(CreateTime ms, received ms)]
        stats: dict[str, Any] | None = None
        delivered = 0  # scheduled ids seen on the topic, each counted once

        def take(records: list) -> None:
            nonlocal delivered
            now_ms = int(time.time() * 1000)
            for record in records:
                if record.error():
                    continue
                tid = key_of(record)
                if tid not in seen and tid in due:
                    delivered += 1
                    if delivered == 1:  # meter CPU and Redis calls over the dispatch window
                        meter.start()
                        calls.start()
                seen.setdefault(tid, []).append((record.timestamp()[1], now_ms))

        deadline = time.time() + profile.duration + LEAD_S + 60
        next_check = 0.0
        while time.time() < deadline:
            # consume() waits for the whole batch or the timeout: keep the timeout short, so the
            # receive time (for the "seen" lag) is not held back by the batching.
            take(consumer.consume(num_messages=1000, timeout=0.005))
            while True:
                try:
                    item = out.get_nowait()
                except queue_mod.Empty:
                    break
                if isinstance(item, tuple) and item[0] == "done":
                    stats = item[1]
                    continue
                for tid, due_ms in item:
                    due[tid] = due_ms
                    delivered += tid in seen
            if stats is not None and delivered >= len(due):
                cpu, redis_calls = meter.stop(), calls.stop()
                break
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.2
                progress.update(job, completed=min(delivered, total))
                procs.check_alive()
                if stats is None and not child.is_alive() and out.empty():
                    raise RuntimeError(f"the scheduler process exited with {child.exitcode}")
        progress.update(job, completed=min(delivered, total))
        time.sleep(0.5)  # let a late duplicate land before counting
        take(consumer.consume(num_messages=10_000, timeout=0.5))
        lags = [seen[tid][0][0] - d for tid, d in due.items() if tid in seen]
        first_due = min(due.values(), default=0)
        points = [((d - first_due) / 1000, seen[tid][0][0] - d) for tid, d in due.items() if tid in seen]
        seen_lags = [seen[tid][0][1] - d for tid, d in due.items() if tid in seen]
        return {"rate": rate, "duration_s": profile.duration, "partitions": settings.partitions,
                "scheduled": len(due), "delivered": len(lags), "lost": len(due) - len(lags),
                "duplicates": sum(len(v) - 1 for tid, v in seen.items() if tid in due),
                "warm_up_s": round(warm_s, 3), "scheduler": stats, "lag_ms": summary(lags),
                "consumer_seen_lag_ms": summary(seen_lags), "cpu_cores": cpu, "redis_calls": redis_calls,
                "evalsha_per_task": round(redis_calls.get("evalsha", 0) / max(len(due), 1), 3),
                "restarted": meter.restarted(), "lags": lags, "points": points,
                "log": next(str(log) for proc, log in procs.procs if proc is poller),
                "py_spy": str(spy_file) if spy is not None else None}
    finally:
        stop_py_spy([spy])
        if calls is not None:
            calls.close()
        if scheduler is not None and scheduler.is_alive():
            scheduler.terminate()
            scheduler.join(10)
            if scheduler.is_alive():
                scheduler.kill()
                scheduler.join()
        procs.stop_all()
        consumer.close()
        remove_everything(settings, [topic])


# -- report ----------------------------------------------------------------------------
def report(throughputs: list[dict[str, Any]], lags: list[dict[str, Any]]) -> None:
    """Print the result tables."""
    if throughputs:
        table = Table("pollers", "profile", "due", "in store", "preload/s", "wall s", "tasks/s (wall)", "1st record s",
                      "dispatch s", "tasks/s (dispatch)", "PING p99 / max", "Redis blocked", "lost", "dup",
                      title="Throughput: preloaded due tasks -> Kafka (PING: another Redis client meanwhile; "
                            "Redis blocked: its slowest command, and how many took over 2 ms)")
        for r in throughputs:
            table.add_row(str(r["pollers"]), "loaded" if r["loaded"] else "quiet", f"{r['tasks']:,}",
                          f"{r['tasks'] + r['backlog']:,}", f"{r['preload_per_s']:,}", f"{r['wall_s']:.2f}",
                          f"{r['per_s_wall']:,}", f"{r['first_record_s']:.2f}", f"{r['dispatch_s']:.2f}",
                          f"{r['per_s_dispatch']:,}", f"{r['ping_ms']['p99']:.1f} / {r['ping_ms']['max']:.1f} ms",
                          f"{r['redis_calls']['slowest_ms']:.1f} ms ({r['redis_calls']['slow_calls']:.0f})",
                          str(r["lost"]), str(r["duplicates"]))
        console.print(table)
        by = {(r["pollers"], r["loaded"]): r for r in throughputs}
        for loaded in (False, True):
            one, two = by.get((1, loaded)), by.get((2, loaded))
            if one and two:
                console.print(f"2/1 pollers{' (loaded)' if loaded else ''}: "
                              f"{two['per_s_wall'] / one['per_s_wall']:.2f}x (wall), "
                              f"{two['per_s_dispatch'] / one['per_s_dispatch']:.2f}x (dispatch)")
            if loaded and (quiet := by.get((1, False))) and (busy := by.get((1, True))):
                console.print(f"loaded/quiet, 1 poller: {busy['per_s_dispatch'] / quiet['per_s_dispatch']:.2f}x")
        best = max(r["per_s_dispatch"] for r in throughputs)
        console.print(f"claim ceiling (MEASURED.md, 100k in the set): ~{CLAIM_CEILING:,}/s; "
                      f"best dispatch rate here {best:,}/s = {best / CLAIM_CEILING:.0%} of it")
    rows = [(f"throughput, {r['pollers']} poller(s){', loaded' if r['loaded'] else ''}", r) for r in throughputs] + \
           [(f"lag @ {r['rate']}/s", r) for r in lags]
    if any(r["cpu_cores"] for _, r in rows):
        table = Table("scenario", "poller(s)", "redis", "kafka", "etcd", "bench (+scheduler)", "others",
                      "machine busy", "EVALSHA/task", title="CPU while dispatching (average cores used)")
        for name, r in rows:
            cpu = r["cpu_cores"]
            if not cpu:
                continue
            pollers = sum(v for k, v in cpu.items() if k.startswith("poller"))
            table.add_row(name, f"{pollers:.2f}", *(f"{cpu.get(k, 0):.2f}" for k in ("redis", "kafka", "etcd")),
                          f"{cpu.get('bench', 0) + cpu.get('scheduler', 0):.2f}", f"{cpu['others']:.2f}",
                          f"{cpu['machine']:.2f} of {cpu['cores']:.0f}", f"{r['evalsha_per_task']:.2f}")
        console.print(table)
    if lags:
        table = Table("rate/s", "s", "scheduled", "delivered", "lost", "dup", "lag p50", "p99", "p99.9", "max",
                      "seen p50", "seen p99", "sched. behind max",
                      title="Lag: Kafka CreateTime - due time (1 poller); seen = received by a consumer - due time")
        for r in lags:
            s, seen = r["lag_ms"], r["consumer_seen_lag_ms"]
            table.add_row(f"{r['rate']:,}", f"{r['duration_s']:g}", f"{r['scheduled']:,}", f"{r['delivered']:,}",
                          str(r["lost"]), str(r["duplicates"]), f"{s['p50']:.0f} ms", f"{s['p99']:.0f} ms",
                          f"{s['p999']:.0f} ms", f"{s['max']:.0f} ms", f"{seen['p50']:.0f} ms", f"{seen['p99']:.0f} ms",
                          f"{(r['scheduler'] or {}).get('behind_ms', {}).get('max', float('nan')):.0f} ms")
        console.print(table)
        console.print("CreateTime is stamped when the poller calls produce(), so it excludes the broker; "
                      "'seen' includes it (and this consumer's fetch).")


def git_state() -> dict[str, Any]:
    """The commit benchmarked and the library files changed on top of it (the tree moves while we run)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=RESULTS.parent.parent, capture_output=True,
                              text=True).stdout.strip()
    return {"head": git("rev-parse", "--short", "HEAD"),
            "dirty": git("status", "--porcelain", "--", "celery_delayed").splitlines()}


def parse_args(argv: list[str] | None = None) -> tuple[Profile, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small profile: 20k tasks, rates 500,2000, 8 s")
    parser.add_argument("--tasks", type=int, help="preloaded due tasks for throughput (default 200000)")
    parser.add_argument("--backlog", type=int, default=0,
                        help="tasks due tomorrow stored beside them, e.g. 9000000 for 10M in the store (default 0)")
    parser.add_argument("--load", action="store_true", help="run each throughput scenario beside a busy neighbour too")
    parser.add_argument("--rates", help="comma-separated rates for the lag runs (default 1000,5000)")
    parser.add_argument("--duration", type=float, help="seconds each lag run schedules (default 20)")
    parser.add_argument("--partitions", type=int, default=8, help="store partitions (default 8, as config/)")
    parser.add_argument("--pollers", default="1,2", help="poller counts for throughput (default 1,2)")
    parser.add_argument("--skip", choices=["throughput", "lag"], action="append", default=[],
                        help="skip a scenario (repeatable)")
    parser.add_argument("--py-spy", action="store_true",
                        help="record every poller with py-spy (raw stacks next to the poller logs)")
    opts = parser.parse_args(argv)
    quick = opts.quick
    rates = opts.rates or ("500,2000" if quick else "1000,5000")
    profile = Profile(tasks=opts.tasks or (20_000 if quick else 200_000), backlog=opts.backlog,
                      rates=[int(r) for r in rates.split(",") if r.strip()],
                      duration=opts.duration or (8.0 if quick else 20.0), partitions=opts.partitions,
                      pollers=[int(p) for p in opts.pollers.split(",") if p.strip()])
    if (profile.tasks < 1 or not 0 <= profile.backlog <= 10_000_000 - profile.tasks
            or not 0 < profile.duration <= 600 or any(r < 1 or r > 100_000 for r in profile.rates)
            or any(p < 1 or p > 8 for p in profile.pollers)):
        parser.error("out of bounds: 1 <= tasks, tasks + backlog <= 10M, 0 < duration <= 600, "
                     "1 <= rate <= 100k, 1 <= pollers <= 8")
    return profile, opts


def main(argv: list[str] | None = None) -> int:
    profile, opts = parse_args(argv)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    logdir = RESULTS / f"dispatch-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)
    procs = Processes(logdir)
    throughputs: list[dict[str, Any]] = []
    lags: list[dict[str, Any]] = []
    errors: list[str] = []
    console.print(f"[bold]dispatch benchmark[/] {profile}; logs in {logdir}")
    context: dict[str, Any] = {"git": git_state(), "loadavg_start": os.getloadavg()}
    try:
        template = capture_template(profile.partitions)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            if "throughput" not in opts.skip:
                for n, loaded in [(n, loaded) for loaded in ((False, True) if opts.load else (False,))
                                  for n in profile.pollers]:
                    try:
                        result = throughput(template, profile, n, procs, progress, py_spy=opts.py_spy, loaded=loaded)
                    except RuntimeError as exc:  # e.g. a server restarted under us: keep the other results
                        errors.append(f"throughput, {n} poller(s){', loaded' if loaded else ''}: {exc}")
                        continue
                    result["py_spy_top"] = [profile_top(Path(raw)) for raw in result["py_spy"] if Path(raw).exists()]
                    throughputs.append(result)
            if "lag" not in opts.skip:
                for rate in profile.rates:
                    try:
                        lags.append(lag(template, profile, rate, procs, progress, py_spy=opts.py_spy))
                    except RuntimeError as exc:
                        errors.append(f"lag @ {rate}/s: {exc}")
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]")
        return 130
    finally:
        procs.stop_all()
    context["loadavg_end"] = os.getloadavg()
    report(throughputs, lags)
    for error in errors:
        console.print(f"[red]failed:[/] {error}")
    for r in throughputs + lags:
        if r["restarted"]:
            name = f"throughput, {r['pollers']} poller(s)" if "pollers" in r else f"lag @ {r['rate']}/s"
            console.print(f"[yellow]warning:[/] {', '.join(r['restarted'])} restarted during {name}: "
                          "its numbers are not representative")
    plot = None
    if lags:
        plot = plot_lags({f"{r['rate']}/s (n={r['delivered']})": r["points"] for r in lags},
                         RESULTS / f"dispatch-{stamp}.png",
                         f"celery-delayed dispatch lag, 1 poller, {profile.partitions} partitions")
    result = {"profile": dataclasses.asdict(profile), "argv": sys.argv, "started": stamp, "context": context,
              "claim_ceiling_per_s": CLAIM_CEILING, "errors": errors, "throughput": throughputs,
              "lag": [{k: v for k, v in r.items() if k not in ("lags", "points")} for r in lags],
              "plot": str(plot) if plot else None, "logs": str(logdir)}
    path = RESULTS / f"dispatch-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"results: {path}" + (f"\nplot: {plot}" if plot else ""))
    lost = sum(r["lost"] for r in throughputs + lags)
    return 1 if lost or errors else 0


if __name__ == "__main__":
    with exclusive("bench.dispatch"):
        sys.exit(main())
