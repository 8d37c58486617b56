"""All celery-delayed settings, read once from the Celery app's configuration.

Every setting is a lowercase ``delayed_*`` key of ``app.conf`` (so it can live in
a ``celeryconfig`` module, ``app.conf.update(...)`` or the environment through
``config_from_envvar``).  :func:`Settings.from_app` validates them all at start
and names the offending key in its error.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from collections.abc import Mapping
from urllib.parse import urlsplit

PREFIX = "delayed_"
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")
#: Longest Kafka topic name.
MAX_TOPIC_LENGTH = 249
#: librdkafka's default ``message.max.bytes``: the largest record its producer sends.
KAFKA_MESSAGE_MAX_BYTES = 1_000_000
#: What librdkafka's producer counts beyond key and value against ``message.max.bytes``:
#: 36 bytes of record framing and 60 of the poller's due and claimed-time headers
#: (measured with confluent-kafka 2.x), with room to spare.
RECORD_OVERHEAD = 128


class ConfigurationError(ValueError):
    """A ``delayed_*`` setting has a value celery-delayed cannot use."""


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return int(value)


def _bool(value: Any) -> bool:
    if isinstance(value, str) and value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def _mapping(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(value)
    return dict(value)


def _optional_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


def _joined(value: Any) -> str:
    """A list of addresses (as ``broker_url`` lists may be written) or one comma-separated string."""
    return ",".join(value) if isinstance(value, (list, tuple)) else _str(value)


#: How a raw setting (often a string from the environment) becomes a field's value, by the field's
#: annotation; a field's ``metadata["parse"]`` overrides it.
_PARSERS = {"int": _int, "bool": _bool, "float": _float, "Mapping[str, Any]": _mapping, "str | None": _optional_str,
            "str": _str}


class Range(NamedTuple):
    """The values a numeric setting may take: a finite number from ``low`` (excluded when ``above``)
    to ``high``, past which it can only be a mistake (and some would overflow where they are used,
    as milliseconds in Redis or a timer)."""

    low: float
    high: float
    above: bool = False

    def __contains__(self, value: object) -> bool:
        return ((type(value) is int or type(value) is float) and (value > self.low if self.above else value >= self.low)
                and value <= self.high)  # NaN compares false: refused too

    def __str__(self) -> str:
        low, high = (int(x) if float(x).is_integer() else x for x in (self.low, self.high))
        return f"> {low} and <= {high}" if self.above else f"between {low} and {high}"


#: Ten years, in seconds: the longest duration a setting may have.
DECADE_S = 10 * 366 * 86_400
#: Most tasks a second a rate may allow.
MAX_RATE = 1e9

#: Values of ``delayed_group_protocol``.
GROUP_PROTOCOLS = ("auto", "consumer", "classic")


@dataclass(frozen=True)
class Settings:
    """Validated celery-delayed configuration; defaults match a local install."""

    #: Redis holding the delayed store. ``rediss://`` and passwords pass through.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: The store's Redis is a Redis Cluster; ``redis_url`` names any one of its
    #: nodes (database 0, the only one a cluster has).  The result backend is not
    #: affected: Celery's Redis backend needs a standalone Redis.
    redis_cluster: bool = False
    #: Kafka bootstrap servers, ``host:port[,host:port...]``.
    kafka_servers: str = field(default="127.0.0.1:9092", metadata={"parse": _joined})
    #: Extra confluent-kafka settings for producer, consumer and admin (SASL/SSL...).
    kafka_config: Mapping[str, Any] = field(default_factory=dict)
    #: etcd endpoints, ``[http(s)://]host:port[,...]`` (http when no scheme is given, as etcdctl reads them).
    etcd_endpoints: str = field(default="http://127.0.0.1:2379", metadata={"parse": _joined})
    #: etcd user name, when etcd has authentication enabled.
    etcd_user: str | None = None
    #: Its password (never printed: the settings' repr hides it).
    etcd_password: str | None = None
    #: CA certificate file for an etcd behind TLS.
    etcd_ca_cert: str | None = None
    #: Number of store partitions (each a leader-elected unit of dispatch).
    partitions: int = 16
    #: Prefix of every Redis key and etcd key written by celery-delayed.
    key_prefix: str = "cd"
    #: Kafka topic of queue ``q`` is ``topic_prefix + q``.
    topic_prefix: str = "celery-delayed."
    #: Partitions of each ready topic when celery-delayed creates it.
    topic_partitions: int = 16
    #: Replication factor of topics celery-delayed creates.
    topic_replication: int = 1
    #: Tasks due sooner than this many seconds take Celery's normal path.
    min_delay: float = 1.0
    #: Largest message, in bytes before compression (what a worker holds); larger ones
    #: are refused at apply time, and so are those whose stored form Kafka would not
    #: carry (``message.max.bytes`` of delayed_kafka_config, librdkafka's 1,000,000
    #: by default, less the record's framing and task id).
    max_message_bytes: int = 1_048_576
    #: Stored messages of at least this many bytes are deflated with a preset
    #: dictionary of Celery's recurring strings (~half the Redis memory per task
    #: for a typical message, ~10 µs per apply); above max_message_bytes = never.
    compress_min_bytes: int = 128
    #: Poller's etcd lease TTL in seconds (etcd grants at least 2).
    lease_ttl: int = 5
    #: Seconds a claimed task may stay unacknowledged before it returns to due.
    visibility_timeout: float = 30.0
    #: Most tasks claimed per Lua call.  A script blocks Redis while it runs (~12 µs a
    #: task with 1M in the store: 250 keep another client's PING p99 near 5 ms, bench.dispatch).
    claim_batch: int = 250
    #: Longest the poller sleeps without looking at the store, in seconds.
    max_sleep: float = 1.0
    #: Seconds ahead of its due time a task is dispatched to Kafka; the worker holds
    #: it until due with Celery's own ETA timer, so the hops store -> Kafka -> worker
    #: (p99 up to ~250 ms measured on a busy 2-core host) do not make it late.  0 = dispatch when due.
    dispatch_lead: float = 0.5
    #: Most tasks one poller dispatches per second (0 = no limit); bounds how fast
    #: an overdue backlog drains after an outage, so workers are not stampeded.
    max_dispatch_rate: float = 0.0
    #: Most tasks a second dispatched of each queue named, shared by every poller (a token
    #: bucket in Redis), e.g. ``{"bulk": 2000}``: a campaign drains at a pace its consumers
    #: accept (an e-mail provider's quota), while other queues stay on time.
    #: ``celery delayed rate QUEUE N`` changes a queue's at run time.
    queue_rates: Mapping[str, Any] = field(default_factory=dict)
    #: Port of the poller's Prometheus endpoint (0 = none).
    metrics_port: int = 0
    #: Kafka consumer group of the workers.
    consumer_group: str = "celery-delayed"
    #: The workers' group protocol: ``consumer`` (KIP-848: incremental, broker-driven; a
    #: join or leave moves only the partitions that change owner), ``classic`` (every
    #: join or leave stops the whole group), or ``auto``: ``consumer`` when the brokers
    #: offer it (``group.coordinator.rebalance.protocols``, Kafka >= 4.0), else ``classic``.
    #: ``group.protocol`` in delayed_kafka_config wins over this.
    group_protocol: str = "auto"
    #: Park every task that fails for good (retries exhausted, or none allowed) in the
    #: dead-letter queue, with its arguments, error and traceback, for requeueing.
    dead_letter_failures: bool = True
    #: Seconds a dead letter is kept (0 = for ever): older ones are dropped as new ones
    #: arrive.  A week, so a weekend's failures are still there on Monday.
    dlq_max_age: float = 7 * 86_400.0
    #: Most dead letters kept (0 = no limit): the oldest beyond it are dropped as new ones arrive.
    dlq_max_entries: int = 100_000
    #: Lease of a worker's claim to run a task_id, in seconds; extended while the
    #: task runs, so it only bounds how long a killed worker's claim blocks a rerun.
    run_lease: float = 10.0
    #: Days a revoke is remembered in Redis, so a revoked task that is already on
    #: Kafka, or retries into the store, never runs, even on workers started later.
    revoke_days: float = 30.0
    #: Seconds a task id that ran from Kafka and finished is remembered, so a late
    #: duplicate delivery is acknowledged without running even when the task's
    #: result is ignored or not stored (0 = rely on the result backend alone: then such a
    #: task that was running when its worker stopped may run again on the next one, and a
    #: stopping worker hands none of the tasks it read back to Celery's broker).
    done_ttl: float = 3600.0
    #: Start pollers and workers even though the store's Redis may evict keys when
    #: full (a ``maxmemory-policy`` other than ``noeviction``), silently dropping
    #: scheduled tasks.  Off: they refuse to start with an error naming the policy.
    allow_eviction: bool = False
    #: Make every schedule write wait until it is durable, or fail with
    #: ``StoreNotDurable``: ``replicas=N`` (``WAIT``: N replicas have it), ``aof``
    #: (``WAITAOF``: fsynced to the primary's AOF, Redis >= 7.2; with ``replicas=N``
    #: also to N replicas' AOF), ``timeout=S`` (seconds, default 1), comma-separated,
    #: e.g. ``"replicas=1,timeout=0.5"``.  Empty: off (a write is acknowledged once in
    #: the primary's memory).  On a Redis Cluster each primary a write went to is waited on.
    schedule_wait: str = ""
    #: Accept ``delayed_*`` keys in the app's configuration that name no setting (another
    #: library's, say).  Off: such a key is refused at start, as a misspelt setting would
    #: otherwise be ignored without a word while its default applies.
    allow_unknown_settings: bool = False

    @classmethod
    def from_app(cls, app: Any) -> Settings:
        """Read and validate ``delayed_*`` settings from ``app.conf``."""
        return cls.from_conf(app.conf)

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], **changes: Any) -> Settings:
        """Read and validate the ``delayed_*`` keys of a Celery configuration (``app.conf``, or a
        dict of settings as a ``celeryconfig`` holds them; other keys are left alone), with
        ``changes`` (unprefixed names) on top."""
        values = {f.name: value for f in dataclasses.fields(cls) if (value := conf.get(PREFIX + f.name)) is not None}
        settings = cls.from_mapping({**values, **changes})
        if not settings.allow_unknown_settings:
            _refuse_unknown(conf)
        return settings

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Settings:
        """Build settings from unprefixed names, coercing and validating each."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in values.items():
            if name not in known:
                raise _unknown(PREFIX + name)
            kwargs[name] = _coerce(name, known[name], value)
        settings = cls(**kwargs)
        settings._validate()
        return settings

    def _validate(self) -> None:
        for queue, rate in self.queue_rates.items():
            _require(isinstance(queue, str) and 0 < len(queue.encode()) <= 255, "queue_rates",
                     f"keys must be queue names of 1 to 255 bytes, got {queue!r}")
            _require(rate in RATE, "queue_rates", f"values must be tasks per second {RATE}, got {rate!r} for {queue!r}")
        _require(bool(self.key_prefix) and ":" not in self.key_prefix and "{" not in self.key_prefix,
                 "key_prefix", "must be non-empty, without ':' or '{'")
        _require(bool(_TOPIC_CHARS.match(self.topic_prefix)), "topic_prefix",
                 "may hold only letters, digits, '.', '_' and '-'")
        _require(bool(self.consumer_group), "consumer_group", "must be non-empty")
        _require(self.group_protocol in GROUP_PROTOCOLS, "group_protocol",
                 f"must be one of {', '.join(GROUP_PROTOCOLS)}, got {self.group_protocol!r}")
        scheme = urlsplit(self.redis_url).scheme
        _require(scheme in ("redis", "rediss", "unix"), "redis_url",
                 f"must be a redis://, rediss:// or unix:// URL, got {redact_url(self.redis_url)!r}")
        _require(not self.redis_cluster or (scheme in ("redis", "rediss")
                                            and urlsplit(self.redis_url).path in ("", "/", "/0")),
                 "redis_cluster", "needs a redis:// or rediss:// delayed_redis_url of database 0, "
                 f"got {redact_url(self.redis_url)!r}")
        _require(all(_HOST_PORT.match(s) for s in self.kafka_servers.split(",")), "kafka_servers",
                 f"must be host:port[,host:port...], got {self.kafka_servers!r}")
        for url in self.etcd_urls:
            parts = urlsplit(url)
            _require(parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port is not None,
                     "etcd_endpoints", f"must be [http(s)://]host:port[,...], got {redact_url(url)!r}")
        _require("bootstrap.servers" not in self.kafka_config, "kafka_config",
                 "must not set bootstrap.servers (use delayed_kafka_servers)")
        _ = self.wait_policy  # parsed now: raises on a bad schedule_wait
        try:
            kafka_limit = self.kafka_message_max_bytes
        except (TypeError, ValueError):
            kafka_limit = 0
        _require(1000 <= kafka_limit <= 1_000_000_000, "kafka_config", "message.max.bytes must be an integer between "
                 f"1000 and 1000000000 (librdkafka's range), got {self.kafka_config.get('message.max.bytes')!r}")

    @property
    def wait_policy(self) -> WaitPolicy | None:
        """``schedule_wait`` parsed, or None when off."""
        if not self.schedule_wait:
            return None
        options = dict(item.strip().partition("=")[::2] for item in self.schedule_wait.split(","))
        wanted = ("replicas" in options or options.get("aof") == "") and set(options) <= {"replicas", "aof", "timeout"}
        try:
            policy = WaitPolicy(replicas=int(options.get("replicas", "0")), aof="aof" in options,
                                timeout_ms=round(float(options.get("timeout", "1")) * 1000))
        except (ValueError, OverflowError):
            wanted = False
        _require(wanted and 0 <= policy.replicas <= 100 and 0 < policy.timeout_ms <= 3_600_000, "schedule_wait",
                 f"must be replicas=N, aof or both, with an optional timeout=SECONDS (at most an hour), got "
                 f"{self.schedule_wait!r}")
        return policy

    @property
    def kafka_message_max_bytes(self) -> int:
        """The producer's largest record: ``message.max.bytes`` of delayed_kafka_config, or librdkafka's default."""
        return int(self.kafka_config.get("message.max.bytes", KAFKA_MESSAGE_MAX_BYTES))

    @property
    def etcd_urls(self) -> list[str]:
        return [u if "://" in u else f"http://{u}" for u in (u.strip() for u in self.etcd_endpoints.split(",")) if u]

    def topic(self, queue: str) -> str:
        """The Kafka topic that carries due tasks of a Celery queue."""
        return self.topic_prefix + queue

    def checked_topic(self, queue: str) -> str:
        """:meth:`topic`, or ValueError when Kafka cannot have a topic of that name (it would never
        be created, and a task routed there could never be dispatched)."""
        topic = self.topic(queue)
        if not queue or not _TOPIC_CHARS.match(queue) or len(topic) > MAX_TOPIC_LENGTH:
            raise ValueError(f"queue name {queue!r} cannot be a Kafka topic: use letters, digits, '.', '_', '-', "
                             f"at most {MAX_TOPIC_LENGTH - len(self.topic_prefix)} of them")
        return topic

    def kafka(self, defaults: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """confluent-kafka configuration: servers, ``defaults``, user config, then ``extra``."""
        return {"bootstrap.servers": self.kafka_servers, **(defaults or {}), **self.kafka_config, **extra}

    def __repr__(self) -> str:  # never print secrets
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["redis_url"] = redact_url(self.redis_url)
        shown["etcd_endpoints"] = ",".join(map(redact_url, self.etcd_urls))
        shown["etcd_password"] = "***" if self.etcd_password else None
        shown["kafka_config"] = {k: ("***" if _SECRET.search(k) else v) for k, v in self.kafka_config.items()}
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


#: Each numeric setting's :class:`Range` (a unit test holds every int and float setting to having one).
RANGES = {
    "partitions": Range(1, 16384),
    "topic_partitions": Range(1, 10_000),
    "topic_replication": Range(1, 100),
    "min_delay": Range(0, DECADE_S),
    "max_message_bytes": Range(1024, 512 * 1024 * 1024),  # Redis' largest string
    "compress_min_bytes": Range(0, 2 ** 31),
    "lease_ttl": Range(2, 86_400),  # etcd's smallest lease; a day-long failover is no failover
    "visibility_timeout": Range(1, DECADE_S),
    "claim_batch": Range(1, 5000),
    "max_sleep": Range(0, 3600, above=True),
    "dispatch_lead": Range(0, 5),
    "max_dispatch_rate": Range(0, MAX_RATE),  # 0 = no limit
    "metrics_port": Range(0, 65535),  # 0 = none
    "dlq_max_age": Range(0, DECADE_S),  # 0 = for ever
    "dlq_max_entries": Range(0, 10 ** 9),  # 0 = no limit
    "run_lease": Range(3, DECADE_S),
    "revoke_days": Range(0, DECADE_S / 86_400, above=True),
    "done_ttl": Range(0, DECADE_S),  # 0 = off
}
#: A rate of ``delayed_queue_rates``.
RATE = Range(0, MAX_RATE, above=True)


@dataclass(frozen=True)
class WaitPolicy:
    """What a schedule write waits for (``delayed_schedule_wait``)."""

    replicas: int  # replicas that must acknowledge it (WAIT), or fsync it with ``aof``
    aof: bool  # fsynced to the primary's AOF (WAITAOF)
    timeout_ms: int


#: The names of the settings, unprefixed.
_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings))
_HOST_PORT = re.compile(r"^\s*[^\s:/]+:\d{1,5}\s*$")
_SECRET = re.compile(r"password|secret|key|token", re.I)
#: A query parameter whose name says it holds a secret (redis-py reads ``?password=``), up to its value.
_SECRET_PARAM = re.compile(rf"((?:^|[&;])[^=&;#]*(?:{_SECRET.pattern})[^=&;#]*=)[^&;#]*", re.I)
#: Settings whose raw value may hold a secret: a type error shows only the value's type.
_SECRET_FIELDS = frozenset({"redis_url", "etcd_endpoints", "etcd_password", "kafka_config"})


def redact_url(url: str) -> str:
    """``url`` with any password (``user:pw@`` or a ``?password=`` parameter) replaced by ``***``, safe to log."""
    parts = urlsplit(url)
    if parts.password is not None:
        url = url.replace(parts.netloc, f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}", 1)
    base, mark, query = url.partition("?")
    return base + mark + _SECRET_PARAM.sub(r"\1***", query)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigurationError(f"{PREFIX}{name} {message}")


def _refuse_unknown(conf: Mapping[str, Any]) -> None:
    """Refuse the first key of ``conf`` that looks like a setting of ours and names none, as the user
    wrote it: ``delayed_*``, or ``CELERY_DELAYED_*`` in a namespaced (Django) configuration."""
    namespace = (getattr(conf, "prefix", None) or "").lower()  # Celery's config_from_object(namespace=...)
    for key in conf:
        name = key.lower().removeprefix(namespace) if namespace else key.lower()
        if name.startswith(PREFIX):
            field_name = name[len(PREFIX):]
            if field_name not in _FIELDS:
                raise _unknown(key, len(key) - len(name))


def _unknown(key: str, start: int = 0) -> ConfigurationError:
    """The error for an unknown setting ``key`` (its name begins at ``start``), with the closest known one."""
    close = difflib.get_close_matches(key[start:].lower(), [PREFIX + name for name in _FIELDS], n=1)
    hint = f"did you mean {key[:start]}{close[0].upper() if key.isupper() else close[0]}?" if close else \
        "see the settings page of the docs for the names"
    return ConfigurationError(f"unknown setting {key}: {hint} (delayed_allow_unknown_settings = True accepts it)")


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    """Coerce a raw setting to the field's type, within its :data:`RANGES`; ConfigurationError naming
    the setting and the value as given when it cannot."""
    parse = f.metadata.get("parse") or _PARSERS[str(f.type)]  # a str already: annotations are postponed
    try:
        parsed = parse(value)
    except (TypeError, ValueError):
        shown = f"a {type(value).__name__} (not shown: it may hold a secret)" if name in _SECRET_FIELDS else repr(value)
        raise ConfigurationError(f"{PREFIX}{name} must be {f.type}, got {shown}") from None
    _require(name not in RANGES or parsed in RANGES[name], name, f"must be {RANGES.get(name)}, got {value!r}")
    return parsed
