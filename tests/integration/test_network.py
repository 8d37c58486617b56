"""The chaos suite's test hosts (:mod:`tests.chaos.network`): a process in a network namespace reaches the
servers on 127.0.0.1 as any other does, a cut link drops its packets both ways until healed, a link through
its proxies (:mod:`tests.chaos.proxies`) is spoilt alone, and closing the hosts leaves no namespace, link or
rule behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from celery_delayed import store_of
from celery_delayed.store.dlq import DeadLetters
from tasks import create_app
from tests.chaos.network import Hosts, available
from tests.chaos.proxies import Proxies

from .support import wait_for

pytestmark = [pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}"),
              pytest.mark.serial]  # its first test finds no namespace or rule left by any other

#: In a host: PING the Redis on 127.0.0.1, no retries, a 1 s timeout; prints PONG or the error's name.
PING = """
import sys, redis
from redis.retry import Retry
from redis.backoff import NoBackoff
client = redis.Redis(port=int(sys.argv[1]), socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
try:
    print("PONG" if client.ping() else "no")
except redis.RedisError as exc:
    print(type(exc).__name__)
"""


def ping_from(host, port: int) -> str:
    out = subprocess.run([*host.wrap, sys.executable, "-c", PING, str(port)], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.strip() or out.stderr.strip()[-300:]


def test_a_host_reaches_the_servers_a_cut_link_drops_and_heals_and_close_leaves_nothing(services):
    port = int(services.redis_url.rsplit(":", 1)[1].split("/")[0])
    hosts = Hosts()
    try:
        cut, other = hosts.add(), hosts.add()
        assert ping_from(cut, port) == "PONG"  # through the namespace's NAT, protected mode and all
        cut.cut([port])
        assert (ping_from(cut, port), ping_from(other, port)) == ("TimeoutError", "PONG")  # one host's link only
        cut.heal()
        assert ping_from(cut, port) == "PONG"
        cut.lose([port], 1.0)  # every packet lost is a cut too
        assert ping_from(cut, port) == "TimeoutError"
    finally:
        hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert [h.name for h in (cut, other) if h.name in listed] == []
    rules = "".join(subprocess.run(["iptables", "-t", t, "-S"], capture_output=True, text=True).stdout
                    for t in ("nat", "raw"))
    assert hosts.tag not in rules


def test_a_host_routed_through_its_proxies_is_slowed_silenced_and_reset_alone(services, tmp_path):
    """:mod:`tests.chaos.proxies`: a host's connections to a server port go through a proxy of its own, whose
    toxics spoil its link only; a cut still drops its packets (the link rules act before the redirect)."""
    port = int(services.redis_url.rsplit(":", 1)[1].split("/")[0])
    hosts, proxies = Hosts(), Proxies(tmp_path, [port], seed=1)
    try:
        slowed, other = hosts.add(), hosts.add()
        proxies.route(slowed)
        assert ping_from(slowed, port) == "PONG"
        with proxies.toxic([slowed], [port], "latency", latency=3000):
            assert (ping_from(slowed, port), ping_from(other, port)) == ("TimeoutError", "PONG")
        with proxies.toxic([slowed], [port], "timeout", timeout=0):
            assert ping_from(slowed, port) == "TimeoutError"
        with proxies.toxic([slowed], [port], "reset_peer", timeout=0):
            assert ping_from(slowed, port) == "ConnectionError"
        assert ping_from(slowed, port) == "PONG"
        slowed.cut([port])
        assert ping_from(slowed, port) == "TimeoutError"
    finally:
        proxies.close()
        hosts.close()


@pytest.mark.parametrize("store_redis", ["cluster"], indirect=True)
def test_a_retry_whose_store_write_outlasts_the_soft_time_limit_is_written_not_failed(overrides, processes):
    """Review finding F7, on a real worker: cut from the store only (on the Redis Cluster; Celery's broker and
    result backend stay reachable) while its task works, the task's ``self.retry(countdown=3)`` waits for the
    store, and its soft time limit fires meanwhile.  The retry must be written once the link heals, and run:
    not turned into a failure (Celery makes SoftTimeLimitExceeded a FAILURE) and dead-lettered."""
    app = create_app(**overrides)
    store = store_of(app)
    cluster_ports = [int(os.environ.get("CD_REDIS_CLUSTER_PORT", "7001")) + n for n in range(6)]
    run = uuid.uuid4().hex
    hosts = Hosts()
    try:
        host = hosts.add()
        processes.poller()
        processes.worker("w1", wrap=host.wrap)
        # attempt 1 counts itself in the store, works 3 s, then retries; the soft limit fires at 5 s
        result = app.tasks["tasks.demo.flaky"].apply_async((run, 1, 3.0, 3.0), countdown=2, soft_time_limit=5)
        wait_for(lambda: store.redis.hget(f"demo:{run}:runs", result.id), 90, "the first attempt to start")
        host.cut(cluster_ports)
        time.sleep(8)
        host.heal()
        assert result.get(timeout=90) == 2
        assert DeadLetters(store).count() == 0
    finally:
        processes.stop_all()
        hosts.close()
