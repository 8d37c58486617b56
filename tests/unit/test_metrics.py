"""The poller's metrics: the batch-fed lag histogram reads as prometheus_client's own Histogram
would; each count is kept once, read per poller and as the process's Prometheus counter."""
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


def test_each_poller_reads_its_own_counts_and_a_scrape_reads_the_process_sum():
    """Two pollers in one process (as in the tests): each sees what it counted, Prometheus the sum."""
    from prometheus_client import REGISTRY

    from celery_delayed.metrics import PollerCounts

    def exported(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = exported("celery_delayed_dispatched_total"), exported("celery_delayed_dead_lettered_total",
                                                                   source="poller")
    first, second = PollerCounts(), PollerCounts()
    first.add("dispatched", 5)
    second.add("dispatched", 2)
    second.add("dead_lettered")
    assert (first["dispatched"], second["dispatched"], first["dead_lettered"], second["dead_lettered"]) == (5, 2, 0, 1)
    assert exported("celery_delayed_dispatched_total") - before[0] == 7
    assert exported("celery_delayed_dead_lettered_total", source="poller") - before[1] == 1
