"""The chaos run: load, faults, ledger check, report (see :mod:`tests.chaos`)."""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import high_watermark, make_consumer, new_overrides, topic_partitions, versions
from celery_delayed import store_of
from celery_delayed.envelope import Envelope, EnvelopeError
from celery_delayed.kafka import client_config, consumer_lag, ensure_topics, outcome
from celery_delayed.sandbox import remove_everything
from celery_delayed.store.dlq import DeadLetters
from celery_delayed.store.outcomes import STORE_ERRORS
from tasks import create_app
from tasks.chaos import ledger as ledger_of
from tests.integration.support import ETCD3_ENDPOINTS, ROOT, SERVICES_DIR, Processes

from . import check, clock, faults, ledger, load, network, report
from .network import Hosts
from .proxies import Proxies

RESULTS = ROOT / "tests" / "chaos" / "results"
#: Stop waiting for the load when no task finished for this long (s) after the last fault and due time:
#: longer than a Kafka outage followed by a consumer-group rebalance that waits out a killed worker
#: (the group session: 10 s on the classic protocol, celery_delayed.kafka.CLASSIC_DEFAULTS; 6 s on the
#: consumer protocol, set on the broker by config/kafka/server.properties).
STALL_S = 120.0
#: Longest wait (s) after a fault for dispatch to be back on time before the next fault may start.
RECOVERY_WAIT_S = 45.0
#: Longest wait (s) for the store to empty and the workers' offsets to catch up once the load ran.
SETTLE_S = 30.0


@dataclass(frozen=True)
class Profile:
    """Size and timing of a run (seconds are counted from the first task's due time)."""

    tasks: int
    window_s: float      # the load is due evenly over this long
    lead_s: float        # from the start of scheduling to the first due time
    faults_from_s: float
    faults_until_s: float
    times: int           # each fault this many times
    faults: tuple[str, ...]
    deadline_s: float    # the whole run, from start to verdict


PROFILES = {
    "quick": Profile(10_000, 90, 20, 3, 50, 1, tuple(faults.QUICK), 270),
    "full": Profile(100_000, 600, 45, 10, 450, 2, tuple(faults.FAULTS), 1500),
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10,000 tasks over a minute, one of each cheap fault")
    parser.add_argument("--seed", type=int, help="seed of the load and the fault schedule (default: random)")
    parser.add_argument("--tasks", type=int, help="tasks in the load (default: the profile's)")
    parser.add_argument("--faults", help=f"comma-separated faults to inject, of: {', '.join(faults.FAULTS)} "
                                         "(default: the profile's; 'none' for none)")
    parser.add_argument("--store", choices=("redis", "cluster"), default="redis",
                        help="where the delayed store is: the standalone Redis (default) or the Redis Cluster of "
                             "scripts/services (3 primaries, a replica each); Celery's broker and result backend "
                             "stay on the standalone Redis")
    parser.add_argument("--schedule-wait", help="delayed_schedule_wait of the run (default: 'replicas=1,timeout=1' "
                                                "with --store cluster, so a failover loses no acknowledged write; "
                                                "'' for none)")
    parser.add_argument("--out", type=Path, help="results folder (default: tests/chaos/results/<time>-<profile>)")
    parser.add_argument("--latest", action="store_true",
                        help="also copy the report to tests/chaos/results/latest.* (latest-cluster.* with "
                             "--store cluster; a full run always does)")
    args = parser.parse_args(argv)
    if args.faults:
        names = [] if args.faults == "none" else args.faults.split(",")
        unknown = [n for n in names if n not in faults.FAULTS]
        if unknown:
            parser.error(f"unknown faults {unknown}; known: {', '.join(faults.FAULTS)}")
        args.fault_names = names
        cluster_only = [n for n in names if n in faults.CLUSTER_ONLY]
        if cluster_only and args.store != "cluster":
            parser.error(f"{', '.join(cluster_only)} needs the store on the Redis Cluster: add --store cluster")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chaos suite; 0 when every ledger check passed."""
    args = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)  # a SIGTERM still stops the run's pollers and workers
    name = "quick" if args.quick else "full"
    profile = PROFILES[name]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    names = getattr(args, "fault_names", [n for n in profile.faults
                                          if args.store == "cluster" or n not in faults.CLUSTER_ONLY])
    folder = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    console = Console()
    # leadership through the 3-member etcd cluster (scripts/services up etcd3), which the etcd faults act on
    overrides = {**new_overrides(partitions=8, lease_ttl=5), "result_expires": 900,
                 "delayed_etcd_endpoints": ETCD3_ENDPOINTS, **store_overrides(args.store, args.schedule_wait)}
    app = create_app(**overrides)
    settings = app.amqp.delayed_settings
    run_info = {"command": "python -m tests.chaos " + " ".join(sys.argv[1:] if argv is None else argv),
                "profile": name, "store": args.store,
                "schedule_wait": overrides.get("delayed_schedule_wait", ""), "seed": seed, "faults": names,
                "versions": versions(settings),
                "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "window_s": profile.window_s, "results": str(folder)}
    console.print(f"chaos run, {name} profile, store on {args.store} (delayed_schedule_wait "
                  f"{run_info['schedule_wait']!r}), seed [bold]{seed}[/]: {args.tasks or profile.tasks} tasks, faults "
                  f"{', '.join(names) or 'none'}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in run_info["versions"].items()))
    hosts = _hosts(names, console)
    run_info["network"] = "a network namespace per poller and worker" if hosts else "loopback"
    if any(n in faults.CLOCKED for n in names) and (why := clock.available()):
        raise SystemExit(f"clock-step cannot run here: {why}")
    clock.share_wall_clock()
    started = time.monotonic()
    chaos = Run(app, overrides, profile, args.tasks or profile.tasks, names, seed, folder, console, hosts)
    result = chaos.execute()
    run_info["wall_s"] = round(time.monotonic() - started, 1)
    run_info["live"] = {"sent": len(chaos.live.sent), "by_broker": chaos.live.by_broker,
                        "unacked": sum(not t.expected for t in chaos.live.sent), "refused": chaos.live.refused}
    result["run"] = run_info
    paths = report.write(result["verdict"] | {"run": run_info, "injected": result["injected"]}, folder,
                         result["timeline"])
    if name == "full" or args.latest:  # latest.* for the store on standalone Redis, latest-cluster.* on the cluster
        for path in paths:
            shutil.copyfile(path, RESULTS / f"latest{'-cluster' if args.store == 'cluster' else ''}{path.suffix}")
    print(report.table(result["verdict"]), flush=True)
    for check_name, ok in result["verdict"]["checks"].items():
        console.print(f"{'PASS' if ok else '[red]FAIL[/]'}: {check_name}")
    console.print(f"wall time {run_info['wall_s']:.0f} s; report in {folder}")
    return 0 if result["verdict"]["ok"] else 1


def _hosts(names: list[str], console: Console) -> Hosts | None:
    """Each poller and worker in its own network namespace where this machine allows it; refused when
    a link fault is planned and it does not."""
    why = network.available()
    if why is None:
        console.print("network: each poller and worker in its own network namespace (link faults possible)")
        return Hosts()
    links = [n for n in names if n in faults.LINKS]
    if links:
        raise SystemExit(f"{', '.join(links)} cannot run here: {why}")
    console.print(f"network: loopback ({why})")
    return None


def store_overrides(store: str, schedule_wait: str | None = None) -> dict[str, Any]:
    """Settings that put the delayed store on the Redis Cluster of scripts/services (none for ``redis``), its
    schedule writes waiting for a replica unless ``schedule_wait`` says otherwise."""
    wait = {} if schedule_wait is None else {"delayed_schedule_wait": schedule_wait}
    if store == "redis":
        return wait
    return {"delayed_redis_url": f"redis://127.0.0.1:{os.environ.get('CD_REDIS_CLUSTER_PORT', '7001')}/0",
            "delayed_redis_cluster": True, "delayed_schedule_wait": "replicas=1,timeout=1", **wait}


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Run:
    """One chaos run on the local servers, with its own key prefix, topics, group and queue."""

    def __init__(self, app: Any, overrides: dict[str, Any], profile: Profile, n: int, names: list[str], seed: int,
                 folder: Path, console: Console, hosts: Hosts | None = None) -> None:
        self.app, self.settings, self.profile, self.n = app, app.amqp.delayed_settings, profile, n
        self.rng = random.Random(seed)
        self.folder, self.console = folder, console
        self.deadline = time.monotonic() + profile.deadline_s
        self.topic = self.settings.topic(app.conf.task_default_queue)
        self.cluster = faults.Cluster(self.settings, Processes(folder / "logs", overrides), SERVICES_DIR,
                                      rng=random.Random(seed + 1), hosts=hosts)
        if hosts is not None and any(n in faults.PROXIED for n in names):
            self.cluster.proxies = Proxies(folder / "logs", faults.redis_ports(self.settings)
                                           + faults.kafka_ports(self.settings), seed + 3)
        if any(n in faults.CLOCKED for n in names):
            self.cluster.clocks = clock.Clocks(folder / "logs")
        self.plan = faults.schedule(self.rng, names, profile.times, profile.faults_from_s, profile.faults_until_s)
        self.injected: list[faults.Injected] = []
        self.live = load.LiveSender(app, str(folder / "ledger.db"), random.Random(seed + 2))
        self.phase = "starting"

    def execute(self) -> dict[str, Any]:
        """Start the processes, schedule the load, inject the faults, wait, check; always stop what started."""
        for name in sorted({n for _, n in self.plan}):
            for service in faults.SERVERS.get(name, []):
                if not (self.cluster.services_dir / "run" / f"{service}.pid").exists():
                    raise SystemExit(f"{service} was not started by scripts/services: fault {name} may not stop it")
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=self.console) as progress:
                tasks, db = self._prepare(progress)
                self._load(progress, db, tasks)
            state = self._settle()
        finally:
            self.cluster.procs.stop_all()
            if self.cluster.hosts is not None:
                self.cluster.hosts.close()
            if self.cluster.proxies is not None:
                self.cluster.proxies.close()
        deliveries, state["on_kafka"] = self._deliveries()
        tasks = tasks + self.live.sent
        verdict = check.analyse(tasks, ledger.runs(db), *ledger.effects(db), deliveries, self.injected, **state)
        remove_everything(self.settings, [self.topic])
        t0_ms = min(t.due_ms for t in tasks)
        runs = ledger.runs(db)
        return {"verdict": verdict,
                "injected": [{**asdict(f), "at_s": (f.start_ms - t0_ms) / 1000,
                              "took_s": (f.end_ms - f.start_ms) / 1000}
                             for f in self.injected],
                "timeline": {"t0_ms": t0_ms, "starts_ms": [r[3] for r in runs],
                             "lags": [(r[4], r[3] - r[4]) for r in check.firsts(runs)], "faults": self.injected,
                             "title": f"chaos run: {len(tasks)} tasks, {len(self.injected)} faults"}}

    def _prepare(self, progress: Progress) -> tuple[list[load.Planned], Any]:
        """Start 2 pollers and 2 workers, plan and store the load, revoke and reschedule some of it."""
        ensure_topics(self.settings, [self.app.conf.task_default_queue])
        _broker_timestamps(self.settings, self.topic)
        for _ in range(2):
            self.cluster.add_poller()
            self.cluster.add_worker()
        start_ms = int((time.time() + self.profile.lead_s) * 1000)
        tasks = load.plan(self.rng, self.n, start_ms, self.profile.window_s)
        path = self.folder / "ledger.db"
        db = ledger.create(path, tasks)
        job = progress.add_task("scheduling", total=len(tasks))
        load.schedule(self.app, tasks, str(path), lambda k: progress.advance(job, k))
        progress.update(job, description="revoking and rescheduling")
        load.revoke_and_reschedule(self.app, tasks)
        progress.remove_task(job)
        late_s = time.time() - start_ms / 1000
        if late_s > 0:
            self.console.print(f"[yellow]preparation ended {late_s:.1f} s after the first due time[/]")
        return tasks, db

    def _load(self, progress: Progress, db: Any, tasks: list[load.Planned]) -> None:
        """Inject the faults (a thread) while the load runs; wait for every task, a stall or the deadline."""
        t0 = min(t.due_ms for t in tasks) / 1000
        planned = sum(t.expected for t in tasks)
        thread = threading.Thread(target=self._inject_all, args=(t0,), name="faults", daemon=True)
        thread.start()
        stop_sending = threading.Event()
        path = str(self.folder / "ledger.db")
        sender = threading.Thread(target=self.live.run, name="live", daemon=True, args=(
            t0 + self.profile.faults_until_s, stop_sending, lambda task: ledger.add(ledger_of(path), [task])))
        sender.start()
        job = progress.add_task("", total=planned)
        last_done, last_change = -1, time.monotonic()
        last_due = max(t.new_due_ms or t.due_ms for t in tasks) / 1000
        while time.monotonic() < self.deadline:
            count = ledger.done(db)
            expected = planned + sum(t.expected for t in self.live.sent)
            if count != last_done:
                last_done, last_change = count, time.monotonic()
            progress.update(job, completed=count, total=expected, description=self._status(t0))
            if count >= expected and not sender.is_alive():
                break
            if time.monotonic() > self.deadline - 60:
                stop_sending.set()
            quiet = not thread.is_alive() and not sender.is_alive() and time.time() > last_due
            if quiet and time.monotonic() - last_change > STALL_S:
                self.console.print(f"[red]no task finished for {STALL_S:.0f} s: dispatch stalled[/]")
                break
            time.sleep(1)
        self.phase = "done"
        stop_sending.set()
        sender.join(timeout=10)
        thread.join(timeout=max(1.0, self.deadline - time.monotonic()))

    def _status(self, t0: float) -> str:
        return f"t={time.time() - t0:+.0f} s, faults {len(self.injected)}/{len(self.plan)}, {self.phase}; done"

    def _inject_all(self, t0: float) -> None:
        """Each fault at its time, or once dispatch is back on time after the one before, if later:
        so each fault's recovery is its own."""
        store = store_of(self.app)
        for at_s, name in self.plan:
            self.phase = f"next fault {name} at {at_s:.0f} s"
            wait = t0 + at_s - time.time()
            if time.monotonic() + max(wait, 0) > self.deadline - 30:
                self.phase = "fault schedule cut short by the deadline"
                return
            time.sleep(max(0.0, wait))
            self.phase = f"injecting {name}"
            self.injected.append(faults.inject(self.cluster, name))
            self.phase = f"waiting for dispatch to be back after {name}"
            self._wait_on_time(store)
        self.phase = "all faults injected, draining"

    def _wait_on_time(self, store: Any) -> None:
        """Until no task in the store is overdue by more than :data:`check.ON_TIME_MS` (the pollers
        dispatch on time again; a backlog of the workers does not hold the next fault back), at most
        :data:`RECOVERY_WAIT_S`."""
        time.sleep(3)
        until = time.monotonic() + RECOVERY_WAIT_S
        while time.monotonic() < min(until, self.deadline - 30):
            try:
                if all((c["oldest_overdue_s"] or 0) * 1000 <= check.ON_TIME_MS for c in store.counts()):
                    return
            except STORE_ERRORS:  # a Redis fault still under way
                pass
            time.sleep(0.5)

    def _settle(self) -> dict[str, Any]:
        """Wait (bounded) for an empty store and no consumer lag; what is left either way."""
        store = store_of(self.app)
        deadline = min(self.deadline, time.monotonic() + SETTLE_S)
        while True:
            counts = store.counts()
            left = {"scheduled": sum(c["scheduled"] for c in counts), "inflight": sum(c["inflight"] for c in counts)}
            lag = consumer_lag(self.settings)
            if (not any(left.values()) and not any(lag.values())) or time.monotonic() > deadline:
                break
            time.sleep(1)
        letters = DeadLetters(store)
        held = {letter.task_id for letter in letters.list(limit=max(letters.count(), 1))}
        return {"dead_letters": held, "leftovers": left, "lag": lag, "in_store": _scheduled_ids(store)}

    def _deliveries(self) -> tuple[list[tuple[str, int, int]], set[str]]:
        """Every record on the run's topic, ``(task id, retries header, LogAppendTime ms)``, and the ids of
        those past the workers' committed offsets (on Kafka, not yet settled by a worker)."""
        consumer = make_consumer(self.settings)
        probe = Consumer(self.settings.kafka(**{"group.id": self.settings.consumer_group,
                                                "enable.auto.commit": False}))
        try:
            partitions = topic_partitions(self.settings, self.topic)
            total = high_watermark(consumer, self.topic, partitions)
            committed = {tp.partition: tp.offset for tp in
                         probe.committed([TopicPartition(self.topic, p) for p in partitions], timeout=10)}
            consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
            found: list[tuple[str, int, int]] = []
            unsettled: set[str] = set()
            deadline = time.monotonic() + 60
            while len(found) < total and time.monotonic() < deadline:
                for record in consumer.consume(num_messages=10_000, timeout=1.0):
                    if not record.error():
                        found.append((record.key().decode(), _retries(record.value()), record.timestamp()[1]))
                        if record.offset() >= committed.get(record.partition(), 0):
                            unsettled.add(found[-1][0])
            return found, unsettled
        finally:
            probe.close()
            consumer.close()


def _broker_timestamps(settings: Any, topic: str) -> None:
    """Records on ``topic`` stamped by the broker's clock (LogAppendTime), not the producing poller's, which
    a clock-step fault moves: dispatch is timed by the clock of the machine."""
    admin = AdminClient(client_config(settings))
    entry = ConfigEntry("message.timestamp.type", "LogAppendTime", incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs([ConfigResource(ResourceType.TOPIC, topic,
                                                              incremental_configs=[entry])])
    for future in futures.values():
        outcome(future, 30)


def _scheduled_ids(store: Any) -> set[str]:
    """Ids of the tasks still scheduled in the store."""
    ids: set[str] = set()
    page = store.upcoming(limit=1000)
    ids.update(item["task_id"] for item in page.items)
    while page.cursor is not None:
        page = store.upcoming(limit=1000, after=page.cursor)
        ids.update(item["task_id"] for item in page.items)
    return ids


def _retries(value: bytes) -> int:
    try:
        return int(Envelope.decode(value).headers.get("retries") or 0)
    except EnvelopeError:
        return -1

