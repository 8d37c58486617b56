"""Kafka plumbing shared by the poller and the workers: clients and topics."""
from __future__ import annotations

import enum
import logging
from typing import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from .settings import Settings

logger = logging.getLogger(__name__)

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
    return Producer(settings.kafka(**{
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "message.timeout.ms": min(30_000, int(settings.visibility_timeout * 800)),
    }))


def ensure_topics(settings: Settings, queues: Iterable[str], timeout: float = 30.0) -> None:
    """Create the ready topics of ``queues`` that do not exist yet (existing ones are kept)."""
    admin = AdminClient(settings.kafka())
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
            future.result()
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
    probe = Consumer(settings.kafka(**{"group.id": settings.consumer_group, "enable.auto.commit": False}))
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
