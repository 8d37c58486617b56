"""Celery workers coming and going while ETA tasks fall due: a rolling restart, a kill -9, a
scale-out and a scale-in under a steady load, for Celery's own ETA and for celery-delayed.

What a user running a fleet would try: N workers (``celery worker -c 1``) of one app consume one
queue while a client thread sends ``compare.noop`` (bench.compare_app: it records each task's first
start, how often it ran and the worker that started it) one task at a time with
``apply_async(countdown=...)``, R tasks a second for the whole run.  Meanwhile these events happen,
``--settle`` s apart, each timestamped:

1. **rolling**: each worker in turn gets SIGTERM to its main process (a warm shutdown, as
   ``Processes.warm_stop`` sends it; with ``--stop group``, to its whole process group, as systemd's
   ``KillMode=control-group`` and supervisord's ``stopasgroup`` do: a pool child dies mid-task), then a
   new worker is started and waited for ("ready."), then the next;
2. **kill9**: SIGKILL to one worker's whole process group, and a replacement started at once;
3. **scale-out**: N more workers (2N);
4. **scale-in**: N of them stopped warm at once (N again).

Then the client stops, and the tasks are waited for until ``--grace`` s past the last due time.
A task belongs to the phase during which it was due (**steady**: before the first event).

Systems, one after the other with the same load and churn, each with a key and topic prefix,
consumer group and queue of its own (``new_overrides``), removed afterwards:

- **native**: Celery's ETA on the Redis broker (a worker holds a task from its sending until due);
- **celery-delayed (classic)**: one poller, the workers reading Kafka, ``delayed_group_protocol = "classic"``;
- **celery-delayed (consumer)**: the same with ``delayed_group_protocol = "consumer"`` (KIP-848); with
  ``--raw-protocol`` also ``delayed_kafka_config = {"group.protocol": "consumer"}``, librdkafka's own
  switch, for versions of celery-delayed without that setting.

Reported per system and phase: tasks, lateness (first start - due) p50/p99/max, on time (started
<= 1 s after due), more than 5 s late; per system: not run by the end, run twice, the tasks each
worker started while the fleet was scaled out, the machine's load; and the goals, as information
(not assertions): rolling p99 <= max(250 ms, 1.5 x native's rolling p99) and max <= 2 s; every
task not started at the kill -9, or due before the next event, started within 15 s of due; no idle
worker once scaled out.  A system whose workers all exited (or whose poller did) is reported as
failed, with the reason its log gives.

    python -m bench.fleet [--quick] [--workers 4] [--rate 30] [--countdown 3] [--settle 10]
                          [--systems native classic consumer] [--raw-protocol]
                          [--pool prefork|gevent|eventlet] [--stop main|group]

``--pool``: every worker's pool (prefork ``-c 1`` by default; gevent or eventlet ``-c 50``), the same
for every system.

Writes bench/results/fleet-<time>.json, .md and .png (each task's lateness over its due time, a
panel per system, the events marked) and keeps the processes' logs in fleet-<time>.logs/; a full
run also as fleet-latest.*.  Exits 1 when a celery-delayed system failed or left a task not run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import RESULTS, CpuMeter, exclusive, new_overrides, percentile, save_figure, versions
from bench.compare import System, _clean, _ms, wait_runs
from bench.compare_app import RECORDS, create_app, read_run, read_starts
from bench.dispatch import git_state
from celery_delayed.settings import Settings
from tasks.processes import Processes, wait_for

console = Console(width=None if Console().is_terminal else 160)
PHASES = ("steady", "rolling", "kill9", "scale-out", "scale-in")
#: The worker command of each ``--pool``.
POOLS = {"prefork": ("-c", "1"), "threads": ("--pool", "threads", "-c", "1"), "solo": ("--pool", "solo"),
         "gevent": ("--pool", "gevent", "-c", "50"), "eventlet": ("--pool", "eventlet", "-c", "50")}
ON_TIME_MS = 1000
LATE_MS = 5000
#: The kill -9 goal: every task outstanding then started within this long of its due time.
KILL_GOAL_MS = 15_000
#: What ``-n NAME@%h`` makes of a worker's name (its ``task.request.hostname``).
HOST = socket.gethostname()


def systems(opts: argparse.Namespace) -> dict[str, System]:
    """The systems by their ``--systems`` key; ``delayed_group_protocol`` is said to be ignored where
    this version of celery-delayed has no such setting."""
    known = {f.name for f in dataclasses.fields(Settings)}
    ignored = "" if "group_protocol" in known else " (not a setting of this version: ignored)"
    consumer = {"delayed_group_protocol": "consumer"}
    how = f'delayed_group_protocol = "consumer"{ignored}'
    if opts.raw_protocol:
        consumer["delayed_kafka_config"] = {"group.protocol": "consumer"}
        how += ', delayed_kafka_config = {"group.protocol": "consumer"}'
    return {"native": System("native", "Celery ETA on the Redis broker", "native"),
            "classic": System("celery-delayed (classic)", f'one poller; delayed_group_protocol = "classic"{ignored}',
                              "celery-delayed", {"delayed_group_protocol": "classic"}),
            "consumer": System("celery-delayed (consumer)", f"one poller; {how}", "celery-delayed", consumer)}


# -- the fleet -----------------------------------------------------------------
class SystemFailed(RuntimeError):
    """The system cannot go on: every worker exited, or the poller did."""


@dataclass
class Member:
    """One worker process of the fleet."""

    name: str
    proc: subprocess.Popen
    started: float  # epoch s
    ready: float | None = None
    ended: float | None = None
    how: str = ""  # how it ended (empty while it is counted live)

    @property
    def hostname(self) -> str:
        return f"{self.name}@{HOST}"


def reason(log: str) -> str:
    """What a process's log says made it stop: its last CRITICAL or ERROR line (less its time), else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    bad = [line for line in lines if "CRITICAL/" in line or "ERROR/" in line]
    return re.sub(r"^\[[^]]*\] ", "", (bad or lines or ["(empty log)"])[-1])[:400]


#: A worker's log line saying which Kafka partitions it was given or lost (celery_delayed.worker.consumer).
_PARTITIONS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/MainProcess\] "
                         r"(?:assigned Kafka partitions (\[.*\])|Kafka partitions (\[.*\]) revoked)")


class Fleet:
    """The workers of one system (``celery worker -c 1`` of its queue, named f1, f2... in start order)."""

    def __init__(self, procs: Processes, env: dict[str, str], timeout: float, pool: str = "prefork",
                 stop: str = "main") -> None:
        self.procs, self.env, self.timeout = procs, env, timeout
        self.args, self.group_stop = POOLS[pool], stop == "group"
        self.members: list[Member] = []
        self.poller: subprocess.Popen | None = None

    def live(self) -> list[Member]:
        return [m for m in self.members if not m.how]

    def start(self, count: int) -> list[Member]:
        """Start ``count`` workers at once; return when each is ready (or has exited)."""
        new = []
        for _ in range(count):
            name = f"f{len(self.members) + 1}"
            new.append(Member(name, self.procs.worker(name, *self.args, env=self.env), time.time()))
            self.members.append(new[-1])
        try:
            wait_for(lambda: all(self._settled(m) for m in new), self.timeout, "the new workers to be ready")
        except AssertionError as exc:
            raise SystemFailed(str(exc)) from None
        self.check()
        return new

    def _settled(self, member: Member) -> bool:
        if member.ready is None and "ready." in self.procs.log(member.proc):
            member.ready = time.time()
        return member.ready is not None or member.proc.poll() is not None

    def stop(self, members: list[Member]) -> None:
        """Warm-stop ``members`` at once: SIGTERM to each main process (``systemctl stop`` with
        ``KillMode=mixed``, ``docker stop``), or with ``--stop group`` to each whole process group."""
        for member in members:
            member.how = "group SIGTERM" if self.group_stop else "warm stop"
        with ThreadPoolExecutor(len(members)) as pool:
            statuses = list(pool.map(self._group_stop if self.group_stop else self.procs.warm_stop,
                                     [m.proc for m in members]))
        for member, status in zip(members, statuses):
            member.ended = time.time()
            if status:
                member.how += f" (exit status {status})"

    def _group_stop(self, proc: subprocess.Popen, timeout: float = 60.0) -> int:
        """SIGTERM to ``proc``'s whole process group; SIGKILL to it after ``timeout``.  Its exit status."""
        os.killpg(proc.pid, signal.SIGTERM)  # each worker leads its own session (Processes.start)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def kill(self, member: Member) -> None:
        """SIGKILL to the worker's whole process group (its main process and pool)."""
        member.how = "kill -9"
        os.killpg(member.proc.pid, signal.SIGKILL)  # each worker leads its own session (Processes.start)
        member.proc.wait()
        member.ended = time.time()

    def check(self) -> None:
        """Mark the workers that exited by themselves; fail once none is left, or when the poller exited."""
        for member in self.live():
            if member.proc.poll() is not None:
                member.ended = time.time()
                member.how = f"exited ({member.proc.returncode}): {reason(self.procs.log(member.proc))}"
        if self.poller is not None and self.poller.poll() is not None:
            raise SystemFailed(f"the poller exited ({self.poller.returncode}): {reason(self.procs.log(self.poller))}")
        if not self.live():
            raise SystemFailed(f"every worker exited; the last one {self.members[-1].how}")

    def partition_gaps(self) -> list[tuple[float, float]]:
        """When a topic partition had no live owner, from the workers' logs: ``(from, until)`` epoch s,
        from its revoke (or its owner's end: a worker killed -9 logs none) until it was assigned again."""
        owned: list[tuple[int, float, float]] = []
        for member in self.members:
            held: dict[int, float] = {}
            for line in self.procs.log(member.proc).splitlines():
                if not (match := _PARTITIONS.match(line)):
                    continue
                at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged
                for partition in map(int, re.findall(r"\[(\d+)\]'", match[2] or match[3])):
                    if match[2]:
                        held[partition] = at
                    elif partition in held:
                        owned.append((partition, held.pop(partition), at))
            owned += [(partition, since, member.ended or time.time()) for partition, since in held.items()]
        gaps = []
        for partition in {p for p, _, _ in owned}:
            spans = sorted((since, until) for p, since, until in owned if p == partition)
            reach = spans[0][1]
            for since, until in spans[1:]:
                if since > reach:
                    gaps.append((reach, since))
                reach = max(reach, until)
        return gaps

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, watching the fleet meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
            self.check()


class Sender(threading.Thread):
    """``noop.apply_async((run, due_ms), countdown=...)`` ``rate`` times a second from a thread of its
    own until :meth:`stop`; keeps each task's id and due time (ms)."""

    def __init__(self, noop: Any, run: str, rate: float, countdown: float) -> None:
        super().__init__(daemon=True, name="fleet-sender")
        self.noop, self.run_id, self.rate, self.countdown = noop, run, rate, countdown
        self.sent: list[tuple[str, int]] = []
        self.behind_s = 0.0  # the most the sending fell behind its schedule
        self.error: str | None = None
        self._done = threading.Event()

    def run(self) -> None:
        began = time.monotonic()
        try:
            while not self._done.is_set():
                wait = began + len(self.sent) / self.rate - time.monotonic()
                if wait > 0 and self._done.wait(wait):
                    break
                self.behind_s = max(self.behind_s, -wait)
                due_ms = int((time.time() + self.countdown) * 1000)
                result = self.noop.apply_async((self.run_id, due_ms), countdown=self.countdown)
                self.sent.append((result.id, due_ms))
        except Exception as exc:  # reported with the system's results
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()


# -- one system ----------------------------------------------------------------
def churn(fleet: Fleet, sender: Sender, opts: argparse.Namespace, events: list[dict[str, Any]],
          progress: Progress, label: str) -> None:
    """The events, ``opts.settle`` s apart (the first after the steady phase), each timestamped in ``events``."""
    job = progress.add_task(f"{label}: steady", total=len(PHASES))

    def event(phase: str, action: Callable[[], str]) -> None:
        progress.update(job, description=f"{label}: {phase}", advance=1)
        start = time.time()
        detail = action()
        events.append({"phase": phase, "start": start, "end": time.time(), "detail": detail})
        if sender.error:
            raise SystemFailed(f"the client failed: {sender.error}")
        fleet.pause(opts.settle)

    def rolling() -> str:
        done = []
        for member in list(fleet.live()):
            began = time.time()
            fleet.stop([member])
            (new,) = fleet.start(1)
            done.append(f"{member.name} -> {new.name} {time.time() - began:.1f} s")
        return ", ".join(done)

    def kill9() -> str:
        victim = fleet.live()[0]
        fleet.kill(victim)
        (new,) = fleet.start(1)
        return f"{victim.name} killed, {new.name} ready after {new.ready - victim.ended:.1f} s" if new.ready \
            else f"{victim.name} killed, {new.name} {new.how}"

    def scale_out() -> str:
        new = fleet.start(opts.workers)
        ready = [m.ready - m.started for m in new if m.ready]
        last = max(ready, default=math.nan)
        return f"{', '.join(m.name for m in new)}: {len(ready)} ready, the last after {last:.1f} s"

    def scale_in() -> str:
        live = fleet.live()
        events[-1]["fleet"] = [m.hostname for m in live]  # the scaled-out fleet, for its idle workers
        gone = live[:opts.workers]
        began = time.time()
        fleet.stop(gone)
        return f"{', '.join(m.name for m in gone)} stopped in {time.time() - began:.1f} s"

    fleet.pause(opts.countdown + opts.settle)  # the first tasks fall due: the steady phase
    for phase, action in zip(PHASES[1:], (rolling, kill9, scale_out, scale_in)):
        event(phase, action)
    progress.remove_task(job)


def run_system(key: str, system: System, opts: argparse.Namespace, progress: Progress, logdir: Path) -> dict[str, Any]:
    """One system through the load and the events; its figures (:func:`analyse`)."""
    overrides = {**new_overrides(partitions=8), **system.overrides}
    if opts.topic_partitions:
        overrides["delayed_topic_partitions"] = opts.topic_partitions
    if opts.dispatch_lead is not None:
        overrides["delayed_dispatch_lead"] = opts.dispatch_lead
    env = {"COMPARE_SYSTEM": system.app}
    app = create_app(system.app, **overrides)
    records = redis.Redis.from_url(RECORDS)
    run = uuid.uuid4().hex[:8]
    (logdir / key).mkdir(parents=True, exist_ok=True)
    procs = Processes(logdir / key, overrides, app="bench.compare_app")
    fleet = Fleet(procs, env, opts.start_timeout, opts.pool, opts.stop)
    sender = Sender(app.tasks["compare.noop"], run, opts.rate, opts.countdown)
    events: list[dict[str, Any]] = []
    failed: str | None = None
    meter = CpuMeter({})
    meter.start()
    load = [os.getloadavg()[0]]
    try:
        try:
            if system.app == "celery-delayed":
                fleet.poller = procs.start("poller", "delayed", "poller", "-l", "INFO", env=env)
            fleet.start(opts.workers)
            sender.start()
            churn(fleet, sender, opts, events, progress, system.name)
        except SystemFailed as exc:
            failed = str(exc)
            console.print(f"[red]{system.name} failed[/]: {failed}")
        finally:
            sender.stop()
        load.append(os.getloadavg()[0])
        last_due = max((due for _, due in sender.sent), default=0) / 1000
        if not failed:
            wait_runs(records, run, len(sender.sent), last_due + opts.grace, progress, f"{system.name}: run")
            time.sleep(2)  # a duplicate may still land
        runs, _, _ = read_run(records, run)
        starts = read_starts(records, run)
        cpu = meter.stop()
        return {"system": system.name, "how": system.how, "failed": failed, "sender_error": sender.error,
                "sender_behind_s": round(sender.behind_s, 3), "sent": len(sender.sent),
                "ran_twice": sum(count > 1 for count in runs.values()),
                "machine_busy_cores": cpu["machine"], "load_1m": load,
                "members": [{"name": m.name, "started": m.started, "ready": m.ready, "ended": m.ended, "how": m.how}
                            for m in fleet.members],
                **analyse(sender.sent, starts, events, fleet.partition_gaps() if system.app != "native" else None)}
    finally:
        procs.stop_all()
        _clean(system, overrides, records, run)


def phase_of(due_s: float, events: list[dict[str, Any]]) -> str:
    """The phase during which ``due_s`` (epoch s) fell: that of the last event started by then."""
    return next((e["phase"] for e in reversed(events) if due_s >= e["start"]), "steady")


def analyse(sent: list[tuple[str, int]], starts: dict[str, tuple[int, str]], events: list[dict[str, Any]],
            gaps: list[tuple[float, float]] | None) -> dict[str, Any]:
    """Per phase: tasks, lateness, not run and the longest a topic partition had no live owner (a
    gap belongs to the phase it began in); the scaled-out fleet's tasks per worker; the kill's
    outstanding tasks; every task as (due s from the first, lateness ms or None) for the plot."""
    first = sent[0][1] if sent else 0
    lags: dict[str, list[int]] = {p: [] for p in PHASES}
    tasks = dict.fromkeys(PHASES, 0)
    points: list[tuple[float, int | None]] = []
    for task_id, due_ms in sent:
        phase = phase_of(due_ms / 1000, events)
        tasks[phase] += 1
        lag = starts[task_id][0] if task_id in starts else None
        if lag is not None:
            lags[phase].append(lag)
        points.append((round((due_ms - first) / 1000, 3), lag))
    phases = {p: {"tasks": tasks[p], "not_run": tasks[p] - len(lags[p]), "p50": percentile(lags[p], .5),
                  "p99": percentile(lags[p], .99), "max": max(lags[p], default=math.nan),
                  "on_time": sum(lag <= ON_TIME_MS for lag in lags[p]),
                  "late_5s": sum(lag > LATE_MS for lag in lags[p]),
                  "ownerless_s": None if gaps is None else round(max(
                      (until - since for since, until in gaps if phase_of(since, events) == p), default=0.0), 1)}
              for p in PHASES}
    found = {e["phase"]: e for e in events}
    kill, scaled = found.get("kill9"), found.get("scale-out")
    outstanding = None
    if kill:  # not started when the kill came, or due before the next event
        until = found["scale-out"]["start"] if scaled else math.inf
        worst = [starts[t][0] if t in starts else None for t, due in sent
                 if due / 1000 < until and (t not in starts or due + starts[t][0] > kill["start"] * 1000)]
        outstanding = {"tasks": len(worst), "not_run": worst.count(None),
                       "max": max((w for w in worst if w is not None), default=math.nan)}
    per_worker = None
    if scaled and "fleet" in scaled:  # tasks started while all 2N were up, by worker
        begin, end = scaled["end"] * 1000, found["scale-in"]["start"] * 1000
        per_worker = dict.fromkeys(scaled["fleet"], 0)
        for task_id, due_ms in sent:
            if task_id in starts and begin <= due_ms + starts[task_id][0] < end and starts[task_id][1] in per_worker:
                per_worker[starts[task_id][1]] += 1
    return {"first_due": first / 1000, "events": [{**e, "at_s": round(e["start"] - first / 1000, 1),
                                                   "took_s": round(e["end"] - e["start"], 1)} for e in events],
            "phases": phases, "not_run": sum(p["not_run"] for p in phases.values()),
            "kill_outstanding": outstanding, "scaled_out_tasks": per_worker, "points": points}


def goals(r: dict[str, Any], native: dict[str, Any] | None) -> dict[str, tuple[bool | None, str]]:
    """The goals (information): each as (met, what was seen); None when it cannot be judged."""
    rolling, out, idle = r["phases"]["rolling"], r["kill_outstanding"], r["scaled_out_tasks"]
    if r["system"] == "native":
        roll = (None, "the reference")
    elif not rolling["tasks"]:
        roll = (None, "no rolling restart")
    else:
        base = native["phases"]["rolling"]["p99"] if native and native["phases"]["rolling"]["tasks"] else math.nan
        limit = max(250.0, 1.5 * base) if not math.isnan(base) else 250.0
        met = rolling["p99"] <= limit and rolling["max"] <= 2000 and not rolling["not_run"]
        roll = (met, f"p99 {_ms(rolling['p99'])} (limit {limit:,.0f}), max {_ms(rolling['max'])}"
                     + (f", {rolling['not_run']} not run" if rolling["not_run"] else ""))
    kill = (None, "no kill -9") if out is None else \
        (not out["not_run"] and out["max"] <= KILL_GOAL_MS,
         f"{out['tasks']} outstanding, worst {_ms(out['max'])} ms"
         + (f", {out['not_run']} not run" if out["not_run"] else ""))
    if idle is None or not any(idle.values()):  # none at all: the fleet was stalled (a kill's aftermath), not idle
        scale = (None, "no scale-out" if idle is None else "no task started while scaled out")
    else:
        idle_names = ", ".join(host.split("@")[0] for host, n in idle.items() if not n)
        scale = (all(idle.values()), f"idle: {idle_names or 'none'}")
    return {"rolling": roll, "kill9": kill, "scale-out": scale}


# -- report --------------------------------------------------------------------
def report(results: list[dict[str, Any]], opts: argparse.Namespace, found: dict[str, str]) -> str:
    """The results as Markdown (also printed): a row per system and phase, then one per system."""
    native = next((r for r in results if r["system"] == "native" and not r["failed"]), None)
    head = ["system", "phase", "tasks", "lateness p50 / p99 / max ms", "on time <= 1 s", "> 5 s late", "not run",
            "a partition ownerless, longest s"]
    rows = []
    for r in results:
        if not r["sent"]:
            rows.append([r["system"], "— (failed)", "0", "—", "—", "—", "—", "—"])
        for phase, p in r["phases"].items() if r["sent"] else ():
            share = f"{p['on_time'] / p['tasks']:.1%}" if p["tasks"] else "—"
            rows.append([r["system"], phase, f"{p['tasks']:,}", f"{_ms(p['p50'])} / {_ms(p['p99'])} / {_ms(p['max'])}",
                         share, f"{p['late_5s']:,}", f"{p['not_run']:,}",
                         "—" if p["ownerless_s"] is None else f"{p['ownerless_s']}"])
    stop = "process-group" if opts.stop == "group" else "main"
    title = (f"bench.fleet: {opts.workers} workers (celery worker {' '.join(POOLS[opts.pool])}), {opts.rate:g} tasks/s "
             f"with countdown {opts.countdown:g} s; rolling restart ({stop} SIGTERM), kill -9, scale-out to "
             f"{2 * opts.workers}, scale-in; {opts.settle:g} s apart")
    lines = [f"### {title}", "", _markdown(head, rows)]
    table = Table(*head, title=title)
    for row in rows:
        table.add_row(*row)
    console.print(table)

    head2 = ["system", "status", "sent", "not run by the end", "run twice", "rolling goal", "kill -9 goal",
             "scale-out goal", "tasks per worker, scaled out", "busy cores (load 1 min)"]
    rows2 = []
    for r in results:
        met = goals(r, native)
        rows2.append([r["system"], f"failed: {r['failed']}" if r["failed"] else "ran", f"{r['sent']:,}",
                      f"{r['not_run']:,}", f"{r['ran_twice']:,}",
                      *(_goal(*met[g]) for g in ("rolling", "kill9", "scale-out")),
                      ", ".join(f"{h.split('@')[0]} {n}" for h, n in (r["scaled_out_tasks"] or {}).items()) or "—",
                      f"{r['machine_busy_cores']} of 2 ({' -> '.join(f'{x:.1f}' for x in r['load_1m'])})"])
    table = Table(*head2, title="bench.fleet: per system")
    for row in rows2:
        table.add_row(*row)
    console.print(table)
    lines += ["", _markdown(head2, rows2), "", "Events (s after the first due time, how long each took):", ""]
    for r in results:
        lines.append(f"- {r['system']}: " + ("; ".join(f"{e['phase']} at {e['at_s']} s ({e['took_s']} s: {e['detail']})"
                                                     for e in r["events"]) or "none"))
        exited: dict[str, list[str]] = {}
        for m in r["members"]:
            if m["how"].startswith("exited"):
                exited.setdefault(m["how"], []).append(m["name"])
        for how, names in exited.items():
            lines.append(f"  - {', '.join(names)} {how}")
    lines += ["", "Goals (information, not assertions): rolling p99 <= max(250 ms, 1.5 x native's rolling p99) and "
              f"max <= 2 s; every task not started at the kill -9, or due before the next event, started within "
              f"{KILL_GOAL_MS // 1000} s of due; no idle worker while scaled out (a task started by each between "
              f"scale-out's end and scale-in).  Lateness: first start - due time; tasks not run are left out of "
              "the percentiles.  A partition ownerless: the longest a partition of the topic had no live worker "
              "(from its revoke, or its worker's kill, until assigned again; from the workers' logs), in the phase "
              "it began.", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in found.items())]
    return "\n".join(lines) + "\n"


def _goal(met: bool | None, seen: str) -> str:
    return {True: "met", False: "NOT met", None: "—"}[met] + f" ({seen})"


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Each task's lateness over its due time, a panel per system, the events as vertical lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(14, 4 * len(results)), squeeze=False, sharex=True)
    top = max((lag for r in results for _, lag in r["points"] if lag is not None), default=1000) * 1.5
    for ax, r in zip(axes.flat, results):
        ran = [(t, lag) for t, lag in r["points"] if lag is not None]
        ax.plot([t for t, _ in ran], [lag for _, lag in ran], ".", markersize=2, alpha=0.5, label="a task")
        per_s: dict[int, list[int]] = {}
        for t, lag in ran:
            per_s.setdefault(int(t), []).append(lag)
        seconds = sorted(per_s)
        ax.step(seconds, [percentile(per_s[s], .99) for s in seconds], where="post", linewidth=1,
                label="p99 per second")
        lost = [t for t, lag in r["points"] if lag is None]
        if lost:
            ax.plot(lost, [top] * len(lost), "x", color="red", markersize=4, label=f"not run ({len(lost)})")
        for e in r["events"]:
            ax.axvline(e["at_s"], color="black", linestyle="--", linewidth=0.8)
            ax.axvspan(e["at_s"], e["at_s"] + e["took_s"], color="grey", alpha=0.15)
            ax.text(e["at_s"], top, f" {e['phase']}", rotation=90, va="top", fontsize=8)
        if r["failed"]:
            ax.text(0.5, 0.5, "failed: " + "\n".join(r["failed"][i:i + 110] for i in range(0, len(r["failed"]), 110)),
                    transform=ax.transAxes, ha="center", va="center", fontsize=9, color="red")
        ax.set(title=r["system"] + (" (failed)" if r["failed"] else ""), xlabel="due time, s since the first task",
               ylabel="lateness ms (symlog)")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(-10, top * 1.2)
    return save_figure(fig, axes.flat, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 workers, 4 s apart, 20 s of grace (CI)")
    parser.add_argument("--workers", type=int, default=4, help="N: workers (celery worker -c 1), 2N scaled out")
    parser.add_argument("--rate", type=float, default=30.0, help="tasks sent a second")
    parser.add_argument("--countdown", type=float, default=3.0, help="each task's countdown (s)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between two events")
    parser.add_argument("--grace", type=float, default=30.0, help="wait this long past the last due time")
    parser.add_argument("--systems", nargs="+", choices=("native", "classic", "consumer"),
                        default=["native", "classic", "consumer"], help="run these systems, in this order")
    parser.add_argument("--topic-partitions", type=int,
                        help="delayed_topic_partitions (default: the setting's own, "
                             f"{Settings.topic_partitions})")
    parser.add_argument("--dispatch-lead", type=float,
                        help=f"delayed_dispatch_lead, s (default: the setting's own, {Settings.dispatch_lead})")
    parser.add_argument("--raw-protocol", action="store_true",
                        help='consumer: also delayed_kafka_config = {"group.protocol": "consumer"}')
    parser.add_argument("--pool", choices=sorted(POOLS), default="prefork",
                        help="every worker's pool (default prefork -c 1; green: -c 50)")
    parser.add_argument("--stop", choices=("main", "group"), default="main",
                        help="how workers are stopped: SIGTERM to the main process (default) or to the group")
    parser.add_argument("--start-timeout", type=float, default=90.0, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.workers, opts.settle, opts.grace = 2, 4.0, 20.0
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    with exclusive("bench.fleet"):
        found = versions()
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = RESULTS / f"fleet-{stamp}{'-quick' if opts.quick else ''}"
        logdir = base.with_suffix(".logs")
        chosen = systems(opts)
        results = []
        began = time.monotonic()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            for key in opts.systems:
                results.append(run_system(key, chosen[key], opts, progress, logdir))
        table = report(results, opts, found)
        base.with_suffix(".md").write_text(table)
        base.with_suffix(".json").write_text(json.dumps(
            {"versions": found, "git": git_state(), "options": vars(opts), "wall_s": round(time.monotonic() - began),
             "results": results}, indent=1, default=str))
        plot(results, base.with_suffix(".png"))
        if not opts.quick:
            for suffix in (".md", ".json", ".png"):
                shutil.copyfile(base.with_suffix(suffix), RESULTS / f"fleet-latest{suffix}")
        console.print(f"results: {base}.md, .json, .png; logs in {logdir}/ ({time.monotonic() - began:.0f} s)")
        bad = [r["system"] for r in results if r["system"] != "native" and (r["failed"] or r["not_run"])]
        if bad:
            console.print(f"[red]failed or left tasks not run: {', '.join(bad)}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
