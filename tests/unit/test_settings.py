import dataclasses
import math
import re

import pytest
from celery import Celery

from celery_delayed.kafka import consumer_config, librdkafka_log
from celery_delayed.settings import RANGES, ConfigurationError, Settings, redact_url


def test_defaults_are_valid_and_local():
    s = Settings.from_mapping({})
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.kafka_servers == "127.0.0.1:9092"
    assert s.etcd_urls == ["http://127.0.0.1:2379"]


def test_reads_prefixed_settings_from_app_and_coerces_strings():
    app = Celery(set_as_current=False)
    app.conf.update(delayed_partitions="32", delayed_min_delay="2.5", delayed_key_prefix="x")
    s = Settings.from_app(app)
    assert (s.partitions, s.min_delay, s.key_prefix) == (32, 2.5, "x")


@pytest.mark.parametrize("name, value, words", [
    ("partitions", 0, "delayed_partitions must be between 1 and 16384, got 0"),
    ("partitions", "many", "delayed_partitions must be int"),
    ("partitions", 1.5, "delayed_partitions must be int"),
    ("lease_ttl", 1, "delayed_lease_ttl must be between 2 and"),
    ("revoke_days", 0, "delayed_revoke_days must be > 0 and"),
    ("done_ttl", -1, "delayed_done_ttl must be between 0 and"),
    ("run_lease", 1, "delayed_run_lease must be between 3 and"),
    ("redis_url", "http://x", "delayed_redis_url must be a redis://"),
    ("kafka_servers", "nohostport", "delayed_kafka_servers must be host:port"),
    ("etcd_endpoints", "ftp://127.0.0.1:2379", "delayed_etcd_endpoints must be [http(s)://]host:port"),
    ("etcd_endpoints", "127.0.0.1", "delayed_etcd_endpoints must be [http(s)://]host:port"),
    ("key_prefix", "a:b", "delayed_key_prefix must be non-empty"),
    ("topic_prefix", "bad topic", "delayed_topic_prefix may hold only"),
    ("kafka_config", "sasl", "delayed_kafka_config must be Mapping"),
    ("kafka_config", {"bootstrap.servers": "x:1"}, "delayed_kafka_config must not set bootstrap.servers"),
    ("claim_batch", 100000, "delayed_claim_batch must be between"),
    ("queue_rates", {"bulk": 0}, "delayed_queue_rates values must be tasks per second > 0 and <= 1000000000, got 0 for "
     "'bulk'"),
    ("queue_rates", {"bulk": "fast"}, "delayed_queue_rates values must be tasks per second > 0"),
    ("queue_rates", {"": 10}, "delayed_queue_rates keys must be queue names of 1 to 255 bytes"),
])
def test_bad_values_name_the_setting(name, value, words):
    with pytest.raises(ConfigurationError, match=re.escape(words)):
        Settings.from_mapping({name: value})


NUMERIC = [f.name for f in dataclasses.fields(Settings) if f.type in ("int", "float")]


def test_every_numeric_setting_has_a_range():
    assert sorted(RANGES) == sorted(NUMERIC)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 1e30, "nan", "inf", "1e30", "many", True, False])
@pytest.mark.parametrize("name", NUMERIC)
def test_a_numeric_setting_refuses_what_is_not_a_sane_number_naming_it(name, value):
    """Not a number, not finite, negative or absurdly large (a visibility timeout that would overflow
    ms ints in Redis, a poller's timers): refused when the settings load, on one line naming it and the value."""
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_mapping({name: value})
    message = str(refused.value)
    assert message.startswith(f"delayed_{name} must be ") and message.endswith(f", got {value!r}")
    assert "\n" not in message


@pytest.mark.parametrize("rate", [math.nan, math.inf, -1, 0, 1e30, "10", True])
def test_a_queue_rate_must_be_a_sane_number(rate):
    with pytest.raises(ConfigurationError, match=f"delayed_queue_rates values must be tasks per second > 0 and "
                                                 f"<= 1000000000, got {re.escape(repr(rate))} for 'bulk'"):
        Settings.from_mapping({"queue_rates": {"bulk": rate}})


@pytest.mark.parametrize("name, value, words", [
    ("schedule_wait", "replicas=1,timeout=inf", "delayed_schedule_wait must be replicas=N"),
    ("schedule_wait", "replicas=1,timeout=nan", "delayed_schedule_wait must be replicas=N"),
    ("schedule_wait", "replicas=1,timeout=1e30", "delayed_schedule_wait must be replicas=N"),
    ("schedule_wait", "replicas=99999999999", "delayed_schedule_wait must be replicas=N"),
    ("kafka_config", {"message.max.bytes": 10 ** 12}, "message.max.bytes must be an integer between 1000 and"),
    ("kafka_config", {"message.max.bytes": "inf"}, "message.max.bytes must be an integer between 1000 and"),
])
def test_numbers_inside_other_settings_are_bounded_too(name, value, words):
    with pytest.raises(ConfigurationError, match=re.escape(words)):
        Settings.from_mapping({name: value})


def test_unknown_setting_is_refused():
    with pytest.raises(ConfigurationError, match="unknown setting delayed_partitons"):
        Settings.from_mapping({"partitons": 3})


def test_a_misspelt_key_of_a_namespaced_django_configuration_is_refused_as_written(tmp_path, monkeypatch):
    (tmp_path / "djsettings.py").write_text("CELERY_DELAYED_PARTITON = 8\nCELERY_DELAYED_KEY_PREFIX = 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    app = Celery(set_as_current=False)
    app.config_from_object("djsettings", namespace="CELERY")
    with pytest.raises(ConfigurationError, match=re.escape(
            "unknown setting CELERY_DELAYED_PARTITON: did you mean CELERY_DELAYED_PARTITIONS?")):
        Settings.from_app(app)


def test_celery_delayeds_own_defaults_and_celerys_keys_are_not_unknown():
    app = Celery(set_as_current=False)
    app.conf.update(delayed_partitions=4, broker_native_delayed_delivery_queue_type="quorum")
    assert Settings.from_app(app).partitions == 4


def test_lists_of_endpoints_are_accepted():
    s = Settings.from_mapping({"etcd_endpoints": ["http://a:1", "http://b:2"], "kafka_servers": ["a:1", "b:2"]})
    assert s.etcd_urls == ["http://a:1", "http://b:2"]
    assert s.kafka()["bootstrap.servers"] == "a:1,b:2"


def test_secrets_never_show_in_repr_or_errors():
    s = Settings.from_mapping({"redis_url": "rediss://user:hunter2@host:6380/0", "etcd_password": "hunter3",
                               "kafka_config": {"sasl.password": "hunter4", "security.protocol": "SASL_SSL"}})
    text = repr(s)
    assert "hunter" not in text
    assert "SASL_SSL" in text and "user:***@host:6380" in text
    with pytest.raises(ConfigurationError) as err:
        Settings.from_mapping({"redis_url": "http://u:hunter5@h/0"})
    assert "hunter5" not in str(err.value)


def test_redact_url_keeps_urls_without_password():
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"


def test_kafka_config_passes_through_and_topic_names():
    s = Settings.from_mapping({"kafka_config": {"security.protocol": "SSL"}, "topic_prefix": "p."})
    assert s.kafka(**{"group.id": "g"}) == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "SSL",
                                           "group.id": "g"}
    assert s.topic("emails") == "p.emails"


def test_kafka_defaults_give_way_to_the_users_config():
    """On the classic protocol the consumer's session.timeout.ms is a default: delayed_kafka_config may set another."""
    classic = Settings.from_mapping({"group_protocol": "classic"})
    assert consumer_config(classic)["session.timeout.ms"] == 10_000
    assert consumer_config(classic)["group.protocol"] == "classic"
    mine = Settings.from_mapping({"group_protocol": "classic", "kafka_config": {"session.timeout.ms": 30_000}})
    assert consumer_config(mine, **{"group.id": "g"})["session.timeout.ms"] == 30_000


def test_the_consumer_protocol_leaves_out_what_only_the_broker_may_set_and_says_so(caplog):
    """KIP-848's protocol refuses a consumer that sets session.timeout.ms and the like (every worker
    exited at start): they are left out, with one warning naming each."""
    mine = Settings.from_mapping({"group_protocol": "consumer", "kafka_config": {
        "session.timeout.ms": 30_000, "partition.assignment.strategy": "roundrobin", "security.protocol": "SSL"}})
    with caplog.at_level("WARNING"):
        config = consumer_config(mine, **{"group.id": "g"})
    assert config == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "SSL", "group.id": "g",
                      "group.protocol": "consumer", "logger": librdkafka_log}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "session.timeout.ms" in warning and "partition.assignment.strategy" in warning
    assert consumer_config(Settings.from_mapping({"kafka_config": {"group.protocol": "classic"}}))[
        "group.protocol"] == "classic"  # the user's group.protocol wins over auto


def test_an_unknown_group_protocol_is_refused():
    with pytest.raises(ConfigurationError, match="delayed_group_protocol.*auto, consumer, classic"):
        Settings.from_mapping({"group_protocol": "eager"})


def test_booleans_from_the_environment():
    assert Settings.from_mapping({"dead_letter_failures": "false"}).dead_letter_failures is False
    assert Settings.from_mapping({"dead_letter_failures": "YES"}).dead_letter_failures is True
    with pytest.raises(ConfigurationError, match="delayed_dead_letter_failures must be bool"):
        Settings.from_mapping({"dead_letter_failures": "maybe"})


def test_redis_cluster_is_a_bool_off_by_default_and_needs_a_network_url_of_db_0():
    assert Settings().redis_cluster is False
    on = Settings.from_mapping({"redis_cluster": "true", "redis_url": "rediss://:pw@node1:7001"})
    assert on.redis_cluster is True and "pw" not in repr(on)
    assert Settings.from_mapping({"redis_cluster": True, "redis_url": "redis://node1:7001/0"}).redis_cluster
    with pytest.raises(ConfigurationError, match="delayed_redis_cluster must be bool, got 'cluster'"):
        Settings.from_mapping({"redis_cluster": "cluster"})
    for url in ("redis://node1:7001/3", "unix:///run/redis.sock"):
        with pytest.raises(ConfigurationError, match="delayed_redis_cluster needs a redis:// or rediss:// "
                                                     "delayed_redis_url of database 0"):
            Settings.from_mapping({"redis_cluster": True, "redis_url": url})
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_mapping({"redis_cluster": True, "redis_url": "redis://:s3cret@node1:7001/2"})
    assert "s3cret" not in str(refused.value)


def test_etcd_endpoints_without_a_scheme_are_http_as_for_etcdctl():
    s = Settings.from_mapping({"etcd_endpoints": "127.0.0.1:2379, https://etcd2:2379,etcd3:2381"})
    assert s.etcd_urls == ["http://127.0.0.1:2379", "https://etcd2:2379", "http://etcd3:2381"]


def test_allow_eviction_is_off_by_default():
    assert Settings().allow_eviction is False
    assert Settings.from_mapping({"allow_eviction": "true"}).allow_eviction is True


@pytest.mark.parametrize("value, replicas, aof, timeout_ms", [
    ("replicas=1", 1, False, 1000), ("replicas=0", 0, False, 1000), ("aof", 0, True, 1000),
    ("aof, replicas=2, timeout=0.25", 2, True, 250)])
def test_schedule_wait_is_parsed(value, replicas, aof, timeout_ms):
    policy = Settings.from_mapping({"schedule_wait": value}).wait_policy
    assert (policy.replicas, policy.aof, policy.timeout_ms) == (replicas, aof, timeout_ms)


def test_schedule_wait_is_off_by_default():
    assert Settings().wait_policy is None


@pytest.mark.parametrize("value", ["x", "aof=1", "timeout=1", "replicas=a", "replicas=-1", "replicas=1,timeout=0",
                                   "replicas=1,timeout=inf", "replicas=1,foo=2"])
def test_bad_schedule_wait_is_refused(value):
    with pytest.raises(ConfigurationError, match="delayed_schedule_wait must be replicas=N, aof or both"):
        Settings.from_mapping({"schedule_wait": value})


def test_schedule_wait_is_accepted_on_a_redis_cluster():
    settings = Settings.from_mapping({"schedule_wait": "replicas=1", "redis_cluster": True})
    assert settings.wait_policy.replicas == 1


@pytest.mark.parametrize("url, shown", [
    ("redis://h:1/0?password=hunter6&db=2", "redis://h:1/0?password=***&db=2"),
    ("unix:///tmp/redis.sock?db=1&password=hunter6", "unix:///tmp/redis.sock?db=1&password=***"),
    ("rediss://u:hunter6@h/0?ssl_keyfile=/k&Password=hunter6", "rediss://u:***@h/0?ssl_keyfile=***&Password=***"),
    ("http://root:hunter6@etcd:2379", "http://root:***@etcd:2379"),
])
def test_redact_url_hides_passwords_in_user_info_and_query(url, shown):
    assert redact_url(url) == shown


def test_secrets_in_urls_never_show_in_repr():
    s = Settings.from_mapping({"redis_url": "redis://127.0.0.1:6379/0?password=hunter7",
                               "etcd_endpoints": "http://root:hunter8@a:2379,http://b:2379,root:hunter8@c:2379"})
    text = repr(s)
    assert "hunter" not in text
    assert "redis://127.0.0.1:6379/0?password=***" in text
    assert "http://root:***@a:2379,http://b:2379,http://root:***@c:2379" in text


@pytest.mark.parametrize("name, value", [
    ("kafka_config", "sasl.password=hunter9"),
    ("redis_url", b"redis://:hunter9@h/0"),
    ("redis_url", "http://h/0?password=hunter9"),
    ("etcd_endpoints", "ftp://root:hunter9@a:2379"),
    ("etcd_endpoints", ["http://root:hunter9@a:2379", 7]),
])
def test_configuration_errors_never_echo_secrets(name, value):
    with pytest.raises(ConfigurationError, match=f"delayed_{name}") as err:
        Settings.from_mapping({name: value})
    assert "hunter9" not in str(err.value)


def test_kafka_message_limit_is_librdkafkas_default_or_the_configured_one():
    assert Settings().kafka_message_max_bytes == 1_000_000
    assert Settings.from_mapping({"kafka_config": {"message.max.bytes": "20000"}}).kafka_message_max_bytes == 20_000
    with pytest.raises(ConfigurationError, match=r"message.max.bytes must be an integer between 1000 and .*'big'"):
        Settings.from_mapping({"kafka_config": {"message.max.bytes": "big"}})


def test_every_setting_has_a_parser_that_takes_its_own_default():
    """A field added with a type no parser knows fails here, not in a user's process."""
    defaults = Settings()
    assert Settings.from_mapping({f.name: getattr(defaults, f.name) for f in dataclasses.fields(Settings)}) == defaults


def test_auto_keeps_the_classic_protocol_on_a_librdkafka_whose_consumer_protocol_stalls(monkeypatch, caplog):
    """Before librdkafka 2.15 a KIP-848 group could stall for minutes under autoscaling (stale member epoch)."""
    import celery_delayed.kafka as kafka

    monkeypatch.setattr(kafka, "libversion", lambda: ("2.13.0", 0x020d00ff))
    with caplog.at_level("WARNING"):
        assert kafka.group_protocol(Settings()) == "classic"  # decided before asking any broker
    assert "2.13.0" in caplog.text
    assert kafka.group_protocol(Settings.from_mapping({"group_protocol": "consumer"})) == "consumer"
