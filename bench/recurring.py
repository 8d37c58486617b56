"""Recurring schedules at scale: celery-delayed's pollers, ``celery beat`` and celery-redbeat, each
measured by what it publishes, in one run on one machine.

For each size N (default 10k and 100k each due every minute; 1M spread over 10 minutes: 100k due each
minute, each schedule every 10 minutes) and system, one after the other:

- **celery-delayed**: N schedules ``bench:<i>`` running ``recurring.noop(i)`` by ``crontab(minute=...)``,
  created with ``celery_delayed.Schedules(app).upsert_many`` (``--upserters`` processes at once; ``--per-item``:
  by ``upsert``, one at a time) while two
  pollers (``celery -A tasks delayed poller``) run.  Each occurrence is read back from Kafka: lateness
  = its record's CreateTime - its nominal time (the poller sends up to ``delayed_dispatch_lead``, 0.5 s,
  early: the worker holds it until due, so a negative lateness is on time).  At the middle measured
  minute, ``--kill-after`` s after it, the poller leading the most partitions (etcd) gets ``kill -9``
  and is started again at once, as a supervisor would.
- **beat**: ``celery beat`` with its default ``PersistentScheduler`` and the same N entries in
  ``beat_schedule`` (bench.recurring_app); **redbeat**: the same with ``-S`` celery-redbeat.  Both send
  to a Redis broker (the benchmark's own server, emptied every second); lateness = when ``apply_async``
  returned - the entry's nominal time (the crontab's first time after its last run).

Every system: the measured minutes are the ``--cycles`` minute boundaries after it is set up; for each,
the occurrences due then (N, or N / 10 at 1M) are looked for until ``--grace`` s after the last one (a
system's wall time is capped there): missed = due and not published by then, twice = published twice
(same occurrence: a worker runs a task id once, so celery-delayed's would not run twice).  Redis bytes
per schedule: INFO ``used_memory`` after the schedules were set up minus before, / N, on a Redis server
of the benchmark's own (AOF every second, as scripts/services runs it), so no other client counts; for
beat, its shelve file's size / N.  Etcd and Kafka are the shared servers, under prefixes of the run.

    python -m bench.recurring [--quick] [--sizes 10000 100000 1000000] [--systems celery-delayed beat redbeat]
                              [--cycles K] [--grace S] [--upserters P] [--per-item]

``--quick``: 10k only, 2 minutes per system.  Writes bench/results/recurring-<time>.md, .json, .png
(lateness over time, a panel per size) and keeps the processes' logs and beat's sends in
recurring-<time>.logs/; a full run also as recurring-latest.*.  Exits 1 when
celery-delayed missed an occurrence.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis
from confluent_kafka import TopicPartition
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import (RESULTS, CpuMeter, exclusive, make_consumer, new_overrides, percentile, save_figure,
    topic_partitions, versions)
from bench.dispatch import git_state
from bench.recurring_app import minutes_of
from celery_delayed.envelope import Envelope
from celery_delayed.kafka import DUE_HEADER, ensure_topics
from celery_delayed.poller.leadership import make_etcd
from celery_delayed.recurring.occurrences import NOMINAL_HEADER
from celery_delayed.sandbox import remove_everything
from celery_delayed.settings import Settings
from celery_delayed.store.keys import Keys
from tasks.processes import Processes, free_port, wait_for

console = Console(width=None if Console().is_terminal else 170)
SYSTEMS = ("celery-delayed", "beat", "redbeat")
#: Store partitions, as a deployment of this size would have (bench.scale's).
PARTITIONS = 16
MINUTE_MS = 60_000
#: The poller's log line once it may lead partitions (local time, as logged).
STARTED = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/celery_delayed.poller.loop\] poller \S+ started")
#: The first measured minute is at least this long after a system is set up.
SETTLE_S = 5.0


# -- the benchmark's own Redis ------------------------------------------------------------
class OwnRedis:
    """A redis-server of the benchmark's (a free port, a temporary directory, AOF every second as
    scripts/services runs Redis), stopped by PID: INFO memory counts only the run's keys."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.dir)],
                                     stdout=(self.dir / "log").open("wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"redis://127.0.0.1:{self.port}"
        self.client = redis.Redis.from_url(self.url + "/0")
        wait_for(self._pong, 10, f"redis-server on port {self.port}")

    def _pong(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def used(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- what was published --------------------------------------------------------------------
class Published:
    """Publications of one system: ``(schedule or occurrence key, nominal ms) -> [published ms, ...]``."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, int], list[int]] = {}
        self.distinct: Counter[int] = Counter()  # nominal ms -> occurrences published
        self.lock = threading.Lock()

    def add(self, key: str, nominal_ms: int, published_ms: int) -> None:
        with self.lock:
            times = self.times.setdefault((key, nominal_ms), [])
            times.append(published_ms)
            self.distinct[nominal_ms] += len(times) == 1

    def count(self, nominals: set[int]) -> int:
        with self.lock:
            return sum(self.distinct[nominal] for nominal in nominals)


class KafkaReader(threading.Thread):
    """Reads celery-delayed's topic: each record's key (the occurrence's task id, derived from its
    schedule id and nominal time), the occurrence's nominal time (its message's header: a record's due
    header is when its copy was last made due, which for a copy that a killed poller left in flight is
    when the visibility timeout gave it back) and its CreateTime."""

    def __init__(self, settings: Settings, topic: str, published: Published) -> None:
        super().__init__(daemon=True, name="recurring-kafka")
        self.consumer = make_consumer(settings)
        self.consumer.assign([TopicPartition(topic, p, 0) for p in topic_partitions(settings, topic)])
        self.published, self.done = published, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for record in self.consumer.consume(num_messages=10_000, timeout=0.2):
                if record.error():
                    continue
                if DUE_HEADER not in dict(record.headers() or ()):
                    continue
                nominal = Envelope.decode(record.value()).headers.get(NOMINAL_HEADER)
                if nominal is not None:
                    self.published.add((record.key() or b"").decode(), int(nominal), record.timestamp()[1])
        self.consumer.close()

    def stop(self) -> None:
        self.done.set()
        self.join(30)


class SendsReader(threading.Thread):
    """Tails the file bench.recurring_app's scheduler appends its sends to."""

    def __init__(self, path: Path, published: Published) -> None:
        super().__init__(daemon=True, name="recurring-sends")
        self.path, self.published, self.done = path, published, threading.Event()
        self.ready_ms: int | None = None

    def run(self) -> None:
        self.path.touch()
        with self.path.open() as lines:
            rest = ""
            while True:
                chunk = lines.read()
                if not chunk:
                    if self.done.is_set():
                        return
                    time.sleep(0.1)
                    continue
                *complete, rest = (rest + chunk).split("\n")
                for line in complete:
                    first, second, *third = line.split()
                    if first == "ready":
                        self.ready_ms = int(second)
                    elif second != "-":  # "-": an entry that never ran, sent at once (not measured)
                        self.published.add(first, int(second), int(third[0]))

    def stop(self) -> None:
        time.sleep(0.3)  # the last lines written
        self.done.set()
        self.join(30)


class QueueEmptier(threading.Thread):
    """Empties the beat broker's queue every second (no worker reads it; the server's memory stays flat)."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        super().__init__(daemon=True, name="recurring-emptier")
        self.client, self.queue, self.done = client, queue, threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.client.unlink(self.queue)

    def stop(self) -> None:
        self.done.set()
        self.join(10)


# -- one system, one size ------------------------------------------------------------------
def boundaries_after(ms: float, count: int) -> list[int]:
    """The ``count`` minute boundaries (epoch ms) from the first at least :data:`SETTLE_S` after ``ms``."""
    first = math.ceil((ms + SETTLE_S * 1000) / MINUTE_MS) * MINUTE_MS
    return [first + k * MINUTE_MS for k in range(count)]


def due_at(indices: list[range], spread: int, boundary_ms: int) -> int:
    """How many of the schedules ``indices`` are due at a minute boundary (those of its minute, spread over
    ``spread``: schedule i runs at the minutes ``i % spread`` modulo ``spread``)."""
    minute = (boundary_ms // MINUTE_MS) % spread
    return sum(len(range(r.start + (minute - r.start) % spread, r.stop, spread)) for r in indices)


def sleep_until(ms: float, check: Any = None) -> None:
    while (left := ms / 1000 - time.time()) > 0:
        time.sleep(min(left, 0.5))
        if check:
            check()


def wait_published(published: Published, nominals: list[int], expected: int, until_ms: float, progress: Progress,
                   label: str, check: Any = None) -> None:
    """Until every expected publication of ``nominals`` came, or ``until_ms`` (epoch ms)."""
    job = progress.add_task(label, total=expected)
    wanted = set(nominals)
    while time.time() * 1000 < until_ms:
        done = published.count(wanted)
        progress.update(job, completed=done)
        if done >= expected:
            break
        time.sleep(0.5)
        if check:
            check()
    progress.update(job, visible=False)


def measure(published: Published, indices: list[range], spread: int, nominals: list[int],
            kill_ms: int | None) -> dict[str, Any]:
    """Lateness (ms; the first publication of each occurrence) per measured minute, missed, twice."""
    expected = sum(due_at(indices, spread, b) for b in nominals)
    wanted = set(nominals)
    with published.lock:
        mine = {key: times for key, times in published.times.items() if key[1] in wanted}
    lags = sorted(min(times) - nominal for (_, nominal), times in mine.items())
    points = [(round((min(times) - nominals[0]) / 1000, 3), min(times) - nominal)
              for (_, nominal), times in mine.items()]
    per_minute = Counter(nominal for _, nominal in mine)
    twice = Counter(nominal for (_, nominal), times in mine.items() if len(times) > 1)
    first = [min(times) for (_, nominal), times in mine.items() if nominal == nominals[0]]
    span_s = (max(first) - min(nominals[0], min(first))) / 1000 if first else math.nan
    return {"expected": expected, "published": len(mine), "missed": expected - len(mine),
            "twice": sum(twice.values()), "twice_per_minute": {str(b): twice.get(b, 0) for b in nominals},
            "first_minute_per_s": round(len(first) / span_s) if span_s and not math.isnan(span_s) else None,
            "p50": percentile(lags, 0.5), "p99": percentile(lags, 0.99), "max": lags[-1] if lags else math.nan,
            "per_minute": {str(b): per_minute.get(b, 0) for b in nominals},
            "kill_at_s": None if kill_ms is None else round((kill_ms - nominals[0]) / 1000, 3),
            "points": points}


def _upsert_range(overrides: dict[str, Any], spread: int, start: int, stop: int, until: float, bulk: bool) -> range:
    """``Schedules.upsert`` schedules ``bench:<start..stop>`` (a process of the pool: its own app), none
    from ``until`` (epoch s) on; returns the indices upserted.  ``bulk``: by ``Schedules.upsert_many``."""
    import logging

    from celery.schedules import crontab

    from bench.recurring_app import noop
    from celery_delayed import Schedules
    from tasks import create_app

    logging.getLogger("celery_delayed").setLevel(logging.WARNING)  # one INFO line per upsert otherwise
    app = create_app(**overrides)
    app.task(name="recurring.noop")(noop)  # a task of the app, as a user's is (its signatures' shape is known)
    schedules = Schedules(app)
    if bulk:
        items = ((f"bench:{i}", app.signature("recurring.noop", args=(i,)), crontab(minute=minutes_of(i, spread)))
                 for i in itertools.takewhile(lambda _: time.time() < until, range(start, stop)))
        return range(start, start + schedules.upsert_many(items))
    for i in range(start, stop):
        if time.time() >= until:
            return range(start, i)
        schedules.upsert(f"bench:{i}", app.signature("recurring.noop", args=(i,)),
                         crontab(minute=minutes_of(i, spread)))
    return range(start, stop)


def run_delayed(n: int, spread: int, opts: argparse.Namespace, own: OwnRedis, progress: Progress,
                logdir: Path) -> dict[str, Any]:
    overrides = {**new_overrides(partitions=PARTITIONS), "delayed_redis_url": own.url + "/0",
                 "broker_url": own.url + "/1"}
    settings = Settings.from_conf(overrides)
    topic = settings.topic(overrides["task_default_queue"])
    ensure_topics(settings, [overrides["task_default_queue"]])
    procs = Processes(logdir, overrides)
    published = Published()
    reader = KafkaReader(settings, topic, published)
    result: dict[str, Any] = {"system": "celery-delayed", "n": n}
    try:
        reader.start()
        pollers = [procs.poller(), procs.poller()]
        crashes: list[str] = result.setdefault("poller_crashes", [])

        def check() -> None:
            """A poller that exited by itself is noted and started again, as a supervisor would."""
            for k, proc in enumerate(pollers):
                if proc.poll() is not None:
                    crashes.append(f"{time.strftime('%H:%M:%S')} exit {proc.returncode}: "
                                   f"{procs.log(proc).strip().splitlines()[-1][:200]}")
                    pollers[k] = procs.poller()

        wait_for(lambda: len(set(leaders(settings).values())) == 2, 60, "both pollers to lead partitions")
        before = own.used()
        job = progress.add_task(f"celery-delayed {n:,}: Schedules.{'upsert' if opts.per_item else 'upsert_many'}",
                                total=n)
        began = time.perf_counter()
        step = math.ceil(n / opts.upserters)
        with ProcessPoolExecutor(opts.upserters, mp_context=multiprocessing.get_context("spawn")) as pool:
            until = time.time() + opts.create_cap
            futures = [pool.submit(_upsert_range, overrides, spread, k, min(n, k + step), until,
                                   not opts.per_item)
                       for k in range(0, n, step)]
            while not all(f.done() for f in futures):
                progress.update(job, completed=definitions(own.client, settings))
                time.sleep(0.5)
                check()
            indices = [future.result() for future in futures]
        created_s, created = time.perf_counter() - began, sum(map(len, indices))
        progress.update(job, visible=False)
        result.update(create_path="upsert" if opts.per_item else "upsert_many", create_s=round(created_s, 1),
                      create_per_s=round(created / created_s), created=created,
                      bytes_per_schedule=round((own.used() - before) / created))
        nominals = boundaries_after(time.time() * 1000, opts.cycles)
        kill_ms: int | None = None
        restarted: tuple[subprocess.Popen, float] | None = None

        meter = CpuMeter({})
        for k, nominal in enumerate(nominals):
            sleep_until(nominal, check)
            if k == 0:
                meter.start()
            if k == len(nominals) // 2 and opts.kill_after >= 0:
                sleep_until(nominal + opts.kill_after * 1000)
                led = Counter(leaders(settings).values())
                victim = next(p for p in pollers if p.pid == led.most_common(1)[0][0])
                os.killpg(victim.pid, signal.SIGKILL)
                kill_ms = int(time.time() * 1000)
                victim.wait()
                result["killed"] = {"pid": victim.pid, "partitions": led[victim.pid], "of": PARTITIONS}
                pollers.remove(victim)
                pollers.append(procs.poller())
                restarted = (pollers[-1], time.time())
        expected = sum(due_at(indices, spread, b) for b in nominals)
        wait_published(published, nominals, expected, nominals[-1] + opts.grace * 1000, progress,
                       f"celery-delayed {n:,}: occurrences", check)
        time.sleep(1)  # a second copy may still come
        result.update(measure(published, indices, spread, nominals, kill_ms), busy_cores=meter.stop()["machine"],
                      load_1m=round(os.getloadavg()[0], 1))
        if restarted is not None:
            result["killed"]["restart_up_after_s"] = started_after(procs.log(restarted[0]), restarted[1])
        return result
    finally:
        reader.stop()
        procs.stop_all()
        try:
            remove_everything(settings, [topic])
        except Exception as exc:  # the shared Kafka restarted under the run, say: the run's figures stay
            console.print(f"[red]could not remove topic {topic} and prefix {settings.key_prefix}: {exc}")


def run_beat(system: str, n: int, spread: int, opts: argparse.Namespace, store: OwnRedis, broker: OwnRedis,
             progress: Progress, logdir: Path) -> dict[str, Any]:
    """``celery beat`` (``PersistentScheduler``) or RedBeat with N entries; what it sent."""
    sends, shelf = logdir / f"{system}-{n}.sends", logdir / f"{system}-{n}.schedule"
    env = {"RECURRING_N": str(n), "RECURRING_SPREAD": str(spread), "RECURRING_SENDS": str(sends),
           "RECURRING_BROKER": broker.url + "/0", "RECURRING_REDBEAT": store.url + "/0", "RECURRING_SYSTEM": system}
    scheduler = ("bench.recurring_app:RecordingRedBeatScheduler" if system == "redbeat"
                 else "bench.recurring_app:RecordingPersistentScheduler")
    procs = Processes(logdir, app="bench.recurring_app")
    published = Published()
    reader = SendsReader(sends, published)
    emptier = QueueEmptier(broker.client, "celery")
    result: dict[str, Any] = {"system": system, "n": n}
    before = store.used()
    began = time.time()
    try:
        reader.start()
        emptier.start()
        proc = procs.start(system, "beat", "-S", scheduler, "-s", str(shelf), "-l", "WARNING", env=env)

        def check() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"{system} exited: {procs.log(proc)[-1500:]}")

        job = progress.add_task(f"{system} {n:,}: set up", total=None)
        cap = time.time() + opts.setup_cap
        while reader.ready_ms is None and time.time() < cap:
            time.sleep(0.5)
            check()
        progress.update(job, visible=False)
        if reader.ready_ms is None:
            result.update(failed=f"not set up within {opts.setup_cap:.0f} s", expected=0)
            return result
        result.update(create_s=round((reader.ready_ms / 1000 - began), 1),
                      create_per_s=round(n / max(reader.ready_ms / 1000 - began, 1e-3)))
        if system == "redbeat":
            broker.client.unlink("celery")
            result["bytes_per_schedule"] = round((store.used() - before) / n)
        else:
            files = [p for p in logdir.glob(f"{shelf.name}*") if p.is_file()]
            result["bytes_per_schedule"] = round(sum(p.stat().st_size for p in files) / n)
        nominals = boundaries_after(time.time() * 1000, opts.cycles)
        expected = sum(due_at([range(n)], spread, b) for b in nominals)
        sleep_until(nominals[0], check)
        meter = CpuMeter({})
        meter.start()
        wait_published(published, nominals, expected, nominals[-1] + opts.grace * 1000, progress,
                       f"{system} {n:,}: sends", check)
        result.update(measure(published, [range(n)], spread, nominals, None), busy_cores=meter.stop()["machine"],
                      load_1m=round(os.getloadavg()[0], 1))
        result["rss_mb"] = _rss_mb(proc.pid)
        return result
    finally:
        procs.stop_all()
        reader.stop()
        emptier.stop()
        if system == "redbeat":
            for key in store.client.scan_iter(match="rbbench*", count=1000):
                store.client.unlink(key)
        broker.client.unlink("celery")


def started_after(log: str, since: float) -> float | None:
    """Seconds from ``since`` (epoch s) to the poller's "started" log line (after its beat_schedule sync,
    before it leads a partition); None when it never logged it."""
    for line in log.splitlines():
        if match := STARTED.match(line):
            return round(datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - since, 1)
    return None


def _rss_mb(pid: int) -> float:
    try:
        return round(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except OSError:
        return math.nan


def leaders(settings: Settings) -> dict[int, int]:
    """Partition -> PID of the poller leading it, from etcd (as tests/integration/support.leaders)."""
    return {int(meta.key.decode().rsplit("/", 1)[1]): int(value.decode().rsplit("-", 2)[1])
            for value, meta in make_etcd(settings).get_prefix(Keys(settings.key_prefix).leaders())}


def definitions(client: redis.Redis, settings: Settings) -> int:
    """Recurring definitions stored (progress of the upserts)."""
    keys = Keys(settings.key_prefix)
    pipe = client.pipeline(transaction=False)
    for partition in range(settings.partitions):
        pipe.hlen(keys.recurring(partition))
    return sum(pipe.execute())


# -- report --------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.0f}"


def _s(value: float | None) -> str:
    return "(not within the run)" if value is None else f"{value} s"


def report(results: list[dict[str, Any]], opts: argparse.Namespace, found: dict[str, str], show: bool) -> str:
    """The results as Markdown (printed as a table with ``show``)."""
    head = ["schedules", "system", "set up (s, per s)", "occurrences due (minutes)", "first minute published at",
            "lateness p50 / p99 / max ms",
            "missed", "published twice", "bytes per schedule", "kill -9 of the leading poller",
            "busy cores of 2 (load 1 min)"]
    rows = []
    for r in results:
        if r.get("failed"):
            rows.append([f"{r['n']:,}", r["system"], f"failed: {r['failed']}", *["—"] * (len(head) - 3)])
            continue
        where = "Redis" if r["system"] != "beat" else "shelve file"
        killed = r.get("killed")
        made = f"; {r['created']:,} made within the cap" if r.get("created", r["n"]) < r["n"] else ""
        rows.append([f"{r['n']:,}", r["system"], f"{r['create_s']:,} s ({r['create_per_s']:,}/s{made})",
                     f"{r['expected']:,} ({len(r['per_minute'])})",
                     "—" if r["first_minute_per_s"] is None else f"{r['first_minute_per_s']:,}/s",
                     f"{_ms(r['p50'])} / {_ms(r['p99'])} / {_ms(r['max'])}", f"{r['missed']:,}", f"{r['twice']:,}",
                     f"{r['bytes_per_schedule']:,} ({where})",
                     f"{killed['partitions']} of {killed['of']} partitions, {r['kill_at_s']} s after the first "
                     f"minute; restarted: up after {_s(killed.get('restart_up_after_s'))}" if killed else "—",
                     f"{r['busy_cores']} ({r['load_1m']})"])
    title = (f"bench.recurring: {opts.cycles} minutes measured per system; grace {opts.grace:g} s after the last; "
             "2 pollers")
    if show:
        table = Table(*head, title=title)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(row) + " |" for row in rows), "",
             "Lateness: celery-delayed, the Kafka record's CreateTime - the occurrence's nominal time (the poller "
             "sends up to delayed_dispatch_lead = 0.5 s early; the worker holds it until due); beat and RedBeat, "
             "when apply_async returned (the Redis broker has it) - the crontab's first time after the entry's last "
             "run.  Missed: due in a measured minute and not published within the grace.  Published twice: the "
             "same occurrence twice (celery-delayed: one task id, which a worker runs once).  Bytes per schedule: "
             "INFO used_memory delta / N on the benchmark's own Redis (beat: its shelve file / N).  Set up: "
             f"celery-delayed, Schedules.{'upsert' if opts.per_item else 'upsert_many'} of the N schedules (with "
             f"{opts.upserters} processes); beat and RedBeat, from start until the scheduler has set its schedule "
             "up.", "",
             *(f"- {r['system']} {r['n']:,}: a poller exited by itself (started again): {crash}"
               for r in results for crash in r.get("poller_crashes", ())), "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in found.items())]
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Each occurrence's lateness over the run, a panel per size, a series per system, the kill marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["n"] for r in results})
    fig, axes = plt.subplots(len(sizes), 1, figsize=(14, 4.5 * len(sizes)), squeeze=False)
    for ax, n in zip(axes.flat, sizes):
        for r in results:
            if r["n"] != n or r.get("failed"):
                continue
            points = r["points"]
            ax.plot([t for t, _ in points], [lag for _, lag in points], ".", markersize=1.5, alpha=0.4,
                    label=f"{r['system']} (p99 {_ms(r['p99'])} ms, missed {r['missed']:,})")
            if r.get("kill_at_s") is not None:
                ax.axvline(r["kill_at_s"], color="red", linestyle="--", linewidth=0.8, label="kill -9 of a poller")
        ax.set(title=f"{n:,} schedules", xlabel="published, s after the first measured minute",
               ylabel="lateness ms (symlog)")
        ax.set_yscale("symlog", linthresh=100)
    return save_figure(fig, axes.flat, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.recurring", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k schedules, 2 minutes per system")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--cycles", type=int, default=3, help="minutes measured per system")
    parser.add_argument("--grace", type=float, default=50.0, help="s after the last measured minute (the cap)")
    parser.add_argument("--kill-after", type=float, default=0.3,
                        help="s after the middle minute to kill -9 the leading poller (negative: no kill)")
    parser.add_argument("--upserters", type=int, default=2, help="processes calling Schedules.upsert_many")
    parser.add_argument("--per-item", action="store_true",
                        help="create the schedules by Schedules.upsert, one at a time (default: upsert_many)")
    parser.add_argument("--create-cap", type=float, default=600.0,
                        help="most s of Schedules.upsert calls (celery-delayed: the schedules made by then are run)")
    parser.add_argument("--setup-cap", type=float, default=600.0, help="most s for beat or RedBeat to set up")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.sizes, opts.cycles, opts.grace = [10_000], 2, 35.0  # > delayed_visibility_timeout: the kill's copies
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM: the processes and servers stopped
    with exclusive("bench.recurring"), tempfile.TemporaryDirectory(prefix="bench-recurring-") as tmp:
        found = {**versions(), "celery-redbeat": metadata.version("celery-redbeat")}
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = RESULTS / f"recurring-{stamp}{'-quick' if opts.quick else ''}"
        logdir = base.with_suffix(".logs")
        logdir.mkdir()
        store, broker = OwnRedis(Path(tmp)), OwnRedis(Path(tmp))
        results: list[dict[str, Any]] = []
        began = time.monotonic()

        def save(show: bool) -> None:
            """The results so far (after each system: a run cut short keeps what it measured)."""
            base.with_suffix(".md").write_text(report(results, opts, found, show))
            base.with_suffix(".json").write_text(json.dumps(
                {"versions": found, "git": git_state(), "options": vars(opts),
                 "wall_s": round(time.monotonic() - began),
                 "results": [{k: v for k, v in r.items() if k != "points"} for r in results]}, indent=1, default=str))

        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as progress:
                for n in opts.sizes:
                    spread = 10 if n >= 1_000_000 else 1
                    for system in opts.systems:
                        if system != "celery-delayed" and n >= 1_000_000:
                            continue  # beat and RedBeat at 10k and 100k only
                        try:
                            results.append(run_delayed(n, spread, opts, store, progress, logdir)
                                           if system == "celery-delayed" else
                                           run_beat(system, n, spread, opts, store, broker, progress, logdir))
                        except RuntimeError as exc:  # a process of the system exited: its row says why
                            results.append({"system": system, "n": n, "failed": str(exc)[:300]})
                        r = results[-1]
                        console.print(f"{system} {n:,}: p50/p99/max {_ms(r.get('p50'))}/{_ms(r.get('p99'))}/"
                                      f"{_ms(r.get('max'))} ms, missed {r.get('missed', '—')}, "
                                      f"twice {r.get('twice', '—')}, {r.get('bytes_per_schedule', '—')} B/schedule")
                        save(show=False)
        finally:
            store.stop()
            broker.stop()
            save(show=True)
            if results:
                plot(results, base.with_suffix(".png"))
        if not opts.quick:
            for suffix in (".md", ".json", ".png"):
                shutil.copyfile(base.with_suffix(suffix), RESULTS / f"recurring-latest{suffix}")
        console.print(f"results: {base}.md, .json, .png; logs in {logdir}/ ({time.monotonic() - began:.0f} s)")
        return 1 if any(r["system"] == "celery-delayed" and r.get("missed") for r in results) else 0

if __name__ == "__main__":
    sys.exit(main())
