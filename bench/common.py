"""Shared benchmark helpers: isolated settings, poller processes, cleanup, statistics, plots."""
from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import redis
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from celery_delayed.poller.leadership import make_etcd
from celery_delayed.settings import Settings
from celery_delayed.store.redis_client import connect
from tasks.processes import ROOT

RESULTS = ROOT / "bench" / "results"


def new_overrides(partitions: int, lease_ttl: int = 5) -> dict[str, Any]:
    """Celery settings isolating one scenario: its own key prefix, topic prefix, group and queue, on the
    servers of this run (``CD_*_PORT``), so that settings built from them alone (a clean-up's) reach
    these servers and not the default ports'."""
    tag = "b" + uuid.uuid4().hex[:10]
    return {"delayed_key_prefix": tag, "delayed_topic_prefix": f"{tag}.", "delayed_consumer_group": tag,
            "delayed_partitions": partitions, "delayed_lease_ttl": lease_ttl, "task_default_queue": tag,
            **{f"delayed_{name}": value for name, value in _servers().items()}}


# -- what ran ------------------------------------------------------------------
def versions(settings: Settings | None = None) -> dict[str, str]:
    """The machine and the versions of every server and library a run used, to print beside its figures."""
    import celery
    import confluent_kafka
    import kombu

    settings = settings or Settings.from_mapping(_servers())
    found = {"machine": f"{os.cpu_count()} cores, {_memory_gib():.0f} GiB", "python": sys.version.split()[0],
             "celery": celery.__version__, "kombu": kombu.__version__, "redis-py": redis.__version__,
             "confluent-kafka": f"{confluent_kafka.__version__} (librdkafka {confluent_kafka.libversion()[0]})"}
    for name, read in (("redis", lambda: connect(settings).info("server")["redis_version"]),
                       ("etcd", lambda: make_etcd(settings).status().version),
                       ("kafka", _kafka_version)):
        try:
            found[name] = str(read())
        except Exception as exc:  # a version is information: never fail a run for it
            found[name] = f"unknown ({type(exc).__name__})"
    return found


def _servers() -> dict[str, str]:
    """The servers of scripts/services, as the demo configuration finds them."""
    from config import celeryconfig
    return {name: getattr(celeryconfig, f"delayed_{name}") for name in ("redis_url", "kafka_servers", "etcd_endpoints")}


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _kafka_version() -> str:
    """The Kafka scripts/services runs, from the name of its server jar."""
    libs = Path(os.environ.get("CD_SERVICES_DIR", ROOT / ".services")) / "kafka" / "libs"
    jar = next(libs.glob("kafka-server-[0-9]*.jar"))
    return jar.name[len("kafka-server-"):-len(".jar")]


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Hold the benchmarks' lock file while one runs: two at once would share the CPU and both
    be wrong.  A lock, not a process search, so ``timeout``/shell parents never count as one."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / ".running", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise SystemExit(f"another benchmark is running ({lock.read().strip() or '?'}); wait for it to end")
        lock.truncate(0)
        lock.write(f"{name}, pid {os.getpid()}")
        lock.flush()
        yield


def cpu_hog(seconds: float) -> subprocess.Popen:
    """A busy neighbour: one process spinning one core for ``seconds`` (then it exits by itself)."""
    return subprocess.Popen([sys.executable, "-c", f"import time\nend = time.time() + {seconds}\n"
                             "while time.time() < end: pass"], start_new_session=True)


# -- Kafka ---------------------------------------------------------------------
def topic_partitions(settings: Settings, topic: str, timeout: float = 10.0) -> list[int]:
    """Partition numbers of an existing topic."""
    meta = AdminClient(settings.kafka()).list_topics(topic, timeout=timeout)
    return sorted(meta.topics[topic].partitions)


def make_consumer(settings: Settings) -> Consumer:
    """A consumer that only assigns partitions (no subscription, no committed offsets)."""
    return Consumer(settings.kafka(**{"group.id": f"bench-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                                      "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100,
                                      "enable.partition.eof": False}))


def high_watermark(consumer: Consumer, topic: str, partitions: Sequence[int]) -> int:
    """Records on ``topic``: the sum of its partitions' high watermarks (topics start at offset 0)."""
    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5.0, cached=False)[1]
               for p in partitions)


# -- CPU accounting (Linux /proc) --------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")
#: How to recognise the local servers' processes by their command line: this run's (``CD_*_PORT``,
#: ``CD_SERVICES_DIR``), not another stack's on the same machine.
SERVICES = {"redis": ("redis-server", f"127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}"),
            "kafka": ("java", f"{os.environ.get('CD_SERVICES_DIR', ROOT / '.services')}/kafka/server.properties"),
            "etcd": ("etcd", f"--listen-client-urls http://127.0.0.1:{os.environ.get('CD_ETCD_PORT', '2379')}")}


def service_pids() -> dict[str, int]:
    """PIDs of the local Redis, Kafka and etcd servers (read-only scan of /proc)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name, (exe, marker) in SERVICES.items():
            if name not in found and exe in cmd.split(" ", 1)[0] and marker in cmd:
                found[name] = int(entry.name)
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, over all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _TICK, sum(values) / _TICK


class CpuMeter:
    """CPU used by named processes and by the whole machine between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self._machine: tuple[float, float] = (0.0, 0.0)
        self._t = 0.0

    def start(self) -> None:
        self._t = time.monotonic()
        self._start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._machine = machine_cpu()

    def add(self, name: str, pid: int) -> None:
        """Also meter a process started after :meth:`start` (counted from zero)."""
        self.pids[name] = pid
        self._start[name] = 0.0

    def stop(self) -> dict[str, float]:
        """Cores used on average by each process, ``machine`` busy cores, ``others`` the rest of it."""
        wall = max(time.monotonic() - self._t, 1e-6)
        used = {name: round((cpu_seconds(pid) - self._start.get(name, 0.0)) / wall, 2)
                for name, pid in self.pids.items()}
        busy, total = machine_cpu()
        used["machine"] = round((busy - self._machine[0]) / wall, 2)
        used["others"] = round(used["machine"] - sum(v for k, v in used.items() if k != "machine"), 2)
        used["cores"] = round((total - self._machine[1]) / wall, 2)
        return used

    def restarted(self) -> list[str]:
        """Local servers whose process changed since this meter was made (restarted under the benchmark)."""
        now = service_pids()
        return sorted(name for name in SERVICES if name in self.pids and now.get(name) != self.pids[name])


class RedisMeter:
    """Redis-wide command counts between :meth:`start` and :meth:`stop` (other clients included),
    and the longest commands: every call of at least :attr:`SLOW_US` from the slow log, which
    holds how long Redis itself was blocked (a Lua script blocks every client while it runs)."""

    SLOW_US = 2000

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._start: dict[str, float] = {}
        self._config: dict[str, str] = {}

    def _read(self) -> dict[str, float]:
        stats = self.client.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {})
        return {"commands": float(self.client.info("stats")["total_commands_processed"]),
                "evalsha": float(evalsha.get("calls", 0)), "evalsha_usec": float(evalsha.get("usec", 0))}

    def start(self) -> None:
        self._config = self.client.config_get("slowlog-*")
        self.client.config_set("slowlog-log-slower-than", self.SLOW_US)
        self.client.config_set("slowlog-max-len", 100_000)
        self.client.slowlog_reset()
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        slow = sorted(((entry["duration"] / 1000, entry["command"][:80].decode(errors="replace"))
                       for entry in self.client.slowlog_get(100_000)), reverse=True)
        self.close()
        return {**{k: end[k] - self._start.get(k, 0.0) for k in end}, "slow_calls": len(slow),
                "slowest_ms": slow[0][0] if slow else 0.0, "slowest": slow[:10]}

    def close(self) -> None:
        """Give Redis its own slow-log settings back; safe to call again, and after a failed run."""
        config, self._config = self._config, {}
        for name, value in config.items():
            self.client.config_set(name, value)


class PingProbe:
    """What other Redis clients feel while a benchmark runs: PING round trips (ms) every ``interval``
    s between :meth:`start` and :meth:`stop`, from a process of its own (a Lua script blocks Redis
    while it runs, so a long claim shows here as a stall).  Its own process: a thread of the
    benchmark would wait for the benchmark's GIL after each reply, up to the 5 ms switch interval,
    and report that as Redis's."""

    SCRIPT = """
import select, sys, time, redis
client, samples, interval = redis.Redis.from_url(sys.argv[1]), [], float(sys.argv[2])
client.ping()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval)[0]:  # a line on stdin: stop
    t0 = time.perf_counter()
    client.ping()
    samples.append((time.perf_counter() - t0) * 1000)
print(" ".join(f"{s:.4f}" for s in samples), flush=True)
"""

    def __init__(self, url: str, interval: float = 0.005) -> None:
        self.url, self.interval = url, interval
        self.samples: list[float] = []
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-c", self.SCRIPT, self.url, str(self.interval)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the PING probe of {self.url} did not start")

    def stop(self) -> dict[str, float]:
        process, self._process = self._process, None
        if process is not None:
            out, _ = process.communicate("stop\n", timeout=30)
            self.samples = [float(v) for v in out.split()]
        return summary(self.samples)

def start_py_spy(pid: int, out: Path) -> subprocess.Popen | None:
    """``py-spy record`` of ``pid`` into ``out`` (raw collapsed stacks), if py-spy is installed."""
    if not shutil.which("py-spy"):
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--nonblocking",
                             "--format", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)


def stop_py_spy(spies: Sequence[subprocess.Popen | None], timeout: float = 20.0) -> None:
    """SIGINT each recorder (py-spy writes its file then), SIGKILL after ``timeout``."""
    live = [spy for spy in spies if spy is not None]
    for spy in live:
        if spy.poll() is None:
            spy.send_signal(signal.SIGINT)
    for spy in live:
        try:
            spy.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()


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


def plot_lags(series: dict[str, Sequence[tuple[float, float]]], path: Path, title: str,
              lag_label: str = "Kafka CreateTime - due time") -> Path:
    """Histogram, CDF and timeline of each named series of ``(seconds since first due, lag ms)`` into a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, cdf, timeline) = plt.subplots(1, 3, figsize=(17, 4.8))
    lags = [lag for points in series.values() for _, lag in points]
    low, high = (min(lags), max(lags)) if lags else (0, 1)
    step = max(1, math.ceil((high - low + 1) / 100))  # lags are whole ms: bins on whole ms
    bins = [low + i * step for i in range(int((high - low) // step) + 2)]
    for label, points in sorted(series.items(), key=lambda kv: -len(kv[1])):  # biggest first, smaller on top
        ordered = sorted(lag for _, lag in points)
        if not ordered:
            continue
        hist.hist(ordered, bins=bins, histtype="step", linewidth=1.5, label=label)
        cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
        timeline.plot([t for t, _ in points], [lag for _, lag in points], ".", markersize=1.5, alpha=0.5,
                      label=label)
    hist.set_xlabel(f"lag: {lag_label} (ms)")
    hist.set_ylabel("tasks")
    hist.set_yscale("log")
    cdf.set_xlabel("lag (ms)")
    cdf.set_ylabel("fraction of tasks")
    cdf.set_ylim(0, 1.01)
    timeline.set_xlabel("due time, seconds since the first task")
    timeline.set_ylabel("lag (ms)")
    for ax in (hist, cdf, timeline):
        ax.grid(alpha=0.3)
        ax.legend(markerscale=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save_figure(fig: Any, axes: Any, path: Path) -> Path:
    """A grid and a legend on each of ``axes``, then ``fig`` written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def profile_top(raw: Path, top: int = 25) -> list[tuple[float, str]]:
    """Frames of a ``py-spy record --format raw`` file by inclusive share of the samples."""
    total = 0
    inclusive: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        for frame in set(stack.split(";")):
            inclusive[frame] = inclusive.get(frame, 0) + n
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]
    return [(round(n / total, 3), frame) for frame, n in ranked] if total else []
