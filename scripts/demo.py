"""The demo: a poller, a worker and Flower on the local servers; thousands of
countdown tasks fired through Redis -> etcd-led poller -> Kafka -> worker.

Ends with a summary (scheduled, fired, lost, duplicates, lag p50/p99) and a PNG
of the lag distribution.  Every process it starts is stopped by PID at the end.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
console = Console()


def start(name: str, args: list[str], logdir: Path) -> subprocess.Popen:
    log = (logdir / f"{name}.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--spread", type=float, default=20.0, help="countdowns spread over this many seconds")
    parser.add_argument("--flower-port", type=int, default=5555)
    opts = parser.parse_args()

    from tasks import app
    from tasks.demo import fire

    run = uuid.uuid4().hex[:8]
    logdir = ROOT / ".services" / "demo"
    logdir.mkdir(parents=True, exist_ok=True)
    procs = [start("poller", ["delayed", "poller"], logdir),
             start("worker", ["worker", "-l", "INFO", "-c", "4", "-n", "demo@%h"], logdir),
             start("flower", ["flower", f"--port={opts.flower_port}", "--address=127.0.0.1"], logdir)]
    try:
        console.print(f"[bold]run {run}[/]: poller, worker and Flower (http://127.0.0.1:{opts.flower_port}) "
                      f"started; logs in {logdir}")
        store = app.amqp.delayed_store
        _wait_for_worker(app.amqp.delayed_settings)
        due: dict[str, int] = {}
        t0 = time.time()
        for _ in range(opts.tasks):
            due_ms = int((time.time() + 2 + random.random() * opts.spread) * 1000)
            result = fire.apply_async((run, due_ms), eta=datetime.fromtimestamp(due_ms / 1000, timezone.utc))
            due[result.id] = due_ms
        in_store = sum(r["scheduled"] + r["inflight"] for r in store.counts())
        console.print(f"scheduled {len(due)} tasks in {time.time() - t0:.1f} s "
                      f"({in_store} in the delayed store, none on the broker)")

        runs_key = f"demo:{run}:runs"
        last_due = max(due.values()) / 1000
        deadline = last_due + 60
        with Progress(TextColumn("fired"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            job = bar.add_task("fired", total=len(due))
            while time.time() < deadline:
                fired = store.redis.hlen(runs_key)
                bar.update(job, completed=fired)
                if fired >= len(due) and time.time() > last_due:
                    break
                time.sleep(0.2)
        time.sleep(1)  # let any duplicate land before counting
        runs = {k.decode(): int(v) for k, v in store.redis.hgetall(runs_key).items()}
        lags = [int(x) for x in store.redis.lrange(f"demo:{run}:lag", 0, -1)]
        lost = [t for t in due if t not in runs]
        duplicates = sum(n - 1 for n in runs.values())
        table = Table("scheduled", "fired", "lost", "duplicates", "lag p50", "lag p99", "lag max",
                      title="celery-delayed demo")
        table.add_row(str(len(due)), str(len(runs)), str(len(lost)), str(duplicates),
                      f"{percentile(lags, .5):.0f} ms", f"{percentile(lags, .99):.0f} ms",
                      f"{max(lags, default=0):.0f} ms")
        console.print(table)
        plot = logdir / "lag.png"
        if _plot(lags, plot):
            console.print(f"lag distribution: {plot}")
        store.redis.delete(runs_key, f"demo:{run}:lag")
        return 1 if lost or duplicates else 0
    finally:
        stop(procs)


def _wait_for_worker(settings, timeout: float = 60.0) -> None:
    """Wait until the worker has joined its Kafka consumer group (so the first tasks are not late)."""
    from confluent_kafka import ConsumerGroupState, KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka())
    deadline = time.time() + timeout
    with console.status("waiting for the worker to join its Kafka consumer group"):
        while time.time() < deadline:
            try:
                group = admin.describe_consumer_groups([settings.consumer_group])[settings.consumer_group].result()
            except KafkaException:  # a broker just started is still loading its group coordinator
                group = None
            if group is not None and group.state == ConsumerGroupState.STABLE and group.members:
                return
            time.sleep(0.5)
    raise SystemExit(f"the worker did not join Kafka group {settings.consumer_group} in {timeout:.0f} s")


def _plot(lags: list[int], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lags, bins=60)
    ax.set_xlabel("lag from due time to task start (ms)")
    ax.set_ylabel("tasks")
    ax.set_title(f"celery-delayed demo: {len(lags)} tasks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


if __name__ == "__main__":
    sys.exit(main())
