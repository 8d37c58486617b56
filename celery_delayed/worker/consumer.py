"""Worker side: a consumer bootstep that feeds Kafka records to stock Celery.

A background thread reads the ready topics of the worker's queues, decodes
each batch of records and decides which may run (:func:`.once.admit`: run
claims and result-backend states, two round trips a batch), then hands them to
the worker's event loop (a pipe it watches; in a green worker, gevent or eventlet, which has
none, this thread is a greenlet of the worker's hub and hands them over through the pool's timer:
:mod:`.wakeup`), where :class:`.intake.Intake`
gives each to Celery's own task strategy: events, time limits, ``acks_late``,
revoke and results behave as for broker messages.  The loop itself makes no
Redis round trip for a task that runs.  A record's offset is
settled when Celery acks or rejects the request, and only the contiguous
settled prefix of each partition is committed (see :mod:`.offsets`).
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
import uuid
import weakref
from collections import deque
from typing import Any

from celery import bootsteps, signals
from celery.app.amqp import AMQP
from celery.platforms import EX_FAILURE
from celery.worker import state as worker_state
from confluent_kafka import Consumer, KafkaException, TopicPartition

from celery_delayed import inert
from celery_delayed.envelope import Envelope
from celery_delayed.kafka import consumer_config, ensure_topics
from celery_delayed.settings import ConfigurationError, Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.durability import worker_preflight
from celery_delayed.worker.intake import TRANSIENT_ERRORS, Arrival, Intake, Task, copy_of
from celery_delayed.worker.offsets import OffsetTracker
from celery_delayed.worker.drained import guard_drained
from celery_delayed.worker.gate import PoolGate, lost_when_killed
from celery_delayed.worker.once import ADMISSION_RETRY, RunClaims, admit
from celery_delayed.worker.wakeup import GreenWakeup, Wakeup

logger = inert.logger(__name__)

#: Longest a poll of Kafka waits for a record (s), and, in a green worker, the sleep between two
#: polls that found none: at most that much more lateness, a poll every 5 ms while idle.
POLL_WAIT, GREEN_POLL_GAP = 0.1, 0.005
#: Unsettled records a worker holds when Celery's prefetch limit is unlimited.
DEFAULT_MAX_UNSETTLED = 1000
COMMIT_INTERVAL = 0.5
#: Hand-overs of one record to Celery failing by an error of no known transient kind (a second
#: apart) before that record is dead-lettered instead of holding up every one behind it.
UNEXPECTED_TRIES = 5
#: Longest the consumer goes without polling Kafka while the worker is full (s);
#: well under librdkafka's max.poll.interval.ms (300 s).
MAX_POLL_GAP = 60.0
#: Records of one Kafka partition read and not yet committable (settled ones behind a task
#: still running) at which that partition is paused; each would run again if the worker died.
MAX_UNCOMMITTED = 10_000
#: Longest a stopping feed polls for the revoke of its partitions after unsubscribing, before it
#: closes its consumer anyway (the revoke takes ~0.1 s).
LEAVE_TIMEOUT = 10.0
#: Longest a stopping feed waits for its consumer's close() after the revoke (s): it waits for every
#: offset commit still unanswered, which, Kafka down, librdkafka holds for up to session.timeout.ms.
CLOSE_TIMEOUT = 5.0
#: Seconds a worker reads no partition of its queues' topics before it says so (once, until it reads one).
IDLE_WARNING = 15.0

#: Feeds whose thread still runs, closed for good on ``worker_shutdown``.
_feeds: weakref.WeakSet[KafkaFeed] = weakref.WeakSet()


@signals.worker_shutdown.connect
def _close_feeds(**_: Any) -> None:
    for feed in list(_feeds):
        feed.close()


class KafkaConsumerStep(bootsteps.StartStopStep):
    """Consume the worker's queues from Kafka (started after Celery's task strategies exist)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "Kafka"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.feed: KafkaFeed | None = None
        self.claims: RunClaims | None = None  # outlives feeds: kept across consumer restarts
        self.gate: PoolGate | None = None
        if getattr(c.pool, "is_green", False):  # before Celery's strategies take on_task_request (Tasks.start)
            self.gate = c.on_task_request = PoolGate(c.pool, c.timer, c.on_task_request)
            lost_when_killed(c.pool)

    def start(self, c: Any) -> None:
        """Start reading Kafka.  A bad setting or a store it must not use (another layout, eviction) stops
        the worker with one line saying so, rather than Celery's "Unrecoverable error" traceback."""
        try:
            if self.gate is not None:
                self.gate.reopen()
            self.feed = KafkaFeed(c, self.claims, self.gate)
            self.claims = self.feed.claims
            self.feed.start()
            guard_drained(c, self.claims)
        except ConfigurationError as exc:
            logger.critical("celery-delayed cannot start this worker: %s", exc)
            raise SystemExit(EX_FAILURE) from None

    def stop(self, c: Any) -> None:
        if self.feed is not None:
            self.feed.stop()
            self.feed = None

    #: Stopped at once when Celery's consumer closes (a worker stop: ``Blueprint.close`` runs Celery's
    #: ``on_close``, which drops the requests it holds and cancels their ETA timers, then each step's
    #: ``close``), not later with the others, stopped last first, several of which wait on the network:
    #: a green worker's feed handed records to Celery meanwhile, whose requests nothing dropped, so
    #: :meth:`.Intake.let_go` could not tell whether they would run and they lapsed after the run lease.
    #: A consumer restart calls ``stop`` alone.
    close = shutdown = stop


@signals.celeryd_init.connect
def _refuse_bad_settings(instance: Any, **_: Any) -> None:
    """A worker of an app with celery-delayed installed checks its ``delayed_*`` settings before
    Celery prints its banner or starts a pool: a misspelt or bad one stops it with one line, exit 1.
    (Logging is not set up yet: the line goes to stderr.)"""
    if KafkaConsumerStep not in instance.app.steps["consumer"]:
        return
    try:
        Settings.from_app(instance.app)
    except ConfigurationError as exc:
        print(f"celery-delayed cannot start this worker: {inert.inert(str(exc))}", file=sys.stderr)
        raise SystemExit(EX_FAILURE) from None


class KafkaFeed:
    """The Kafka consumer thread of one worker consumer, and its hand-off to the loop."""

    def __init__(self, c: Any, claims: RunClaims | None = None, gate: PoolGate | None = None) -> None:
        amqp: AMQP = c.app.amqp
        self.c = c
        self.store: DelayedStore = amqp.delayed_store  # the app's, shared with its other users in the process
        self.settings: Settings = self.store.settings
        self.claims = claims or RunClaims(self.store, owner=f"{c.hostname}-{uuid.uuid4().hex[:8]}",
                                          lease_s=self.settings.run_lease)
        self.queues = sorted(amqp.queues.consume_from)
        self.offsets = OffsetTracker()
        self._ready: deque[Arrival] = deque()  # admitted, waiting for the loop
        self._gate = gate  # a green worker's (gevent, eventlet), in front of its pool
        self._ready_lock = threading.Lock()
        self._unadmitted: list[Arrival] = []  # read, waiting for a failed admission's next try
        self._admit_at = 0.0
        self._scheduled = False
        self._reading = threading.Event()
        self._stopping = False  # stop() began: nothing more goes to Celery (see stop)
        self._room = threading.Event()  # set when a settle frees a prefetch slot
        self.intake = Intake(c, self.store, self.claims, self.offsets, on_settled=self._room.set)
        self._paused: set[tuple[str, int]] = set()  # partitions paused for their backlog
        self._idle_since: float | None = time.monotonic()  # reading no partition since (None: said so)
        self._thread: threading.Thread | None = None
        self._wakeup: Wakeup | GreenWakeup | None = None
        # a green worker patched threading: this feed's thread is a greenlet of its hub
        self._green = gate is not None

    # -- consumer thread -------------------------------------------------------
    def start(self) -> None:
        if self.c.hub is None and not self._green:
            raise RuntimeError("celery-delayed needs a worker with an event loop (a Redis or AMQP broker) or a "
                               "green pool (-P gevent, -P eventlet)")
        conf = self.c.app.conf
        if not (conf.task_acks_late and conf.task_reject_on_worker_lost):
            logger.warning("task_acks_late and task_reject_on_worker_lost are not both on: a task is "
                           "acknowledged when it starts, so a worker killed mid-task loses it")
        if not conf.result_backend_always_retry:
            logger.warning("result_backend_always_retry is off: a task whose result or retry state cannot be "
                           "stored while the result backend restarts is recorded as failed, and a retry it "
                           "scheduled then never runs")
        worker_preflight(self.store)
        try:
            ensure_topics(self.settings, self.queues)
        except KafkaException as exc:  # a restart while Kafka is down: subscribe anyway, read once it is back
            logger.warning("cannot check the Kafka topics of %s now (%s); consuming once they answer", self.queues, exc)
        config = consumer_config(self.settings, **{
            "group.id": self.settings.consumer_group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "queued.max.messages.kbytes": 16384,  # bound what librdkafka prefetches
        })
        self._incremental = incremental(config)
        consumer = Consumer(config)
        topics = [self.settings.topic(q) for q in self.queues]
        consumer.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke)
        self._wakeup = wakeup = (GreenWakeup(self.c.timer, self._drain) if self._green
                                 else Wakeup(self.c.hub, self._drain))
        self._reading.set()
        _feeds.add(self)
        self._thread = threading.Thread(target=self._run, args=(consumer, wakeup), name="delayed-kafka", daemon=True)
        self._thread.start()
        logger.info("consuming Kafka topics %s (group %s, group protocol %s)", topics, self.settings.consumer_group,
                    config["group.protocol"])

    def stop(self) -> None:
        """Hand this worker's partitions over now: stop reading, commit what is settled and leave
        the consumer group, so the other workers read the partitions at once (a deploy costs no
        lateness), while the tasks in hand that run here finish.

        On a warm shutdown Celery stops this step before its pool, so those
        tasks settle after the group was left: their records are read again by
        the partitions' new owners, which find them running (their run claims,
        still extended here) or finished, and never run them twice.  Celery
        drops the requests it had reserved but not started when its consumer
        stops: their claims are given up and the tasks handed back to Celery's
        broker (see :meth:`.Intake.let_go`), where a live worker takes them at once.
        """
        self._stopping = True  # let_go's calls to Redis and the broker let a green worker's loop run meanwhile
        if self._gate is not None:
            self._gate.close()
        self.intake.let_go({request.id for request in worker_state.active_requests})
        self._reading.clear()
        self._room.set()
        self._drop_ready()
        if self._wakeup is not None:  # None: start() failed before the loop was watched
            self._wakeup.unwatch()

    def close(self) -> None:
        """Wait until the consumer thread left the group, and tell Redis the claims given up since."""
        self._reading.clear()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.claims.flush()

    def _run(self, consumer: Consumer, wakeup: Wakeup | GreenWakeup) -> None:
        last_commit = time.monotonic()
        full_since: float | None = None
        try:
            while self._reading.is_set():
                try:
                    self._pause_long_backlogs(consumer)
                    room = self._max_unsettled() - self.offsets.unsettled()
                    if self._unadmitted and time.monotonic() >= self._admit_at:
                        self._admit()
                    elif room > 0 and not self._unadmitted:
                        full_since = None
                        self._read(consumer, room)
                    else:
                        full_since = self._wait_for_room(consumer, full_since or time.monotonic())
                    self.claims.flush()
                    self._warn_if_idle(consumer)
                    if time.monotonic() - last_commit >= COMMIT_INTERVAL:
                        self._commit(consumer, self.offsets.committable())
                        last_commit = time.monotonic()
                except Exception:  # this thread must outlive any one failure, or the worker goes deaf
                    logger.exception("Kafka consumer thread: error, going on in a second")
                    time.sleep(1)
        finally:
            self._drop_ready()
            self.claims.flush()  # before leaving: a copy the new owner reads must not find a claim given up
            self._commit(consumer, self.offsets.committable())
            self._leave(consumer)
            wakeup.close()
            _feeds.discard(self)

    def _leave(self, consumer: Consumer) -> None:
        """Leave the consumer group (its partitions go to the other members now), then close.

        The partitions are revoked in an ordinary poll after unsubscribing, never
        inside ``close()``: the (un)assign call a revoke callback makes waits on
        librdkafka's group thread while holding the GIL, and inside a close that
        answer can fail to come -- every thread of the worker then frozen, its warm
        shutdown hung for good.  Records polled meanwhile are dropped (uncommitted:
        the new owners read them).
        """
        consumer.unsubscribe()
        deadline = time.monotonic() + LEAVE_TIMEOUT
        while self.offsets.assigned() and time.monotonic() < deadline:
            self._poll(consumer)
        if self.offsets.assigned():
            logger.warning("Kafka partitions %s not revoked %.0f s after unsubscribing; closing anyway",
                           sorted(self.offsets.assigned()), LEAVE_TIMEOUT)
        # close() waits for every offset commit still unanswered, and librdkafka holds a commit made
        # while the group coordinator is unreachable (Kafka down) for session.timeout.ms (45 s on the
        # consumer protocol, which does not let a client lower it): bounded here, left to finish alone.
        closing = threading.Thread(target=_close, args=(consumer,), name="delayed-kafka-close", daemon=True)
        closing.start()
        closing.join(CLOSE_TIMEOUT)
        if closing.is_alive():
            logger.warning("Kafka consumer not closed after %.0f s (offset commits waiting for an unreachable "
                           "group coordinator); stopping without waiting for it", CLOSE_TIMEOUT)

    def _warn_if_idle(self, consumer: Consumer) -> None:
        """Say once when this worker has read no partition for :data:`IDLE_WARNING` s: more workers
        consume its queues than their topics have partitions, and it stays idle for delayed tasks."""
        if self.offsets.backlogs():
            self._idle_since = time.monotonic()
        elif self._idle_since is not None and time.monotonic() - self._idle_since > IDLE_WARNING:
            self._idle_since = None
            counts = {t: len(m.partitions) for t, m in consumer.list_topics(timeout=5).topics.items()
                      if t in {self.settings.topic(q) for q in self.queues}}
            logger.warning("this worker reads none of the partitions of %s (%s in all, each read by another "
                           "worker): more workers consume these queues than their topics have partitions, so it "
                           "runs none of their delayed tasks; grow a topic with `celery -A proj delayed topics "
                           "--grow QUEUE --partitions N`", sorted(counts), sum(counts.values()))

    def _wait_for_room(self, consumer: Consumer, full_since: float) -> float:
        """Hold off reading while the worker holds its prefetch limit; returns the new ``full_since``.

        Pausing every partition would cost ~1 s of fetch latency on resume, so
        they are paused only when full for long, to poll (keeping this consumer
        in its group) without taking records.
        """
        if time.monotonic() - full_since > MAX_POLL_GAP:
            assigned = consumer.assignment()
            consumer.pause(assigned)
            consumer.consume(num_messages=1, timeout=0)
            consumer.resume([tp for tp in assigned if (tp.topic, tp.partition) not in self._paused])
            full_since = time.monotonic()
        self._room.wait(0.05)
        self._room.clear()
        return full_since

    def _pause_long_backlogs(self, consumer: Consumer) -> None:
        """Pause a partition whose uncommitted records (settled ones behind a task still running)
        reach :data:`MAX_UNCOMMITTED`, each a duplicate if this worker died; resume it at half.

        Only that partition waits: records of the others, and the prefetch limit,
        are not held up by one long task.
        """
        for (topic, number), backlog in self.offsets.backlogs().items():
            tp = TopicPartition(topic, number)
            if backlog >= MAX_UNCOMMITTED and (topic, number) not in self._paused:
                consumer.pause([tp])
                self._paused.add((topic, number))
                logger.info("Kafka partition %s[%d]: %d records uncommitted behind a running task; paused",
                            topic, number, backlog)
            elif backlog <= MAX_UNCOMMITTED // 2 and (topic, number) in self._paused:
                consumer.resume([tp])
                self._paused.discard((topic, number))

    def _read(self, consumer: Consumer, room: int) -> None:
        # consume(n, timeout) waits for n records or the timeout, which would hold a
        # lone record up to the timeout: wait for the first, then take what is there.
        first = self._poll(consumer)
        if first is None:
            return
        records = [first, *(consumer.consume(num_messages=min(room, 500) - 1, timeout=0) if room > 1 else ())]
        read_ms = int(time.time() * 1000)
        for record in records:
            if record.error():
                logger.warning("Kafka consumer error: %s", record.error())
                continue
            partition = self.offsets.add((record.topic(), record.partition()), record.offset())
            if partition is not None:  # None: revoked meanwhile, the new owner reads it
                self._unadmitted.append(self._examine(Arrival(record, partition, read_ms)))
        if self._unadmitted:
            self._admit()

    def _poll(self, consumer: Consumer) -> Any:
        """One record or event, waiting up to :data:`POLL_WAIT` s for it.  librdkafka's wait blocks
        the OS thread, so a green worker's feed, a greenlet, polls without waiting and sleeps
        :data:`GREEN_POLL_GAP` between empty polls, a green sleep that lets the tasks' greenlets run."""
        if not self._green:
            return consumer.poll(POLL_WAIT)
        record = consumer.poll(0)
        if record is None:
            time.sleep(GREEN_POLL_GAP)
        return record

    def _examine(self, arrival: Arrival) -> Arrival:
        """Decode a record and find its task's strategy; what can never run is marked for the
        dead-letter queue (``problem``)."""
        try:
            envelope = Envelope.decode(arrival.record.value())
        except Exception as exc:  # any decoder failure (RecursionError too) is the message's
            arrival.problem, arrival.trace = f"undecodable message: {exc!r}", traceback.format_exc()
            return arrival
        headers = dict(envelope.headers)
        name = headers.get("task")
        strategy = self.c.strategies.get(name) if isinstance(name, str) else None
        if strategy is None:
            arrival.problem = f"unknown task {name!r}"
        else:
            arrival.task = Task(envelope, headers, strategy)
        return arrival

    def _admit(self) -> None:
        """Decide which of the records read may run (:func:`.once.admit`), then hand them all
        to the loop.  While the store or the result backend fails, the same records are tried
        again every :data:`ADMISSION_RETRY` s (nothing more is read meanwhile; a stopped feed
        leaves them to the next consumer), holding no claim in between."""
        arrivals = self._unadmitted
        runnable = [(a, a.task) for a in arrivals if a.task is not None]
        copies = [copy_of(task.envelope.task_id, task.headers) for _, task in runnable]
        try:
            verdicts = admit(self.claims, copies, self.c.app.backend, self.store.key_holder)
        except TRANSIENT_ERRORS as exc:
            logger.warning("cannot tell yet whether %d tasks may run (%r); trying again in %.0f s",
                           len(runnable), exc, ADMISSION_RETRY)
            self._admit_at = time.monotonic() + ADMISSION_RETRY
            return
        for (arrival, _), verdict in zip(runnable, verdicts):
            arrival.verdict = verdict
        self._unadmitted = []
        self._hand_over(arrivals)

    def _max_unsettled(self) -> int:
        qos = getattr(self.c, "qos", None)
        return (qos.value if qos is not None and qos.value else 0) or DEFAULT_MAX_UNSETTLED

    def _commit(self, consumer: Consumer, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``offsets`` without waiting for Kafka's answer.

        A synchronous commit has no timeout: made while the group coordinator is unreachable (Kafka
        down), librdkafka holds it until the coordinator is back or session.timeout.ms passed (45 s
        on the consumer protocol), and the feed with it, past any warm stop's grace period.  Commits
        go out in order; one that fails is covered by the next, and an offset left uncommitted only
        makes the partition's next owner read settled records again, which it does not run again.
        """
        if not offsets:
            return
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=True)
        except Exception as exc:  # e.g. during a rebalance: the next commit covers it
            logger.debug("offset commit failed: %s", exc)

    # Each rebalance callback applies its change itself: left to confluent-kafka, the change is made
    # after asking librdkafka for the rebalance protocol while holding the GIL, and that answer can
    # wait forever when the consumer closes as the group coordinator stalls (KIP-848) -- every thread
    # of the worker frozen, its warm shutdown hung for good.
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("assigned Kafka partitions %s", _names(partitions))
        self.offsets.assign([(tp.topic, tp.partition) for tp in partitions])
        if self._incremental:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("Kafka partitions %s revoked", _names(partitions))
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._paused.difference_update(keys)
        self._commit(consumer, self.offsets.revoke(keys))
        if self._incremental:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()

    # -- event loop ------------------------------------------------------------
    def _hand_over(self, arrivals: list[Arrival]) -> None:
        with self._ready_lock:
            self._ready.extend(arrivals)
            scheduled, self._scheduled = self._scheduled, True
        if not self._reading.is_set():  # stopped meanwhile: the loop no longer drains
            self._drop_ready()
        elif not scheduled and self._wakeup is not None:  # set by start() before anything is read
            self._wakeup.wake()

    def _drop_ready(self) -> None:
        """Drop the records not handed to Celery yet (a stopped feed's: the next consumer reads
        them again), giving up the run claims taken for them."""
        with self._ready_lock:
            dropped = list(self._ready)
            self._ready.clear()
            self._scheduled = False
        for arrival in dropped:
            if (task_id := arrival.claimed()) is not None:
                self.claims.release(task_id)

    def _drain(self) -> None:
        """On the loop thread: give every waiting record to Celery, in order.

        A record whose hand-over fails for a reason outside the message (Redis,
        the result backend or the broker unreachable) is tried again a second
        later, before any record behind it; only a message that can never run
        goes to the dead-letter queue (in :meth:`.Intake.dispatch`).  An error of
        no known transient kind is tried :data:`UNEXPECTED_TRIES` times, then the
        record is dead-lettered naming it: one record must not stop every one
        behind it for good.
        """
        while True:
            if self._stopping or not self._reading.is_set():  # stopped: left for redelivery
                self._drop_ready()
                return
            with self._ready_lock:
                if not self._ready:
                    self._scheduled = False
                    return
                arrival = self._ready.popleft()
            try:
                self.intake.dispatch(arrival)
            except Exception as exc:  # never let one message break the loop, nor a blink lose it
                if not isinstance(exc, TRANSIENT_ERRORS):
                    arrival.tries += 1
                if arrival.tries < UNEXPECTED_TRIES or not self._give_up(arrival, exc):
                    logger.warning("task delivery deferred 1 s: %r", exc)
                    with self._ready_lock:
                        self._ready.appendleft(arrival)
                    self.c.timer.call_after(1.0, self._drain)
                    return

    def _give_up(self, arrival: Arrival, exc: Exception) -> bool:
        """Dead-letter a record whose hand-over failed :data:`UNEXPECTED_TRIES` times by an error of
        no known transient kind; False when that fails too (tried again)."""
        try:
            self.intake.give_up(arrival, f"could not be handed to Celery: {exc!r}",
                                "".join(traceback.format_exception(exc)))
            return True
        except Exception as again:
            logger.warning("could not dead-letter a record that cannot be handed to Celery: %r", again)
            return False


def incremental(config: dict[str, Any]) -> bool:
    """Whether a consumer of this configuration rebalances incrementally (its callbacks add and remove
    the partitions named) rather than eagerly (the whole assignment replaced): always on the
    ``consumer`` group protocol, and on ``classic`` with a cooperative assignor."""
    return (config.get("group.protocol") == "consumer"
            or "cooperative" in str(config.get("partition.assignment.strategy", "")))


def _close(consumer: Consumer) -> None:
    try:
        consumer.close()
    except Exception as exc:  # closed already, or Kafka's error: nothing left to hand over
        logger.debug("Kafka consumer close failed: %s", exc)


def _names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]
