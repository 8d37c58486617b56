"""Kafka plumbing shared by the poller and the workers: clients and topics."""
from __future__ import annotations

import logging
from typing import Iterable

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from .settings import Settings

logger = logging.getLogger(__name__)


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
        [NewTopic(t, num_partitions=settings.topic_partitions, replication_factor=settings.topic_replication)
         for t in missing], operation_timeout=timeout, request_timeout=timeout)
    for topic, future in futures.items():
        try:
            future.result()
            logger.info("created Kafka topic %s", topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def consumer_lag(settings: Settings, admin: AdminClient | None = None, timeout: float = 5.0) -> dict[str, int]:
    """Records not yet committed by the workers' group, per queue (latest offset - committed)."""
    admin = admin or AdminClient(settings.kafka())
    group = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(settings.consumer_group)],
                                              request_timeout=timeout)
    committed = {(tp.topic, tp.partition): tp.offset
                 for tp in group[settings.consumer_group].result().topic_partitions or []
                 if tp.topic.startswith(settings.topic_prefix)}
    topics = admin.list_topics(timeout=timeout).topics
    partitions = [TopicPartition(name, p) for name, meta in topics.items()
                  if name.startswith(settings.topic_prefix) for p in meta.partitions]
    if not partitions:
        return {}
    latest = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, request_timeout=timeout)
    lag: dict[str, int] = {}
    for tp, future in latest.items():
        queue = tp.topic[len(settings.topic_prefix):]
        end = future.result().offset
        done = committed.get((tp.topic, tp.partition), -1)
        lag[queue] = lag.get(queue, 0) + max(0, end - max(done, 0))
    return lag
