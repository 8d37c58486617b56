"""Recurring schedules at scale, on real servers: a poller advances a claim's occurrences in bulk.

The round trips are counted by the commands a Redis of the test's own served (``INFO commandstats``):
no other client talks to it.
"""
from __future__ import annotations


from celery_delayed import Schedules
from tasks import create_app

from .support import own_redis, wait_for

SCHEDULES = 200


def calls(client, command: str) -> int:
    """How many times the Redis of ``client`` ran ``command`` since its stats were reset."""
    return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def upserted(overrides: dict, count: int, every_s: float) -> Schedules:
    """``count`` schedules of ``tasks.demo.tick`` every ``every_s`` (anchored at 0: all due at once)."""
    app = create_app(**overrides)
    schedules = Schedules(app)
    for i in range(count):
        schedules.upsert(f"bulk:{i}", app.signature("tasks.demo.tick", args=(overrides["delayed_key_prefix"],)),
                         every_s)
    return schedules


def test_a_poller_advances_the_occurrences_of_a_claim_in_bulk(overrides, processes, tmp_path):
    """200 schedules due at the same instants: the poller advances each claim's occurrences in a few round
    trips (their definitions read at once, their successors and compare-and-sets pipelined, no ``SCRIPT
    EXISTS`` before a pipeline), not several per occurrence; every chain moves on, each occurrence once."""
    with own_redis(tmp_path / "redis") as client:
        overrides["delayed_redis_url"] = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
        schedules = upserted(overrides, SCHEDULES, 3)
        first = {d.schedule_id: d.pending_ms for d in schedules.all()}
        client.config_resetstat()
        processes.poller()
        wait_for(lambda: all((d.pending_ms or 0) >= first[d.schedule_id] + 6000 for d in schedules.all()), 60,
                 "every chain to move on twice")
        reads, script_exists = client.info("stats")["total_reads_processed"], calls(client, "script|exists")
    assert len(first) == SCHEDULES
    assert reads < 2 * SCHEDULES, f"{reads} round trips to advance {2 * SCHEDULES} occurrences (and claim them)"
    assert script_exists == 0, f"{script_exists} SCRIPT EXISTS sent before pipelines"
