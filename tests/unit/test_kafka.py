from celery_delayed.kafka import topic_config
from celery_delayed.settings import Settings


def test_replicated_topics_need_two_in_sync_replicas_for_a_write():
    assert topic_config(Settings(topic_replication=1)) == {}  # one copy: the broker's own default applies
    assert topic_config(Settings(topic_replication=2)) == {"min.insync.replicas": "2"}
    assert topic_config(Settings(topic_replication=3)) == {"min.insync.replicas": "2"}  # one broker may be down
