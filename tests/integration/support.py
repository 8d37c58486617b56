"""Helpers for integration tests: real subprocesses and patient waiting."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import Counter
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from confluent_kafka import Consumer

from celery_delayed.envelope import Envelope
from celery_delayed.kafka import ensure_topics
from celery_delayed.poller.leadership import make_etcd
from celery_delayed.poller.loop import Poller
from celery_delayed.settings import Settings
from celery_delayed.store.keys import Keys
from tasks.processes import ROOT, Processes, environment, free_port, wait_for

#: The process helpers live in tasks.processes (the benchmarks use them too); the tests import them here.
__all__ = ["ETCD3_ENDPOINTS", "ETCD3_MEMBERS", "Processes", "ROOT", "SERVICES_DIR", "Servers", "SilentServer",
           "Starver", "TopicReader", "Toxiproxy", "answers", "cut_redis_connections", "envelopes", "environment",
           "etcd3_leader", "etcd3_port", "etcd3_status", "kill9", "leaders", "own_redis", "run_briefly", "server_pid",
           "wait_for",
           "wait_for_wake_up"]

SERVICES_DIR = Path(os.environ.get("CD_SERVICES_DIR", ROOT / ".services"))

#: The 3-member etcd cluster of ``scripts/services up etcd3`` (member N on CD_ETCD3_PORT + 2(N-1), as there).
ETCD3_MEMBERS = 3


def etcd3_port(member: int) -> int:
    """Client port of etcd3 member ``member`` (1..3)."""
    return int(os.environ.get("CD_ETCD3_PORT", "2391")) + 2 * (member - 1)


#: ``delayed_etcd_endpoints`` for the etcd3 cluster: every member, so a client can fail over.
ETCD3_ENDPOINTS = ",".join(f"http://127.0.0.1:{etcd3_port(m)}" for m in range(1, ETCD3_MEMBERS + 1))


def etcd3_status() -> dict[int, dict]:
    """``etcdctl endpoint status`` of each etcd3 member that answers: member -> its ``Status``."""
    found = {}
    for member in range(1, ETCD3_MEMBERS + 1):
        out = subprocess.run(["etcdctl", "--endpoints", f"127.0.0.1:{etcd3_port(member)}", "--dial-timeout=1s",
                              "--command-timeout=2s", "endpoint", "status", "--write-out", "json"],
                             env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, text=True)
        if out.returncode == 0:
            found[member] = json.loads(out.stdout)[0]["Status"]
    return found


def etcd3_leader() -> int | None:
    """The etcd3 member (1..3) that is the cluster's raft leader now, by the members that answer."""
    for member, status in etcd3_status().items():
        if status.get("leader") and status["leader"] == status["header"]["member_id"]:
            return member
    return None


def cut_redis_connections(client, pid: int) -> int:
    """Close the Redis connections process ``pid`` holds (``CLIENT KILL`` of each by its address),
    and no other client's: a worker's broker connection drops, other tests on the server go on.
    Returns how many were closed."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    closed = 0
    for client_info in client.client_list():
        if int(client_info["addr"].rpartition(":")[2]) in ports:
            try:
                closed += bool(client.client_kill(client_info["addr"]))
            except redis.ResponseError as exc:  # it closed between the list and the kill: cut all the same
                if "No such client" not in str(exc):
                    raise
                closed += 1
    return closed


@contextmanager
def own_redis(workdir: Path, *config: str) -> Iterator[redis.Redis]:
    """A redis-server of the test's own, on a free port, in ``workdir``, with ``config`` (``--name value``
    arguments), for states the shared servers must never be put in (full, read-only, an ACL); a client
    of it once it answers PING.  Killed by its PID at the end."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                               "--save", "", "--appendonly", "no", *config],
                              stdout=(workdir / "redis.log").open("wb"), stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    try:
        wait_for(lambda: answers(client), 10, f"redis-server on port {port} (log: {workdir / 'redis.log'})")
        yield client
    finally:
        client.close()
        server.kill()
        server.wait()


def answers(client: redis.Redis) -> bool:
    """Whether a Redis answers PING now."""
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def server_pid(name: str) -> int:
    """The pid of the server ``name`` that scripts/services started (its pid file)."""
    return int((SERVICES_DIR / "run" / f"{name}.pid").read_text())


def wait_for_wake_up(pubsub: Any, due_ms: int, timeout: float = 5.0) -> None:
    """Wait for the pollers' wake-up naming ``due_ms`` on ``pubsub`` (subscribed to the store's wake
    channel).  An earlier write's wake-up can still arrive after the subscription (a cluster relays a
    PUBLISH to the other nodes over its bus) and is skipped."""
    def woke() -> bool:
        message = pubsub.get_message(timeout=0.5)
        return message is not None and int(message["data"]) == due_ms
    wait_for(woke, timeout, f"the wake-up for due time {due_ms}")


def kill9(name: str) -> int:
    """``kill -9`` of the server ``name`` that scripts/services started (its pid file); waits until
    it is gone and returns its pid.  Start it again with ``scripts/services up NAME``."""
    pid = server_pid(name)
    os.kill(pid, signal.SIGKILL)
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        time.sleep(0.05)
    return pid


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def run_briefly(poller: Poller, timeout: float = 30.0) -> BaseException | None:
    """Run ``poller`` in a thread, as at start-up; what it raised, or fail (stopping it) if it still runs."""
    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(poller.run)
        try:
            return future.exception(timeout=timeout)
        except FuturesTimeout:
            poller.stop()
            pytest.fail(f"the poller was still running after {timeout} s: it did not refuse to start")


def envelopes(n: int, queue: str, due_ms: int, prefix: str = "task", task: str = "tasks.demo.add"
              ) -> Iterator[tuple[str, int, bytes]]:
    """``n`` stored messages of ``task`` as Celery's JSON serializer builds them."""
    for i in range(n):
        task_id = f"{prefix}-{i}"
        headers = {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "retries": 0,
                   "eta": "2000-01-01T00:00:00+00:00", "expires": None, "timelimit": [None, None],
                   "argsrepr": f"({i}, {i})", "kwargsrepr": "{}", "origin": "test"}
        body = json.dumps([[i, i], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        yield task_id, due_ms, Envelope(task_id=task_id, queue=queue, headers=headers, body=body.encode(),
                                        content_type="application/json", content_encoding="utf-8",
                                        properties={"correlation_id": task_id}).encode()


class TopicReader:
    """Reads a topic from its start with a private consumer group, counting records per key (and
    keeping each key's values, with ``values``)."""

    def __init__(self, settings: Settings, topic: str, values: bool = False) -> None:
        ensure_topics(settings, [topic[len(settings.topic_prefix):]])
        self.topic = topic
        self.keys: Counter[str] = Counter()
        self.values: dict[str, list[bytes]] | None = {} if values else None
        self.consumer = Consumer(settings.kafka(**{"group.id": f"reader-{uuid.uuid4().hex}",
                                                   "auto.offset.reset": "earliest",
                                                   "enable.auto.commit": False}))
        self.consumer.subscribe([topic])

    def read(self, timeout: float = 0.5) -> int:
        """Read what is there now; returns how many records came."""
        records = self.consumer.consume(num_messages=10_000, timeout=timeout)
        for record in records:
            if not record.error():
                self.keys[record.key().decode()] += 1
                if self.values is not None:
                    self.values.setdefault(record.key().decode(), []).append(record.value())
        return len(records)

    def read_until(self, unique: int, timeout: float) -> Counter:
        """Read until ``unique`` distinct keys were seen (or ``timeout`` s passed)."""
        deadline = time.monotonic() + timeout
        while len(self.keys) < unique and time.monotonic() < deadline:
            self.read()
        return self.keys

    def close(self) -> None:
        self.consumer.close()


def leaders(settings: Settings) -> dict[int, int]:
    """Partition -> PID of the poller leading it, read from etcd."""
    etcd = make_etcd(settings)
    found = {}
    for value, meta in etcd.get_prefix(Keys(settings.key_prefix).leaders()):
        found[int(meta.key.decode().rsplit("/", 1)[1])] = int(value.decode().rsplit("-", 2)[1])
    return found


class Servers:
    """Real outages: stops and restarts a server that scripts/services started."""

    def __init__(self) -> None:
        self.run_dir = SERVICES_DIR / "run"
        self.stopped: list[str] = []

    def require_ours(self, name: str) -> None:
        """Skip unless scripts/services started ``name`` (for the etcd3 cluster: each of its members)."""
        pids = [f"{name}-{m}.pid" for m in range(1, ETCD3_MEMBERS + 1)] if name == "etcd3" else [f"{name}.pid"]
        if not all((self.run_dir / pid).exists() for pid in pids):
            pytest.skip(f"{name} was not started by scripts/services, so this test may not stop it")

    def stop(self, name: str) -> None:
        self.require_ours(name)
        subprocess.run([str(ROOT / "scripts" / "services"), "down", name], check=True, capture_output=True)
        self.stopped.append(name)

    def start(self, name: str) -> None:
        subprocess.run([str(ROOT / "scripts" / "services"), "up", name], check=True, capture_output=True)
        self.stopped.remove(name)

    def kill(self, name: str) -> int:
        """``kill -9`` of a server (started again by :meth:`start`, or at teardown); its pid."""
        self.require_ours(name)
        pid = kill9(name)
        self.stopped.append(name)
        return pid

    def wipe(self, name: str) -> None:
        """Stop a server, delete its data directory, start it again: a server recreated without a volume."""
        self.stop(name)
        shutil.rmtree(self.run_dir.parent / name)
        self.start(name)

    def restore(self) -> None:
        for name in list(self.stopped):
            self.start(name)


class Toxiproxy:
    """A toxiproxy-server (``scripts/services toxiproxy``) of this test session on a free loopback
    port, driven through its HTTP API: proxies whose traffic a test spoils with a toxic."""

    def __init__(self, log: Path, seed: int | None = None) -> None:
        """``seed``: of the toxics' random draws (a latency's jitter), else toxiproxy's own."""
        binary = SERVICES_DIR / "bin" / "toxiproxy-server"
        if not binary.exists():
            pytest.fail(f"{binary} is missing: install it with scripts/services toxiproxy")
        port = free_port()
        self.api = f"http://127.0.0.1:{port}"
        self.listen: dict[str, str] = {}  # proxy name -> its address, host:port
        seeded = [] if seed is None else ["-seed", str(seed)]
        with open(log, "ab") as out:  # LOG_LEVEL info: not a line per connection
            self.process = subprocess.Popen([str(binary), "-host", "127.0.0.1", "-port", str(port), *seeded],
                                            env={**os.environ, "LOG_LEVEL": "info"},
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self._answers, 10, f"toxiproxy-server on port {port} (log: {log})")

    def _answers(self) -> bool:
        try:
            return bool(self._call("GET", "/version"))
        except OSError:
            return False

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        request = urllib.request.Request(self.api + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            text = reply.read()
        return json.loads(text) if text.strip().startswith((b"{", b"[")) else text

    def proxy(self, name: str, upstream: str) -> str:
        """A proxy to ``upstream`` (host:port) on a free loopback port; its address, host:port."""
        self.listen[name] = self._call("POST", "/proxies", {"name": name, "listen": "127.0.0.1:0",
                                                            "upstream": upstream})["listen"]
        return self.listen[name]

    @contextlib.contextmanager
    def toxic(self, names: list[str], kind: str, stream: str = "downstream", **attributes: Any) -> Iterator[None]:
        """While inside: toxic ``kind`` (with ``attributes``) on the ``stream`` of each proxy in ``names``."""
        added = []
        try:
            for name in names:
                self._call("POST", f"/proxies/{name}/toxics", {"name": kind, "type": kind, "stream": stream,
                                                               "attributes": attributes})
                added.append(name)
            yield
        finally:
            for name in added:
                self._call("DELETE", f"/proxies/{name}/toxics/{kind}")

    def replies_lost(self, name: str) -> contextlib.AbstractContextManager[None]:
        """While inside: every reply that comes back through proxy ``name`` resets its connection
        (toxic ``reset_peer`` downstream), so a request reaches the server and its reply is lost."""
        return self.toxic([name], "reset_peer", timeout=0)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Starver:
    """Starves a process of CPU as a busy host or a cgroup quota does: SIGSTOP for ``stop_s``,
    SIGCONT for ``run_s``, over and over, from a thread, until :meth:`close` (or ``limit_s``).
    The process is always left running."""

    def __init__(self, pid: int, stop_s: float = 0.3, run_s: float = 0.06, limit_s: float = 300.0) -> None:
        self.pid, self.stop_s, self.run_s, self.limit_s = pid, stop_s, run_s, limit_s
        self.cycles = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._starve, name="starver", daemon=True)
        self._thread.start()

    def _starve(self) -> None:
        deadline = time.monotonic() + self.limit_s
        try:
            while not self._done.is_set() and time.monotonic() < deadline:
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.cycles += 1
                self._done.wait(self.run_s)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (a hung broker), for
    at most ``limit_s``; ``port`` is where it listens.  A context manager: closed, with every
    connection it accepted, on exit."""

    def __init__(self, limit_s: float = 300.0) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._accepted: list[socket.socket] = []
        self._done = threading.Event()
        self._limit_s = limit_s
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        deadline = time.monotonic() + self._limit_s
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                self._accepted.append(self._listener.accept()[0])
            except socket.timeout:
                pass
        for sock in [*self._accepted, self._listener]:
            sock.close()

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *_: Any) -> None:
        self._done.set()
        self._thread.join(timeout=10)


def held_by_workers(app: Any, run: str) -> list[dict]:
    """The ETA requests Celery's workers hold in memory for one test's ``run`` (among their
    arguments): every worker on the shared broker answers ``inspect``, other tests' too, and on a busy
    machine none may within one call's timeout: asked again until one does."""
    held = wait_for(lambda: app.control.inspect(timeout=2).scheduled(), 30, "a worker to answer inspect().scheduled()")
    return [t for tasks in held.values() for t in tasks if run in (t["request"].get("args") or ())]
