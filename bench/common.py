"""Shared benchmark helpers: isolated settings, poller processes, cleanup, statistics, plots."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import redis
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from celery_delayed.leadership import make_etcd
from celery_delayed.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def new_overrides(partitions: int, lease_ttl: int = 5) -> dict[str, Any]:
    """Celery settings isolating one scenario: its own key prefix, topic prefix, group and queue."""
    tag = "b" + uuid.uuid4().hex[:10]
    return {"delayed_key_prefix": tag, "delayed_topic_prefix": f"{tag}.", "delayed_consumer_group": tag,
            "delayed_partitions": partitions, "delayed_lease_ttl": lease_ttl, "task_default_queue": tag}


def settings_of(overrides: dict[str, Any]) -> Settings:
    """The celery-delayed settings a poller started with ``overrides`` reads (local defaults otherwise)."""
    return Settings.from_mapping({k[len("delayed_"):]: v for k, v in overrides.items()
                                  if k.startswith("delayed_")})


def environment(overrides: dict[str, Any]) -> dict[str, str]:
    """Environment passing ``overrides`` to a subprocess, as tests/integration/support.py does."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in overrides.items():
        name = key.upper() if key.startswith("delayed_") else "CELERY_" + key.upper()
        env[name] = str(value)
    return env


class Processes:
    """OS processes started by a benchmark; :meth:`stop_all` stops each by PID (TERM, then KILL)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def poller(self, overrides: dict[str, Any], name: str) -> subprocess.Popen:
        """Start ``python -m celery -A tasks delayed poller`` with its output in ``<logdir>/<name>.log``."""
        log = self.logdir / f"{name}.log"
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", "delayed", "poller", "-l", "INFO"],
                                cwd=ROOT, env=environment(overrides), stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log))
        return proc

    def check_alive(self) -> None:
        """Fail with the log tail of any started process that exited."""
        for proc, log in self.procs:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"process {proc.pid} exited with {proc.returncode}; log {log}:\n{tail}")

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every live process (its own process group, by PID), SIGKILL after ``timeout``."""
        for proc, _ in self.procs:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the process leads its own session: its group id is its pid
    except ProcessLookupError:
        pass


# -- Kafka ---------------------------------------------------------------------
def topic_partitions(settings: Settings, topic: str, timeout: float = 10.0) -> list[int]:
    """Partition numbers of an existing topic."""
    meta = AdminClient(settings.kafka()).list_topics(topic, timeout=timeout)
    return sorted(meta.topics[topic].partitions)


def make_consumer(settings: Settings) -> Consumer:
    """A consumer that only assigns partitions (no subscription, no committed offsets)."""
    return Consumer(settings.kafka(**{"group.id": f"bench-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                                      "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10,
                                      "enable.partition.eof": False}))


def high_watermark(consumer: Consumer, topic: str, partitions: Sequence[int]) -> int:
    """Records on ``topic``: the sum of its partitions' high watermarks (topics start at offset 0)."""
    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5.0, cached=False)[1]
               for p in partitions)


def delete_topics(settings: Settings, topics: Sequence[str]) -> None:
    """Delete Kafka topics, ignoring the ones that do not exist."""
    if not topics:
        return
    for future in AdminClient(settings.kafka()).delete_topics(list(topics), operation_timeout=30).values():
        try:
            future.result()
        except KafkaException:
            pass


# -- Redis / etcd ----------------------------------------------------------------
def unlink_prefix(client: redis.Redis, prefix: str) -> int:
    """UNLINK (never DEL: big keys block Redis) every key starting with ``prefix:``."""
    removed = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            removed += client.unlink(*batch)
            batch = []
    if batch:
        removed += client.unlink(*batch)
    return removed


def cleanup(settings: Settings, topics: Sequence[str]) -> None:
    """Remove everything a scenario left: Redis keys, etcd keys, Kafka topics."""
    unlink_prefix(redis.Redis.from_url(settings.redis_url), settings.key_prefix)
    try:
        make_etcd(settings).delete_prefix(f"/{settings.key_prefix}/")
    except Exception:  # etcd keys die with the pollers' leases anyway
        pass
    delete_topics(settings, topics)


# -- statistics and plots ------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def summary(values: Sequence[float]) -> dict[str, float]:
    """count, min, p50, p90, p99, p99.9 and max of ``values``."""
    ordered = sorted(values)
    return {"count": len(ordered), "min": float(ordered[0]) if ordered else math.nan,
            "p50": percentile(ordered, 0.5), "p90": percentile(ordered, 0.9), "p99": percentile(ordered, 0.99),
            "p999": percentile(ordered, 0.999), "max": float(ordered[-1]) if ordered else math.nan}


def plot_lags(series: dict[str, Sequence[float]], path: Path, title: str) -> Path:
    """Histogram and CDF of each named lag series (ms) into a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, values in series.items():
        ordered = sorted(values)
        if not ordered:
            continue
        hist.hist(ordered, bins=80, histtype="step", linewidth=1.5, label=label)
        cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    hist.set_xlabel("lag: Kafka CreateTime - due time (ms)")
    hist.set_ylabel("tasks")
    hist.set_yscale("log")
    cdf.set_xlabel("lag (ms)")
    cdf.set_ylabel("fraction of tasks")
    cdf.set_ylim(0, 1.01)
    cdf.grid(alpha=0.3)
    for ax in (hist, cdf):
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
