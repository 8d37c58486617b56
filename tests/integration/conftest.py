"""Fixtures for tests against the real Redis, etcd and Kafka of scripts/services.

Nothing here fakes a server: a test fails (it is not skipped) when one is down.
Each test gets its own key prefix, topic prefix, consumer group and broker
queue, so tests never see each other's tasks.

A module marked ``pytest.mark.cluster_too`` runs each of its tests twice: with
the store on the standalone Redis, and on the Redis Cluster (3 primaries, a replica each) of
``scripts/services up redis-cluster`` (the result backend and broker stay on
the standalone Redis either way).
"""
from __future__ import annotations

import os
import uuid
from typing import Iterator
from urllib.parse import urlsplit

import pytest
import redis
from confluent_kafka.admin import AdminClient

from celery_delayed.poller.leadership import make_etcd
from celery_delayed.settings import Settings

from config import celeryconfig

from .support import Processes, Servers, Toxiproxy

pytestmark = pytest.mark.integration


#: Where the servers of scripts/services answer (its CD_*_PORT environment, as the demo config reads it).
SERVERS = {name: getattr(celeryconfig, f"delayed_{name}") for name in ("redis_url", "kafka_servers", "etcd_endpoints")}


@pytest.fixture(scope="session")
def services() -> Settings:
    """The local servers answer; fail with what to run when one does not."""
    s = Settings.from_mapping(SERVERS)
    hint = "start them with: scripts/services up"
    try:
        redis.Redis.from_url(s.redis_url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {s.redis_url} is down ({exc}); {hint}")
    try:
        make_etcd(s).status()
    except Exception as exc:
        pytest.fail(f"etcd at {s.etcd_endpoints} is down ({exc}); {hint}")
    try:
        AdminClient(s.kafka()).list_topics(timeout=10)
    except Exception as exc:
        pytest.fail(f"Kafka at {s.kafka_servers} is down ({exc}); {hint}")
    return s


@pytest.fixture(scope="session")
def toxiproxy(services, tmp_path_factory) -> Iterator[Toxiproxy]:
    """A toxiproxy-server for the session (killed at its end) with proxy ``redis``, to the shared Redis:
    a test that loses replies on the way back connects through it (``toxiproxy.listen["redis"]``)."""
    server = Toxiproxy(tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.log")
    try:
        server.proxy("redis", urlsplit(services.redis_url).netloc)
        yield server
    finally:
        server.close()


#: The Redis Cluster of scripts/services (any node will do: the client finds the others).
CLUSTER_URL = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_CLUSTER_PORT', '7001')}/0"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests of ``cluster_too`` modules run on the standalone Redis and on the cluster."""
    if metafunc.definition.get_closest_marker("cluster_too") and "store_redis" in metafunc.fixturenames:
        metafunc.parametrize("store_redis", ["standalone", "cluster"], indirect=True)


@pytest.fixture
def store_redis(request, services) -> dict:
    """The store's Redis settings: none (the standalone default) or the cluster's, which must answer."""
    if getattr(request, "param", "standalone") == "standalone":
        return {}
    try:
        state = redis.RedisCluster.from_url(CLUSTER_URL, socket_connect_timeout=2).cluster_info()["cluster_state"]
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        state = str(exc)
    if state != "ok":
        pytest.fail(f"Redis Cluster at {CLUSTER_URL} is not ok ({state}); start it with: "
                    "scripts/services up redis-cluster")
    return {"delayed_redis_url": CLUSTER_URL, "delayed_redis_cluster": True}


@pytest.fixture
def overrides(services, store_redis) -> dict:
    """Celery settings that isolate this test: own prefixes, group, broker queue and result keys (a
    recurring schedule's occurrence ids derive from its id and times, the same in every test that
    uses that id: in a shared result backend, one test's finished run was another's "already ran")."""
    tag = "t" + uuid.uuid4().hex[:10]
    return {"delayed_key_prefix": tag, "delayed_topic_prefix": f"{tag}.", "delayed_consumer_group": tag,
            "delayed_partitions": 4, "delayed_lease_ttl": 2, "task_default_queue": tag,
            "result_backend_transport_options": {"global_keyprefix": f"{tag}:"},
            **{f"delayed_{name}": value for name, value in SERVERS.items()}, **store_redis}


@pytest.fixture
def processes(overrides, tmp_path, request):
    procs = Processes(tmp_path, overrides)
    yield procs
    procs.stop_all()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for proc, log in procs.procs:
            print(f"----- {log.name} -----\n{_head_and_tail(log.read_text(errors='replace'))}")


def _head_and_tail(text: str, each: int = 4000) -> str:
    """A log's start (how the process came up) and end (how it ended), for a failed test's report."""
    if len(text) <= 2 * each:
        return text
    return f"{text[:each]}\n[... {len(text) - 2 * each} characters left out ...]\n{text[-each:]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that stops or restarts a server (the ``servers`` fixture) runs alone: ``serial``."""
    for item in items:
        if "servers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def servers():
    """Stop and restart the local servers; whatever a test stopped is started again."""
    control = Servers()
    yield control
    control.restore()
