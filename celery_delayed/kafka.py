"""Kafka plumbing shared by the poller and the workers: clients and topics."""
from __future__ import annotations

import logging
from typing import Iterable

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from .settings import Settings

logger = logging.getLogger(__name__)


def make_producer(settings: Settings) -> Producer:
    """An idempotent, acks=all producer: a retried send never duplicates in Kafka."""
    return Producer(settings.kafka(**{
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "message.timeout.ms": 30_000,
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
