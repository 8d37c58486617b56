import logging

from celery_delayed.kafka import librdkafka_log, topic_config
from celery_delayed.settings import Settings


def test_replicated_topics_need_two_in_sync_replicas_for_a_write():
    assert topic_config(Settings(topic_replication=1)) == {}  # one copy: the broker's own default applies
    assert topic_config(Settings(topic_replication=2)) == {"min.insync.replicas": "2"}
    assert topic_config(Settings(topic_replication=3)) == {"min.insync.replicas": "2"}  # one broker may be down


def test_librdkafkas_log_lines_of_a_facility_are_held_back_and_at_most_warnings(caplog):
    """A broker that cannot be reached makes librdkafka log each connection attempt, at ERROR."""
    with caplog.at_level(logging.DEBUG, logger=librdkafka_log.name):
        for n in range(3):
            librdkafka_log.error("%s [%s] %s", "FAIL", f"rdkafka#producer-{n}", "Connection refused")
        librdkafka_log.error("%s [%s] %s", "ERROR", "rdkafka#producer-1", "1/1 brokers are down")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "FAIL [rdkafka#producer-0] Connection refused"),
        ("WARNING", "ERROR [rdkafka#producer-1] 1/1 brokers are down")]
