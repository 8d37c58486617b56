"""The poller's batch-fed lag histogram reads as prometheus_client's own Histogram would."""
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from celery_delayed.metrics import BatchHistogram

BOUNDS = (.005, .01, .025, 1, 300)
VALUES = [0.0, 0.001, 0.005, 0.0051, 0.02, 0.025, 1.0, 299.9, 300.0, 400.0]


def test_batches_give_the_exposition_of_values_observed_one_by_one():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("lag_seconds", "lag", BOUNDS, registry=ours)
    batched.observe_many(VALUES[:4])
    batched.observe_many([])
    batched.observe_many(VALUES[4:])
    single = Histogram("lag_seconds", "lag", buckets=BOUNDS, registry=theirs)
    for value in VALUES:
        single.observe(value)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected
