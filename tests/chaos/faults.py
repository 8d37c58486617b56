"""The faults a chaos run injects, one small function each, and the seeded schedule they follow.

Each fault stops only what the run started (pollers and workers by PID, servers
through scripts/services, which started them) and leaves it running again; it
returns a note saying what it did.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from urllib.parse import urlparse

import redis

from celery_delayed.settings import Settings
from tests.integration.support import (ROOT, Processes, Starver, etcd3_leader, kill9, leaders, server_pid,
                                       wait_for)

from . import clock
from .network import Host, Hosts
from .proxies import Proxies

#: Seconds an etcd leader that was killed stays down: longer than an election (election timeout 1 s).
ETCD_LEADER_DOWN_S = 4.0

#: Seconds of SIGSTOP 300 ms / SIGCONT 60 ms cycles of a CPU-starved poller.
STARVE_S = 10.0
#: Longest a worker's warm shutdown may take in a deploy or a scale-in before its group is killed (s).
WARM_STOP_S = 60.0
#: Seconds the Kafka broker is stopped in each cycle of a stalled deploy (then 1 s running).
BROKER_STALL_S = 0.4
#: How long a scaled-out fleet runs before it is scaled in again (s).
SCALED_S = 10.0
#: Longest wait (s) for a killed cluster primary's replica to take over (cluster-node-timeout + election).
PROMOTION_TIMEOUT_S = 60.0
#: Nodes of the redis-cluster service of scripts/services (ports CD_REDIS_CLUSTER_PORT and on).
CLUSTER_NODES = 6
#: Seconds a link stays cut (a poller from Redis, a worker from Redis) or lossy.
CUT_S = 10.0
LOSSY_S = 20.0
#: Share of the packets a lossy link drops.
LOSS = 0.05
#: Seconds a server answers late (slow-redis, slow-kafka), not at all (silent-redis), or loses its replies.
SLOW_S = 20.0
SILENT_S = 10.0
LOST_REPLY_S = 5.0
#: Bounds of a slow server's delay (ms): a seeded centre and toxiproxy's jitter around it stay within them.
LATENCY_MS = (50, 200)
#: How far (s) a poller's and a worker's wall clocks are stepped, and for how long before they step back.
CLOCK_STEP_S = 30
CLOCK_HELD_S = 20.0


@dataclass
class Cluster:
    """The pollers and workers of a run (real OS processes) and the servers under them."""

    settings: Settings
    procs: Processes
    services_dir: Path
    pollers: list[subprocess.Popen] = field(default_factory=list)
    workers: list[subprocess.Popen] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    started: int = 0
    hosts: Hosts | None = None  # each poller and worker in its own network namespace (link faults) or all on loopback
    host_of: dict[int, Host] = field(default_factory=dict)
    proxies: Proxies | None = None  # each host's Redis and Kafka links through Toxiproxy (needs hosts)
    clocks: clock.Clocks | None = None  # each poller and worker under libfaketime (clock steps)
    clock_of: dict[int, Path] = field(default_factory=dict)

    def add_poller(self) -> subprocess.Popen:
        self.pollers.append(self._placed(lambda wrap: self.procs.poller(wrap=wrap)))
        return self.pollers[-1]

    def add_worker(self) -> subprocess.Popen:
        """A prefork worker with 2 pool children, under a name not used before in the run."""
        self.started += 1
        self.workers.append(self._placed(lambda wrap: self.procs.worker(f"w{self.started}", "-c", "2", wrap=wrap)))
        return self.workers[-1]

    def _placed(self, start: Callable[[list[str] | None], subprocess.Popen]) -> subprocess.Popen:
        """A process started by ``start(command prefix)``: in a host of its own (its links through the
        proxies) and under a clock of its own, as far as the run has them."""
        host = self.hosts.add() if self.hosts else None
        if host is not None and self.proxies is not None:
            self.proxies.route(host)
        offset = self.clocks.wrap() if self.clocks else None
        proc = start([*(host.wrap if host else []), *(offset[0] if offset else [])] or None)
        if host is not None:
            self.host_of[proc.pid] = host
        if offset is not None:
            self.clock_of[proc.pid] = offset[1]
        return proc

    def live(self) -> list[subprocess.Popen]:
        """The pollers and workers running now."""
        return [p for p in self.pollers + self.workers if p.poll() is None]

    def leading_poller(self) -> subprocess.Popen:
        """A poller that leads some partition now (by etcd), picked at random."""
        pids = sorted(set(leaders(self.settings).values()))
        live = [p for p in self.pollers if p.pid in pids and p.poll() is None]
        if not live:
            raise RuntimeError(f"no live poller of this run leads a partition (etcd says {pids})")
        return self.rng.choice(live)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its children (it leads its own process group) and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _partitions_of(cluster: Cluster, pid: int) -> list[int]:
    return sorted(p for p, leader in leaders(cluster.settings).items() if leader == pid)


def poller_kill(cluster: Cluster) -> str:
    """kill -9 of a leading poller, then a replacement poller."""
    victim = cluster.leading_poller()
    partitions = _partitions_of(cluster, victim.pid)
    _kill_group(victim)
    cluster.pollers.remove(victim)
    new = cluster.add_poller()
    return f"kill -9 poller {victim.pid} (leading {partitions}); replacement {new.pid}"


def poller_pause(cluster: Cluster) -> str:
    """SIGSTOP a leading poller past its lease, then SIGCONT: fencing must keep it from dispatching."""
    victim = cluster.leading_poller()
    partitions = _partitions_of(cluster, victim.pid)
    pause = cluster.settings.lease_ttl + 3
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        time.sleep(pause)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    return f"SIGSTOP poller {victim.pid} (leading {partitions}) for {pause} s"


def poller_starve(cluster: Cluster) -> str:
    """A leading poller starved of CPU: SIGSTOP 300 ms / SIGCONT 60 ms for :data:`STARVE_S`."""
    victim = cluster.leading_poller()
    starver = Starver(victim.pid, stop_s=0.3, run_s=0.06, limit_s=STARVE_S + 5)
    time.sleep(STARVE_S)
    starver.close()
    return f"starved poller {victim.pid}: {starver.cycles} SIGSTOP/SIGCONT cycles"


def worker_kill(cluster: Cluster) -> str:
    """kill -9 of a worker and its pool children mid-task, then a replacement worker."""
    victim = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    _kill_group(victim)
    cluster.workers.remove(victim)
    new = cluster.add_worker()
    return f"kill -9 worker {victim.pid} (process group); replacement {new.pid}"


def _start_worker(cluster: Cluster) -> subprocess.Popen:
    """A new worker, once it is ready (consuming)."""
    worker = cluster.add_worker()
    wait_for(lambda: "ready." in cluster.procs.log(worker), 60, f"worker {worker.pid} to be ready")
    return worker


def _warm_stop(cluster: Cluster, worker: subprocess.Popen) -> bool:
    """A warm shutdown (SIGTERM to the main process), as a deploy or a scale-in does; False when it
    took longer than :data:`WARM_STOP_S` and the worker was killed."""
    status = cluster.procs.warm_stop(worker, timeout=WARM_STOP_S)
    cluster.workers.remove(worker)
    return status == 0


def _all_warm(note: str, unwarm: list[int]) -> str:
    """The fault's note, or a failure naming the workers whose warm shutdown hung (the run goes on:
    they were killed, as an orchestrator would; what they held must still run once)."""
    if unwarm:
        raise RuntimeError(f"{note}; workers {unwarm} did not stop warm within {WARM_STOP_S:.0f} s (killed)")
    return note


def rolling_deploy(cluster: Cluster) -> str:
    """Every worker in turn: a warm shutdown, then a new worker started and waited for."""
    notes, unwarm = [], []
    for old in [w for w in cluster.workers if w.poll() is None]:
        if not _warm_stop(cluster, old):
            unwarm.append(old.pid)
        notes.append(f"{old.pid} -> {_start_worker(cluster).pid}")
    return _all_warm("rolling deploy: " + ", ".join(notes), unwarm)


def stalled_deploy(cluster: Cluster) -> str:
    """A rolling deploy while the Kafka broker is starved of CPU (SIGSTOP :data:`BROKER_STALL_S`, then
    SIGCONT for 1 s, over and over): the workers leave and join a group whose coordinator answers late
    (a warm stop froze a worker for good in confluent-kafka's rebalance fallback this way)."""
    pid = server_pid("kafka")
    starver = Starver(pid, stop_s=BROKER_STALL_S, run_s=1.0, limit_s=10 * WARM_STOP_S)
    try:
        note = rolling_deploy(cluster)
    finally:
        starver.close()
    return f"{note}; Kafka broker {pid} stalled {starver.cycles} times"


def scale(cluster: Cluster) -> str:
    """Scale out to twice the workers, let the group settle, then scale in (warm) the oldest half."""
    old = [w for w in cluster.workers if w.poll() is None]
    new = [_start_worker(cluster).pid for _ in old]
    time.sleep(SCALED_S)
    unwarm = [w.pid for w in old if not _warm_stop(cluster, w)]
    return _all_warm(f"scaled out by {new}, then in without {[w.pid for w in old]}", unwarm)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def child_kill(cluster: Cluster) -> str:
    """kill -9 of one pool child of a worker (the worker's pool starts another); a worker that has
    just started may have none yet, so this waits (at most 20 s) for one that has."""
    deadline = time.monotonic() + 20
    while True:
        pools = {w.pid: _children(w.pid) for w in cluster.workers if w.poll() is None}
        pools = {pid: children for pid, children in pools.items() if children}
        if pools or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not pools:
        raise RuntimeError("no worker has a pool child")
    worker = cluster.rng.choice(sorted(pools))
    child = cluster.rng.choice(pools[worker])
    os.kill(child, signal.SIGKILL)
    return f"kill -9 pool child {child} of worker {worker}"


def _services(*args: str) -> str:
    """Run ``scripts/services ARGS`` (this run's CD_* environment); its output as one line."""
    out = subprocess.run([str(ROOT / "scripts" / "services"), *args], check=True, capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().replace("\n", "; ")


def redis_kill9(cluster: Cluster) -> str:
    """kill -9 of the store's Redis (AOF, appendfsync everysec), then ``scripts/services up redis``."""
    pid = kill9("redis")
    return f"kill -9 redis {pid}; " + _services("up", "redis")


def redis_failover(cluster: Cluster, key: str | None = None) -> str:
    """kill -9 of the Redis Cluster primary holding the most store partitions (or ``key``); once its
    replica is promoted (every live node says cluster_state:ok), ``scripts/services up`` of the
    killed node, which rejoins as a replica.  Writes the primary acknowledged but had not sent to its
    replica yet (asynchronous replication, microseconds to milliseconds of them) are lost to the failover."""
    settings = cluster.settings
    if not settings.redis_cluster:
        raise RuntimeError("redis-failover needs the store on the Redis Cluster (--store cluster)")
    base = int(os.environ.get("CD_REDIS_CLUSTER_PORT", "7001"))
    client = redis.RedisCluster.from_url(settings.redis_url)
    try:
        held: dict[int, list[int]] = {}
        for p in range(settings.partitions):
            held.setdefault(client.get_node_from_key(f"{settings.key_prefix}:{{{p}}}:msg").port, []).append(p)
        port = client.get_node_from_key(key).port if key else max(held, key=lambda k: (len(held[k]), -k))
    finally:
        client.close()
    name = f"redis-cluster-{port - base + 1}"
    replica = _replica_of(port)
    start = time.monotonic()
    pid = kill9(name)
    live = [base + i for i in range(CLUSTER_NODES) if base + i != port]
    while True:
        if _role(replica) == "master" and all(_cluster_state(p) == "ok" for p in live):
            break
        if time.monotonic() - start > PROMOTION_TIMEOUT_S:
            raise RuntimeError(f"replica {replica} of {name} not promoted within {PROMOTION_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
    promoted_s = time.monotonic() - start
    back = _services("up", name)
    return (f"kill -9 {name} (port {port}, pid {pid}, primary of partitions {held.get(port, [])}); its replica on port "
            f"{replica} promoted, cluster_state:ok after {promoted_s:.1f} s; {back}; {name} is now "
            f"{'a replica' if _role(port) == 'slave' else _role(port)}")


def _node(port: int) -> redis.Redis:
    return redis.Redis("127.0.0.1", port, socket_timeout=2, socket_connect_timeout=1)


def _replica_of(port: int) -> int:
    """Port of the (first) replica of the primary on ``port``."""
    info = _node(port).info("replication")
    if info.get("role") != "master" or not info.get("slave0"):
        raise RuntimeError(f"node on port {port} is not a primary with a replica: {info}")
    return int(info["slave0"]["port"])


def _role(port: int) -> str:
    try:
        return _node(port).info("replication")["role"]
    except redis.RedisError:
        return "down"


def _cluster_state(port: int) -> str:
    try:
        return _node(port).cluster("info")["cluster_state"]
    except redis.RedisError:
        return "down"


def _restart(name: str, outage_s: float = 0.0, wipe: Path | None = None) -> str:
    """``scripts/services down NAME``, ``outage_s`` later (and ``wipe`` deleted) ``up NAME``."""
    note = _services("down", name)
    time.sleep(outage_s)
    if wipe is not None:
        shutil.rmtree(wipe)
    return note + "; " + _services("up", name)


def redis_restart(cluster: Cluster) -> str:
    """A clean restart of Redis (SIGTERM: the AOF is flushed), so nothing is lost."""
    return _restart("redis")


def kafka_restart(cluster: Cluster) -> str:
    return _restart("kafka")


def kafka_outage(cluster: Cluster) -> str:
    """Kafka down longer than the poller's ``message.timeout.ms`` (see :func:`celery_delayed.kafka.make_producer`)."""
    timeout_s = min(30.0, cluster.settings.visibility_timeout * 0.8)
    return f"down for {timeout_s + 5:.0f} s: " + _restart("kafka", outage_s=timeout_s + 5)


#: The etcd the run's pollers lead through: the 3-member cluster of ``scripts/services up etcd3``.
ETCD = "etcd3"


def etcd_restart(cluster: Cluster) -> str:
    """Every member of the etcd cluster stopped (SIGTERM), then the cluster started again with its data."""
    return _restart(ETCD)


def etcd_wipe(cluster: Cluster) -> str:
    """Every member stopped and its data deleted, then a new cluster bootstrapped: revisions from 1 again."""
    return _restart(ETCD, wipe=cluster.services_dir / ETCD)


def etcd_leader_kill(cluster: Cluster) -> str:
    """kill -9 of the etcd cluster's raft leader; the other two elect a new one while it stays down
    :data:`ETCD_LEADER_DOWN_S`, then it is started again (``scripts/services up etcd3-N``) and rejoins."""
    member = etcd3_leader()
    if member is None:
        raise RuntimeError("the etcd cluster has no leader now")
    pid = kill9(f"{ETCD}-{member}")
    time.sleep(ETCD_LEADER_DOWN_S)
    after = etcd3_leader()
    return (f"kill -9 etcd leader {ETCD}-{member} (pid {pid}); new leader {ETCD}-{after} after "
            f"{ETCD_LEADER_DOWN_S:.0f} s; " + _services("up", f"{ETCD}-{member}"))


def _ports(urls: str) -> list[int]:
    """The ports of comma-separated URLs or host:port pairs."""
    return sorted({urlparse(u if "//" in u else f"//{u}").port for u in urls.split(",")})


def _store_ports(settings: Settings) -> list[int]:
    """The ports of the delayed store's Redis: each node of a cluster."""
    ports = _ports(settings.redis_url)
    return [ports[0] + n for n in range(CLUSTER_NODES)] if settings.redis_cluster else ports


def _host(cluster: Cluster, proc: subprocess.Popen) -> Host:
    if cluster.hosts is None:
        raise RuntimeError("link faults need the run's processes in network namespaces (root, ip, iptables)")
    return cluster.host_of[proc.pid]


def _cut(host: Host, ports: list[int], seconds: float) -> None:
    """The links from ``host`` to ``ports`` cut for ``seconds``, then healed."""
    host.cut(ports)
    try:
        time.sleep(seconds)
    finally:
        host.heal()


def partition_poller_etcd(cluster: Cluster) -> str:
    """A leading poller loses etcd only (Redis and Kafka still reachable), for twice its lease: fenced, it
    must stop dispatching before its lease lapses, and a standby takes its partitions over."""
    victim = cluster.leading_poller()
    before = _partitions_of(cluster, victim.pid)
    cut_s = cluster.settings.lease_ttl * 2 + 2
    host = _host(cluster, victim)
    host.cut(_ports(cluster.settings.etcd_endpoints))
    try:
        time.sleep(cut_s)
        during = leaders(cluster.settings)
    finally:
        host.heal()
    moved = {p: during.get(p) for p in before}
    return f"poller {victim.pid} (leading {before}) cut from etcd for {cut_s} s; then led by {moved}"


def partition_poller_redis(cluster: Cluster) -> str:
    """A leading poller loses the store's Redis only, for :data:`CUT_S`."""
    victim = cluster.leading_poller()
    _cut(_host(cluster, victim), _store_ports(cluster.settings), CUT_S)
    return f"poller {victim.pid} (leading {_partitions_of(cluster, victim.pid)}) cut from the store for {CUT_S:.0f} s"


def partition_worker_redis(cluster: Cluster) -> str:
    """A worker loses Redis (the store, Celery's broker and result backend) while it runs tasks, for :data:`CUT_S`."""
    victim = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    ports = redis_ports(cluster.settings)
    _cut(_host(cluster, victim), ports, CUT_S)
    return f"worker {victim.pid} cut from Redis (ports {ports}) for {CUT_S:.0f} s"


def partition_worker_kafka(cluster: Cluster) -> str:
    """A worker loses Kafka only, while its tasks run, past the group session (6 s, 10 s classic): the group
    gives its partitions to the others."""
    victim = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    cut_s = 20.0
    _cut(_host(cluster, victim), _ports(cluster.settings.kafka_servers), cut_s)
    return f"worker {victim.pid} cut from Kafka for {cut_s:.0f} s"


def lossy_kafka(cluster: Cluster) -> str:
    """A leading poller's and a worker's links to Kafka drop :data:`LOSS` of their packets for :data:`LOSSY_S`."""
    poller = cluster.leading_poller()
    worker = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    hosts = [_host(cluster, poller), _host(cluster, worker)]
    try:
        for host in hosts:
            host.lose(_ports(cluster.settings.kafka_servers), LOSS)
        time.sleep(LOSSY_S)
    finally:
        for host in hosts:
            host.heal()
    return f"{LOSS:.0%} packet loss between Kafka and poller {poller.pid}, worker {worker.pid} for {LOSSY_S:.0f} s"


def _proxies(cluster: Cluster) -> Proxies:
    if cluster.proxies is None:
        raise RuntimeError("proxy faults need the run's links through Toxiproxy (network namespaces)")
    return cluster.proxies


def redis_ports(settings: Settings) -> list[int]:
    """Ports of every Redis the pollers and workers use: the store's (each cluster node) and Celery's broker."""
    return sorted({*_store_ports(settings), int(os.environ.get("CD_REDIS_PORT", "6379"))})


def _toxic_for(cluster: Cluster, procs: list[subprocess.Popen], ports: list[int], seconds: float, kind: str,
               **attributes: object) -> None:
    """Toxic ``kind`` on the replies from ``ports`` to ``procs`` for ``seconds``."""
    with _proxies(cluster).toxic([_host(cluster, p) for p in procs], ports, kind, **attributes):
        time.sleep(seconds)


def _slow(cluster: Cluster, ports: list[int], what: str) -> str:
    """Every reply from ``ports`` to every poller and worker :data:`LATENCY_MS` late for :data:`SLOW_S`: a
    seeded centre, toxiproxy's jitter around it (drawn per chunk, toxiproxy seeded by the run) within the bounds."""
    low, high = LATENCY_MS
    centre = cluster.rng.randint(low + 25, high - 25)
    jitter = min(centre - low, high - centre)
    procs = cluster.live()
    _toxic_for(cluster, procs, ports, SLOW_S, "latency", latency=centre, jitter=jitter)
    return (f"{what} answered {centre} ± {jitter} ms late to {len(procs)} pollers and workers for {SLOW_S:.0f} s "
            f"(toxiproxy latency)")


def slow_redis(cluster: Cluster) -> str:
    return _slow(cluster, redis_ports(cluster.settings), "Redis")


def kafka_ports(settings: Settings) -> list[int]:
    return _ports(settings.kafka_servers)


def slow_kafka(cluster: Cluster) -> str:
    return _slow(cluster, kafka_ports(cluster.settings), "Kafka")


def silent_redis(cluster: Cluster) -> str:
    """Redis accepts every poller's and worker's connections and requests but answers none, for
    :data:`SILENT_S` (toxiproxy ``timeout`` 0: the replies are held back, the connections left open)."""
    procs = cluster.live()
    _toxic_for(cluster, procs, redis_ports(cluster.settings), SILENT_S, "timeout", timeout=0)
    return f"Redis silent to {len(procs)} pollers and workers for {SILENT_S:.0f} s (toxiproxy timeout)"


def lost_reply(cluster: Cluster) -> str:
    """A leading poller and a worker lose every Redis reply for :data:`LOST_REPLY_S`: the command ran, then
    its connection was reset before the reply came back (toxiproxy ``reset_peer`` downstream)."""
    poller = cluster.leading_poller()
    worker = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    _toxic_for(cluster, [poller, worker], redis_ports(cluster.settings), LOST_REPLY_S, "reset_peer", timeout=0)
    return (f"Redis replies to poller {poller.pid} (leading {_partitions_of(cluster, poller.pid)}) and worker "
            f"{worker.pid} reset after the command ran, for {LOST_REPLY_S:.0f} s (toxiproxy reset_peer)")


def clock_step(cluster: Cluster) -> str:
    """The wall clocks of a leading poller and of a worker stepped by ±:data:`CLOCK_STEP_S` (each its own
    seeded sign), monotonic clocks untouched; stepped back after :data:`CLOCK_HELD_S`."""
    if cluster.clocks is None:
        raise RuntimeError("clock steps need the run's processes under libfaketime")
    poller = cluster.leading_poller()
    worker = cluster.rng.choice([w for w in cluster.workers if w.poll() is None])
    steps = {proc.pid: cluster.rng.choice((CLOCK_STEP_S, -CLOCK_STEP_S)) for proc in (poller, worker)}
    try:
        for pid, seconds in steps.items():
            clock.step(cluster.clock_of[pid], seconds)
        time.sleep(CLOCK_HELD_S)
    finally:
        for pid in steps:
            clock.step(cluster.clock_of[pid], 0)
    return (f"wall clock of poller {poller.pid} (leading {_partitions_of(cluster, poller.pid)}) stepped "
            f"{steps[poller.pid]:+d} s, of worker {worker.pid} {steps[worker.pid]:+d} s, for {CLOCK_HELD_S:.0f} s "
            "(libfaketime, monotonic clock real), then back")


FAULTS: dict[str, Callable[[Cluster], str]] = {
    "poller-kill": poller_kill, "poller-pause": poller_pause, "poller-starve": poller_starve,
    "worker-kill": worker_kill, "child-kill": child_kill, "redis-kill9": redis_kill9,
    "redis-restart": redis_restart, "kafka-restart": kafka_restart, "etcd-restart": etcd_restart,
    "kafka-outage": kafka_outage, "etcd-wipe": etcd_wipe, "etcd-leader-kill": etcd_leader_kill,
    "redis-failover": redis_failover, "rolling-deploy": rolling_deploy, "scale": scale,
    "stalled-deploy": stalled_deploy,
    "partition-poller-etcd": partition_poller_etcd, "partition-poller-redis": partition_poller_redis,
    "partition-worker-redis": partition_worker_redis, "partition-worker-kafka": partition_worker_kafka,
    "lossy-kafka": lossy_kafka, "slow-redis": slow_redis, "slow-kafka": slow_kafka, "silent-redis": silent_redis,
    "lost-reply": lost_reply, "clock-step": clock_step,
}
#: Faults of one host's links, which need the run's processes in network namespaces (:mod:`.network`).
LINKS = ["partition-poller-etcd", "partition-poller-redis", "partition-worker-redis", "partition-worker-kafka",
         "lossy-kafka", "slow-redis", "slow-kafka", "silent-redis", "lost-reply"]
#: Link faults that need each host's links through Toxiproxy (:mod:`.proxies`).
PROXIED = ["slow-redis", "slow-kafka", "silent-redis", "lost-reply"]
#: Faults that need the run's processes under libfaketime (:mod:`.clock`).
CLOCKED = ["clock-step"]
#: Faults that need the store on the Redis Cluster (``--store cluster``).
CLUSTER_ONLY = ["redis-failover"]
#: The quick profile's default: one of each cheap fault, Redis restarted cleanly (nothing may be lost).
QUICK = ["poller-kill", "poller-pause", "poller-starve", "worker-kill", "child-kill", "redis-restart",
         "kafka-restart", "etcd-restart", "etcd-leader-kill", "rolling-deploy", "partition-poller-etcd"]
#: Faults run after all others (the rest are measured first): a wipe starts etcd over (a new fencing epoch).
LAST = ["etcd-wipe"]

#: The servers (scripts/services names, each with its pid file) a fault stops, stalls or restarts.
SERVERS = {"redis-kill9": ["redis"], "redis-restart": ["redis"], "kafka-restart": ["kafka"],
           "stalled-deploy": ["kafka"],
           "kafka-outage": ["kafka"], "etcd-restart": [f"{ETCD}-{m}" for m in (1, 2, 3)],
           "etcd-wipe": [f"{ETCD}-{m}" for m in (1, 2, 3)], "etcd-leader-kill": [f"{ETCD}-{m}" for m in (1, 2, 3)],
           "redis-failover": [f"redis-cluster-{n}" for n in range(1, CLUSTER_NODES + 1)]}


def schedule(rng: random.Random, names: list[str], times: int, start_s: float, end_s: float
             ) -> list[tuple[float, str]]:
    """``(seconds into the run, fault)`` pairs: each fault ``times`` times at random moments in
    ``[start_s, end_s]``, in time order, those of :data:`LAST` after all others."""
    plan = sorted((rng.uniform(start_s, end_s), name) for name in names if name not in LAST for _ in range(times))
    last = [name for name in names if name in LAST for _ in range(times)]
    after = plan[-1][0] if plan else start_s
    return plan + sorted((rng.uniform(after, end_s), name) for name in last)


@dataclass
class Injected:
    """One fault as it happened: epoch ms of its start and end, and what it did."""

    name: str
    start_ms: int
    end_ms: int
    note: str


def inject(cluster: Cluster, name: str) -> Injected:
    """Run one fault, timing it; a fault that fails is recorded with its error, not raised."""
    start_ms = int(time.time() * 1000)
    try:
        note = FAULTS[name](cluster)
    except Exception as exc:  # noqa: BLE001 - the run goes on, the report names the failure
        note = f"FAILED: {type(exc).__name__}: {exc}"
    return Injected(name, start_ms, int(time.time() * 1000), note)
