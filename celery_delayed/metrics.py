"""Prometheus metrics of celery-delayed, in prometheus_client's default registry.

The default registry is what Flower's ``/metrics`` renders, so a Flower started
on an app that imports celery_delayed shows these too.  Store-wide gauges
(scheduled, inflight, overdue) are read from Redis at scrape time.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from celery_delayed import inert

logger = inert.logger(__name__)

DEAD_LETTERED = Counter("celery_delayed_dead_lettered", "Messages moved to the dead-letter queue", ["source"])

#: What a poller counts, by name: the Prometheus counter of each.
_POLLER_COUNTERS = {
    "dispatched": Counter("celery_delayed_dispatched", "Tasks delivered to Kafka by this poller"),
    "superseded": Counter("celery_delayed_superseded", "Delivered copies a newer one (a retry, a put-back) "
                          "replaced before their ack: the newer copy stays scheduled"),
    "delivery_failed": Counter("celery_delayed_delivery_failed", "Kafka deliveries that failed (task due again)"),
    "dead_lettered": DEAD_LETTERED.labels("poller"),
    "dropped": Counter("celery_delayed_dropped", "Claimed copies not sent: stale occurrences of recurring "
                       "schedules changed or removed since they were written"),
    "occurrences_fired": Counter("celery_delayed_occurrences_fired", "Occurrences of recurring schedules sent "
                                 "to run"),
    "occurrences_missed": Counter("celery_delayed_occurrences_missed", "Times of recurring schedules that "
                                  "never run: missed during an outage or a pause, by their misfire policy"),
    "occurrences_overlapped": Counter("celery_delayed_occurrences_overlapped", "Occurrences of recurring "
                                      "schedules not run: the previous one still ran (overlap=False)"),
    "fenced": Counter("celery_delayed_fence_rejections", "Claims refused because a newer leader exists"),
    "producer_replaced": Counter("celery_delayed_producers_replaced", "Kafka producers replaced after a fatal "
                                 "error (what they held returned to due)"),
}


class PollerCounts:
    """What one poller did, counted once: each :meth:`add` is read back per poller (``counts[name]``:
    logs, tests running several pollers in one process) and adds to the process's Prometheus counter."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(_POLLER_COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        self._counts[name] += n
        _POLLER_COUNTERS[name].inc(n)

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def __repr__(self) -> str:
        return repr(self._counts)


class BatchHistogram(Collector):
    """A histogram fed a batch at a time: the poller observes every task it dispatches, tens of
    thousands a second, where ``Histogram.observe`` (a lock and a bucket search per value) was
    a tenth of its work."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry=REGISTRY) -> None:
        self.name, self.documentation, self.bounds = name, documentation, buckets
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        counts = [0] * len(self._counts)
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(self.bounds, value)] += 1
            total += value
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts)]
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total)


DISPATCH_LAG = BatchHistogram("celery_delayed_dispatch_lag_seconds", "Due time to Kafka delivery confirmation",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
SKIPPED_FINISHED = Counter("celery_delayed_skipped_finished",
                           "Deliveries of tasks that had already finished, acknowledged without running")
SKIPPED_REVOKED = Counter("celery_delayed_skipped_revoked",
                          "Deliveries of revoked tasks, recorded as REVOKED and acknowledged without running")
DEFERRED_DUPLICATES = Counter("celery_delayed_deferred_duplicates",
                              "Deliveries of tasks another copy of which was running, put back in the store")
LEADING = Gauge("celery_delayed_leading", "1 for each partition this poller leads", ["partition"])
PAUSED = Gauge("celery_delayed_queue_paused", "1 for each queue this poller holds in the store (delayed pause)",
               ["queue"])
CONTROLS_UNREADABLE = Gauge("celery_delayed_controls_unreadable", "1 while this poller cannot read the paused "
                            "queues and queue rates, and so claims nothing (a paused queue must stay paused)")


class StoreCollector(Collector):
    """Scheduled, in-flight, overdue and dead-lettered counts of an app's store, read when scraped."""

    def __init__(self, app) -> None:
        self.app = app

    def describe(self) -> list:
        """Nothing: without it prometheus_client would collect (read Redis and Kafka) at registration."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("celery_delayed_store_up", "1 when the delayed store answered this scrape")
        try:
            families = list(self._families(self.app.amqp.delayed_store))
        except Exception as exc:  # a scrape must not fail because Redis is down
            logger.warning("delayed store metrics unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families
        try:
            yield from list(self._lag())
        except Exception as exc:  # Kafka down: the store figures still count
            logger.warning("Kafka consumer lag unavailable: %s", exc)

    @staticmethod
    def _families(store) -> Iterator[GaugeMetricFamily]:
        from celery_delayed.store.dlq import DeadLetters

        scheduled = GaugeMetricFamily("celery_delayed_scheduled", "Tasks waiting in the store", labels=["partition"])
        inflight = GaugeMetricFamily("celery_delayed_inflight", "Tasks claimed, awaiting Kafka's confirmation",
                                     labels=["partition"])
        overdue = GaugeMetricFamily("celery_delayed_overdue", "Tasks past their due time still in the store",
                                    labels=["partition"])
        failing = GaugeMetricFamily("celery_delayed_failing", "Tasks whose delivery to Kafka failed, not delivered "
                                    "since (each tried again shortly)", labels=["partition"])
        overdue_age = GaugeMetricFamily("celery_delayed_oldest_overdue_seconds", "How long the oldest task past "
                                        "its due time (a failing one: the due time it failed at) has waited",
                                        labels=["partition"])
        for row in store.counts():  # one read of the store, by Redis' clock
            p = str(row["partition"])
            scheduled.add_metric([p], row["scheduled"])
            inflight.add_metric([p], row["inflight"])
            overdue.add_metric([p], row["overdue"])
            failing.add_metric([p], row["failing"])
            overdue_age.add_metric([p], row["oldest_overdue_s"] or 0.0)
        queue_overdue = GaugeMetricFamily("celery_delayed_queue_overdue", "Tasks of a queue past their due time "
                                          "still in the store (held back, when it is paused)", labels=["queue"])
        for lane in store.queues():
            queue_overdue.add_metric([lane["queue"]], lane["overdue"])
        letters = DeadLetters(store)
        dead = GaugeMetricFamily("celery_delayed_dead_letters", "Messages in the dead-letter queue")
        dead.add_metric([], letters.count())
        dead_age = GaugeMetricFamily("celery_delayed_oldest_dead_letter_seconds",
                                     "How long ago the oldest message in the dead-letter queue was parked")
        dead_age.add_metric([], letters.oldest_age() or 0.0)
        yield from (scheduled, inflight, overdue, failing, overdue_age, queue_overdue, dead, dead_age)

    def _lag(self) -> Iterator[GaugeMetricFamily]:
        from celery_delayed.kafka import fleet

        state = fleet(self.app.amqp.delayed_settings)
        lag = GaugeMetricFamily("celery_delayed_consumer_lag", "Records on a queue's topic the workers have not "
                                "committed yet", labels=["queue"])
        partitions = GaugeMetricFamily("celery_delayed_topic_partitions", "Partitions of a queue's topic (at most "
                                       "one worker reads each)", labels=["queue"])
        readers = GaugeMetricFamily("celery_delayed_topic_workers", "Workers reading a queue's topic", labels=["queue"])
        for topic in state.topics:
            lag.add_metric([topic.queue], topic.lag)
            partitions.add_metric([topic.queue], topic.partitions)
            readers.add_metric([topic.queue], topic.consumers)
        unread = GaugeMetricFamily("celery_delayed_unread_queues", "Queues whose topic holds records no worker "
                                   "reads (no worker calls celery_delayed.install(app), or all crashed)")
        unread.add_metric([], len(state.unread))
        idle = GaugeMetricFamily("celery_delayed_idle_workers", "Workers of the group reading no partition: "
                                 "their queues have more consumers than partitions")
        idle.add_metric([], state.idle)
        yield from (lag, partitions, readers, unread, idle)


_collector: StoreCollector | None = None


def register_app(app) -> None:
    """Expose the store gauges of ``app`` in the default registry (the first app registered wins).

    Called by :func:`celery_delayed.install`, so every process of the app (a
    poller's endpoint, Flower's ``/metrics``) shows them; Redis is read only
    when scraped.
    """
    global _collector
    if _collector is None:
        _collector = StoreCollector(app)
        REGISTRY.register(_collector)
