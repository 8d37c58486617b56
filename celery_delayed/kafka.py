"""Kafka plumbing shared by the poller and the workers: clients and topics."""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition, libversion
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic, ResourceType

from celery_delayed import inert
from celery_delayed.settings import Settings

logger = inert.logger(__name__)

#: Record headers the poller sets: when the task was due (ms; the store keeps no ``eta`` header,
#: the worker restores it from this) and when the poller claimed it (ms, for per-hop timing).
DUE_HEADER, CLAIMED_HEADER = "x-delayed-due", "x-delayed-claimed"
#: Error codes about the message itself (size, format): retrying it cannot help.
REFUSED = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE, KafkaError.INVALID_MSG,
                     KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE})


class Verdict(enum.Enum):
    """What a produce or delivery error means for the message, and for the producer."""

    PERMANENT = "permanent"  # Kafka can never carry this message: dead-letter it
    FATAL = "fatal"  # the producer is unusable (e.g. an idempotent producer out of sequence): replace it
    TRANSIENT = "transient"  # timeouts, outages, authorisation, unknown topic...: try the message again later


#: Seconds between two of librdkafka's log lines of one facility (FAIL, ERROR...): a broker that
#: cannot be reached makes it log each connection attempt, several a second.
LIBRDKAFKA_LOG_EVERY = 30.0


class _LibrdkafkaLog(logging.Filter):
    """librdkafka's own log lines, as Python logging records: at most one per facility every
    :data:`LIBRDKAFKA_LOG_EVERY` s (saying how many it held back), and at most WARNING, since the
    client reconnects by itself and its caller says what fails for good."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()  # librdkafka logs from each client's poll, on any thread

    def filter(self, record: logging.LogRecord) -> bool:
        facility = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(facility, -LIBRDKAFKA_LOG_EVERY) < LIBRDKAFKA_LOG_EVERY:
                self._held[facility] += 1
                return False
            self._last[facility] = now
            held = self._held.pop(facility, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it held back)"
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


#: Where librdkafka's log goes (instead of raw lines on stderr).
librdkafka_log = logging.getLogger("celery_delayed.librdkafka")
librdkafka_log.addFilter(_LibrdkafkaLog())


def client_config(settings: Settings, defaults: dict[str, Any] | None = None, /, **extra: Any) -> dict[str, Any]:
    """A Kafka client's configuration (:meth:`Settings.kafka`), its log going to :data:`librdkafka_log`."""
    return settings.kafka(defaults, logger=librdkafka_log, **extra)


def address(settings: Settings) -> str:
    """Where Kafka is looked for, and the setting that says so, for errors."""
    return f"Kafka at {settings.kafka_servers} (delayed_kafka_servers)"


def classify(err: KafkaError) -> Verdict:
    """The :class:`Verdict` on a Kafka error; a fatal producer error wins over the error's code."""
    if err.fatal() or err.code() == KafkaError._FATAL:
        return Verdict.FATAL
    return Verdict.PERMANENT if err.code() in REFUSED else Verdict.TRANSIENT


def make_producer(settings: Settings) -> Producer:
    """An idempotent, acks=all producer: a retried send never duplicates in Kafka.

    A delivery is given up (and the task returned to due) well before the
    claim's visibility deadline, so a task is not claimed again while its
    first delivery is still pending.
    """
    return Producer(client_config(settings, **{
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "message.timeout.ms": min(30_000, int(settings.visibility_timeout * 800)),
    }))


#: Consumer settings that the next-generation group protocol (KIP-848) takes from the broker
#: (``group.consumer.session.timeout.ms``, ``group.consumer.heartbeat.interval.ms``,
#: ``group.remote.assignor``): librdkafka refuses to build a consumer that sets one.
BROKER_SIDE = ("session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy",
               "group.protocol.type")
#: Classic-protocol worker defaults delayed_kafka_config may override.  A worker that dies without
#: leaving the group (kill -9, a machine lost) holds its partitions until the group misses its
#: heartbeats this long; librdkafka's 45 s default stalls them that long.  Heartbeats come from
#: librdkafka's own thread, so 10 s is safe for a busy worker too.
CLASSIC_DEFAULTS = {"session.timeout.ms": 10_000}


#: The librdkafka ``auto`` takes the consumer protocol from: 2.12 made it production-ready, and
#: before 2.15 a group under autoscaling could stall for minutes on "stale member epoch" commits.
CONSUMER_PROTOCOL_LIBRDKAFKA = (2, 15)


def group_protocol(settings: Settings, timeout: float = 10.0) -> str:
    """The workers' group protocol: ``group.protocol`` of delayed_kafka_config, else
    ``delayed_group_protocol``; ``auto`` is ``consumer`` when the brokers offer it
    (``group.coordinator.rebalance.protocols``) and librdkafka is at least
    :data:`CONSUMER_PROTOCOL_LIBRDKAFKA`, ``classic`` otherwise or when the brokers cannot be asked."""
    chosen = settings.kafka_config.get("group.protocol") or settings.group_protocol
    if chosen != "auto":
        return chosen
    if tuple(int(part) for part in libversion()[0].split(".")[:2]) < CONSUMER_PROTOCOL_LIBRDKAFKA:
        logger.warning("librdkafka %s is older than %s: using the classic group protocol", libversion()[0],
                       ".".join(map(str, CONSUMER_PROTOCOL_LIBRDKAFKA)))
        return "classic"
    admin = AdminClient(client_config(settings))
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
        entries = outcome(admin.describe_configs([resource], request_timeout=timeout)[resource], timeout)
    except (KafkaException, ValueError) as exc:  # ValueError: no broker known
        logger.warning("cannot ask Kafka which group protocols it offers (%s): using the classic one; "
                       "set delayed_group_protocol to choose", exc)
        return "classic"
    entry = entries.get("group.coordinator.rebalance.protocols")
    return "consumer" if entry is not None and "consumer" in (entry.value or "").split(",") else "classic"


def consumer_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    """A worker consumer's configuration on its group protocol (:func:`group_protocol`).

    On the ``consumer`` protocol, the settings it refuses (:data:`BROKER_SIDE`) are left out of
    delayed_kafka_config with one warning naming them, rather than failing every worker at start.
    """
    if group_protocol(settings) == "classic":
        return client_config(settings, CLASSIC_DEFAULTS, **extra, **{"group.protocol": "classic"})
    config = client_config(settings, **extra, **{"group.protocol": "consumer"})
    refused = [name for name in BROKER_SIDE if name in config]
    if refused:
        logger.warning("Kafka's consumer group protocol sets %s on the broker (group.consumer.*): "
                       "left out of delayed_kafka_config", ", ".join(refused))
    return {name: value for name, value in config.items() if name not in refused}


def outcome(future: Any, timeout: float) -> Any:
    """An admin request's result, waited for by looking every 10 ms, not by ``future.result()``:
    librdkafka completes the future from a thread of its own, and in a green worker (eventlet) the
    patched ``threading`` never wakes the greenlet waiting on it (the worker hung at start).  A
    ``KafkaException`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not future.done():
        if time.monotonic() >= deadline:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"no answer from Kafka within {timeout:g} s"))
        time.sleep(0.01)
    return future.result()


def ensure_topics(settings: Settings, queues: Iterable[str], timeout: float = 30.0) -> None:
    """Create the ready topics of ``queues`` that do not exist yet (existing ones are kept)."""
    admin = AdminClient(client_config(settings))
    wanted = {settings.topic(q) for q in queues}
    existing = set(admin.list_topics(timeout=timeout).topics)
    missing = sorted(wanted - existing)
    if not missing:
        return
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=settings.topic_partitions, replication_factor=settings.topic_replication,
                  config=topic_config(settings)) for t in missing], operation_timeout=timeout, request_timeout=timeout)
    for topic, future in futures.items():
        try:
            outcome(future, timeout)
            logger.info("created Kafka topic %s", topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def topic_config(settings: Settings) -> dict[str, str]:
    """Config of a ready topic celery-delayed creates: with replicas, an acks=all write must reach two
    of them (``min.insync.replicas``), so losing one broker cannot lose an acknowledged task."""
    if settings.topic_replication < 2:
        return {}
    return {"min.insync.replicas": "2"}


def consumer_lag(settings: Settings, timeout: float = 5.0) -> dict[str, int]:
    """Records not yet committed by the workers' group, per queue (latest offset - committed).

    Read with a consumer that never joins the group (``committed`` and watermark
    offsets only).  Not AdminClient.list_consumer_group_offsets: confluent-kafka
    2.16 crashes the process (SIGSEGV) on it while the group coordinator loads.
    """
    probe = Consumer(client_config(settings, **{"group.id": settings.consumer_group, "enable.auto.commit": False}))
    try:
        topics = probe.list_topics(timeout=timeout).topics
        partitions = [TopicPartition(name, p) for name, meta in topics.items()
                      if name.startswith(settings.topic_prefix) for p in meta.partitions]
        lag: dict[str, int] = {}
        for tp in probe.committed(partitions, timeout=timeout) if partitions else []:
            queue = tp.topic[len(settings.topic_prefix):]
            _, end = probe.get_watermark_offsets(tp, timeout=timeout)
            lag[queue] = lag.get(queue, 0) + max(0, end - max(tp.offset, 0))
        return lag
    finally:
        probe.close()


@dataclass(frozen=True)
class QueueTopic:
    """A queue's ready topic as the workers' group reads it."""

    queue: str
    partitions: int
    consumers: int  # members of the workers' group reading at least one of its partitions
    lag: int  # records not committed by the group yet


@dataclass(frozen=True)
class Fleet:
    """The ready topics, and the members of the workers' group that read no partition at all: more
    workers consume their queues than those queues' topics have partitions (they stay idle)."""

    topics: list[QueueTopic]
    idle: int

    @property
    def unread(self) -> list[QueueTopic]:
        """The topics holding records that no worker reads: their tasks wait on Kafka, lost to no one
        and run by no one."""
        return [topic for topic in self.topics if topic.lag and not topic.consumers]


def unread_warning(settings: Settings, topic: QueueTopic) -> str:
    """What to say of a topic no worker reads (:attr:`Fleet.unread`), and its likely cause."""
    return (f"queue {topic.queue}: {topic.lag} task(s) wait on Kafka topic {settings.topic(topic.queue)} and no "
            f"worker of group {settings.consumer_group} reads it: start a worker of the queue (celery worker -Q "
            f"{topic.queue}) on an app that calls celery_delayed.install(app); a worker without it never reads Kafka")


def fleet(settings: Settings, timeout: float = 5.0) -> Fleet:
    """How the workers' group reads the ready topics (``celery delayed topics``, the metrics)."""
    admin = AdminClient(client_config(settings))
    names = {name: len(meta.partitions) for name, meta in admin.list_topics(timeout=timeout).topics.items()
             if name.startswith(settings.topic_prefix)}
    group = settings.consumer_group
    (described,) = admin.describe_consumer_groups([group], request_timeout=timeout).values()
    readers: dict[str, int] = {}
    idle = 0
    for member in outcome(described, timeout).members:
        read = {tp.topic for tp in (member.assignment.topic_partitions if member.assignment else [])}
        idle += not read
        for topic in read:
            readers[topic] = readers.get(topic, 0) + 1
    lag = consumer_lag(settings, timeout)
    prefix = len(settings.topic_prefix)
    return Fleet([QueueTopic(name[prefix:], partitions, readers.get(name, 0), lag.get(name[prefix:], 0))
                  for name, partitions in sorted(names.items())], idle)


def fleet_report(settings: Settings, timeout: float = 5.0) -> tuple[Fleet | None, list[str]]:
    """The :func:`fleet` (None when Kafka cannot be reached), and what an operator must hear of
    Kafka: that it cannot be reached, or each queue no worker reads; no warning when all is well."""
    try:
        state = fleet(settings, timeout)
    except (KafkaException, ValueError) as exc:  # ValueError: no broker known
        reason = exc.args[0].str() if isinstance(exc, KafkaException) and isinstance(exc.args[0], KafkaError) else exc
        return None, [f"{address(settings)} cannot be reached ({reason}): due tasks stay in the store until it "
                      "answers"]
    return state, [unread_warning(settings, topic) for topic in state.unread]


def fleet_warnings(settings: Settings, timeout: float = 5.0) -> list[str]:
    """:func:`fleet_report`'s warnings (the web view)."""
    return fleet_report(settings, timeout)[1]


def grow_topic(settings: Settings, queue: str, partitions: int, timeout: float = 30.0) -> None:
    """Give a queue's ready topic ``partitions`` partitions in all (Kafka adds, never removes, them).

    Tasks are keyed by task id, which then maps to another partition: harmless here, since
    run claims, not the order of a partition, keep a task to one run.
    """
    topic = settings.checked_topic(queue)
    admin = AdminClient(client_config(settings))  # kept until the answer: a handle destroyed meanwhile fails it
    outcome(admin.create_partitions([NewPartitions(topic, partitions)], request_timeout=timeout)[topic], timeout)
