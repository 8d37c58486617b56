"""Fixtures for tests against the real Redis, etcd and Kafka of scripts/services.

Nothing here fakes a server: a test fails (it is not skipped) when one is down.
Each test gets its own key prefix, topic prefix, consumer group and broker
queue, so tests never see each other's tasks.
"""
from __future__ import annotations

import uuid

import pytest
import redis
from confluent_kafka.admin import AdminClient

from celery_delayed.leadership import make_etcd
from celery_delayed.settings import Settings

from .support import Processes, Servers

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def services() -> Settings:
    """The local servers answer; fail with what to run when one does not."""
    s = Settings.from_mapping({})
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


@pytest.fixture
def overrides(services) -> dict:
    """Celery settings that isolate this test: own prefixes, group and broker queue."""
    tag = "t" + uuid.uuid4().hex[:10]
    return {"delayed_key_prefix": tag, "delayed_topic_prefix": f"{tag}.", "delayed_consumer_group": tag,
            "delayed_partitions": 4, "delayed_lease_ttl": 2, "task_default_queue": tag}


@pytest.fixture
def processes(overrides, tmp_path, request):
    procs = Processes(tmp_path, overrides)
    yield procs
    procs.stop_all()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for proc, log in procs.procs:
            print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-4000:]}")


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
