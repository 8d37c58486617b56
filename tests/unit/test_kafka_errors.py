from confluent_kafka import KafkaError

from celery_delayed.kafka import Verdict, classify


def test_only_errors_about_the_message_itself_are_permanent():
    for code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE, KafkaError.INVALID_MSG,
                 KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE):
        assert classify(KafkaError(code)) is Verdict.PERMANENT


def test_outages_timeouts_full_queues_and_unknown_topics_are_transient():
    for code in (KafkaError._TRANSPORT, KafkaError._MSG_TIMED_OUT, KafkaError._QUEUE_FULL, KafkaError._ALL_BROKERS_DOWN,
                 KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED,
                 KafkaError.NOT_ENOUGH_REPLICAS, KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
        assert classify(KafkaError(code)) is Verdict.TRANSIENT


def test_a_fatal_producer_error_is_fatal_whatever_its_code():
    assert classify(KafkaError(KafkaError._FATAL)) is Verdict.FATAL
    assert classify(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True)) is Verdict.FATAL
    assert classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, fatal=True)) is Verdict.FATAL
