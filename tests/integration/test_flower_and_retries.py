"""What a Celery user sees: retries through the store, and Flower showing Kafka-fed tasks."""
from __future__ import annotations

import json
import os
import urllib.request
import uuid

from celery_delayed import store_of
from tasks import create_app

from .support import held_by_workers, wait_for


def test_retry_with_countdown_goes_through_the_store_and_keeps_its_id(overrides, processes):
    app = create_app(**overrides)
    store = store_of(app)
    run = uuid.uuid4().hex
    result = app.tasks["tasks.demo.flaky"].apply_async((run, 2, 3.0), countdown=1.5)
    processes.poller()
    processes.worker("w1")
    # After the first failure the retry (same task id) waits in the store, not in a worker.
    entry = wait_for(lambda: (lambda e: e if e and e["state"] == "scheduled" else None)(store.get(result.id)),
                     60, "the retry to be scheduled in the store")
    assert entry["task"] == "tasks.demo.flaky"
    assert held_by_workers(app, run) == []
    assert result.get(timeout=90) == 3


def test_a_task_that_retried_then_replaces_itself_runs_its_replacement(overrides, processes):
    """F6: ``self.retry(countdown=2)``, then ``self.replace(sig.set(countdown=3))``: the replacement
    keeps the task id and starts over at ``retries`` 0, so the record of the first attempt's retry
    refused it as finished, and the task stayed RETRY for ever.  It runs now, once."""
    import redis

    app = create_app(**overrides)
    run = uuid.uuid4().hex
    result = app.tasks["tasks.demo.retry_then_replace"].apply_async((run,), countdown=1.5)
    processes.poller()
    processes.worker("w1")
    assert result.get(timeout=60) == result.id  # the replacement (tasks.demo.work) returns its id
    runs = redis.Redis.from_url(app.conf.delayed_redis_url).hgetall(f"demo:{run}:runs")
    assert runs == {result.id.encode(): b"1"}


def http_json(url: str):
    try:
        return json.loads(urllib.request.urlopen(url, timeout=5).read())
    except (OSError, ValueError):
        return None


def test_flower_lists_kafka_fed_tasks_workers_and_store_metrics(overrides, processes):
    app = create_app(**overrides)
    port = 15600 + os.getpid() % 300
    processes.start("flower", "flower", f"--port={port}", "--address=127.0.0.1",
                    env={"FLOWER_UNAUTHENTICATED_API": "true"})
    processes.poller()
    processes.worker("w1")
    result = app.tasks["tasks.demo.add"].apply_async((5, 6), countdown=2)
    later = app.tasks["tasks.demo.add"].apply_async((1, 1), countdown=3600)
    assert result.get(timeout=60) == 11

    base = f"http://127.0.0.1:{port}"
    tasks = wait_for(lambda: (lambda t: t if t and t.get(result.id, {}).get("state") == "SUCCESS" else None)(
        http_json(f"{base}/api/tasks")), 60, "Flower to show the task as succeeded")
    assert tasks[result.id]["name"] == "tasks.demo.add" and tasks[result.id]["args"] == "(5, 6)"
    # Flower asks every worker on the shared broker; one that answers late is listed on a later refresh
    wait_for(lambda: any(name.startswith("w1@") for name in http_json(f"{base}/api/workers?refresh=1") or {}),
             30, "Flower to list worker w1")
    lag_line = f'celery_delayed_consumer_lag{{queue="{overrides["task_default_queue"]}"}} 0.0'
    metrics = wait_for(lambda: (lambda m: m if lag_line in m else None)(
        urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()), 30,
        "Flower's /metrics to show the queue's consumer lag back at 0")
    assert "celery_delayed_store_up 1.0" in metrics
    scheduled = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("celery_delayed_scheduled{"))
    assert scheduled == 1 and store_of(app).get(later.id)["state"] == "scheduled"
