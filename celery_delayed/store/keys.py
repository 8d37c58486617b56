"""Every Redis key and etcd key celery-delayed uses, named in one place.

Keys of a partition ``p`` carry ``{p}`` as their Redis Cluster hash tag, so
one Lua script can touch them all on one node; the keys of one task id (its
run claim, revoke and finished records) carry the CRC-32 of the id, so
``lua/acquire.lua`` reads them together.  :data:`LAYOUT` documents each; the
README's key table is checked against it (``tests/unit/test_keys_layout.py``).
"""
from __future__ import annotations

import zlib

#: ``(pattern, Redis type, what it holds)`` of every key, in the README's order.
LAYOUT: tuple[tuple[str, str, str], ...] = (
    ("<prefix>:{p}:t:<lane>:<start>", "ZSET",
     "id -> due ms of the tasks of queue <lane> due in the 10 s bucket starting at <start> (s)"),
    ("<prefix>:{p}:buckets:<lane>", "ZSET", "bucket start -> earliest due ms in that bucket of queue <lane>"),
    ("<prefix>:{p}:lanes", "ZSET", "queue (lane) -> earliest due ms of its tasks"),
    ("<prefix>:{p}:t:<start>", "ZSET", "as t:<lane>:<start>, for the tasks stored before lanes (layout format 1)"),
    ("<prefix>:{p}:buckets", "ZSET", "as buckets:<lane>, for the tasks stored before lanes"),
    ("<prefix>:{p}:msg", "HASH", "id -> 4-byte bucket start + lane (NUL, length, queue) + envelope"),
    ("<prefix>:{p}:inflight", "ZSET", "id -> visibility deadline ms of a claimed task, also its claim's stamp"),
    ("<prefix>:{p}:attempt", "HASH", "id -> attempt number of the stored copy (retries only)"),
    ("<prefix>:{p}:failing", "ZSET",
     "id -> due ms of a task whose delivery to Kafka failed, until it is delivered or leaves the store"),
    ("<prefix>:{p}:fence", "STRING", "highest fencing token that has claimed the partition"),
    ("<prefix>:{p}:stamp", "STRING", "the last claim's stamp (stamps only grow)"),
    ("<prefix>:{p}:claim", "STRING",
     "the last claim's request id and stamp: the claim sent again after its reply was lost finds its tasks"),
    ("<prefix>:{p}:handover", "STRING",
     "the highest stamp in flight when a new leader first claimed, until its claims took those tasks back; then 0"),
    ("<prefix>:{p}:cancelled:<request>", "HASH",
     "id -> envelope of the tasks one cancel request removed, kept a minute at most: sent again after its reply "
     "was lost, it answers the same"),
    ("<prefix>:{p}:keys", "HASH", "replace-by-key key -> the task id scheduled under it"),
    ("<prefix>:{p}:recurring", "HASH",
     "recurring schedule id -> its definition (JSON: rule, message template, version, pending occurrence)"),
    ("<prefix>:{p}:recurring:putting", "HASH",
     "recurring schedule id -> the version of a put whose pending occurrence is not yet written"),
    ("<prefix>:{p}:wait", "STRING",
     "a short-lived write after which WAIT/WAITAOF confirms a cluster node's replication"),
    ("<prefix>:run:{<crc>}<id>", "STRING", "run claim: the worker running the task id, leased"),
    ("<prefix>:revoked:{<crc>}<id>", "STRING", "the task id was revoked (kept delayed_revoke_days)"),
    ("<prefix>:done:{<crc>}<id>", "STRING", "'F' once the task id ended, else its last attempt that retried"),
    ("<prefix>:{dlq}:msg", "HASH", "dead letters: id -> record"),
    ("<prefix>:{dlq}:index", "ZSET", "dead letters: id -> when parked (ms)"),
    ("<prefix>:{dlq}:wait", "STRING", "as {p}:wait, for the dead letters' node"),
    ("<prefix>:layout", "STRING", "partitions, bucket width and format every process must agree on"),
    ("<prefix>:paused", "HASH", "paused queue -> when it was paused (ms, Redis clock); pollers skip its lane"),
    ("<prefix>:rates", "HASH", "queue -> most tasks/s dispatched, set at run time (0 = no limit)"),
    ("<prefix>:tokens:<queue>", "HASH", "a rate-limited queue's token bucket (tokens, at ms), shared by the pollers"),
    ("<prefix>:wake", "channel", "pub/sub: a sooner task was scheduled, pollers wake"),
    ("/<prefix>/leader/<p>", "etcd", "the partition's leader (a poller id), under its lease"),
    ("/<prefix>/pollers/<id>", "etcd", "live pollers, each under its lease"),
    ("/<prefix>/epoch", "etcd", "fencing epoch, raised when etcd lost its data"),
)


class Keys:
    """The key names of one deployment (``delayed_key_prefix``)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.wake = f"{prefix}:wake"
        self.layout = f"{prefix}:layout"
        self.paused = f"{prefix}:paused"
        self.rates = f"{prefix}:rates"
        self.dlq = [f"{prefix}:{{dlq}}:msg", f"{prefix}:{{dlq}}:index"]
        self.dlq_wait = f"{prefix}:{{dlq}}:wait"
        self.etcd_root = f"/{prefix}"
        self.pattern = f"{prefix}:*"  # every Redis key of the deployment (SCAN MATCH)

    def tokens(self, queue: str) -> str:
        return f"{self.prefix}:tokens:{queue}"

    # -- a partition's keys ----------------------------------------------------
    def of(self, partition: int, name: str) -> str:
        """``<prefix>:{p}:<name>``."""
        return f"{self.prefix}:{{{partition}}}:{name}"

    def bucket_prefix(self, partition: int) -> str:
        """What a lane and a bucket's start (s) follow in a bucket key (scripts build bucket keys from it)."""
        return self.of(partition, "t:")

    def bucket(self, partition: int, start: int | str, lane: str = "") -> str:
        """A bucket of ``lane`` (a queue; "" for tasks stored before lanes, see ``lua/_buckets.lua``)."""
        return self.of(partition, f"t:{lane}:{start}" if lane else f"t:{start}")

    def buckets(self, partition: int, lane: str = "") -> str:
        """The bucket index of ``lane``."""
        return self.of(partition, f"buckets:{lane}" if lane else "buckets")

    def lanes(self, partition: int) -> str:
        return self.of(partition, "lanes")

    def msgs(self, partition: int) -> str:
        return self.of(partition, "msg")

    def inflight(self, partition: int) -> str:
        return self.of(partition, "inflight")

    def attempts(self, partition: int) -> str:
        return self.of(partition, "attempt")

    def failing(self, partition: int) -> str:
        return self.of(partition, "failing")

    def fence(self, partition: int) -> str:
        return self.of(partition, "fence")

    def stamp(self, partition: int) -> str:
        return self.of(partition, "stamp")

    def last_claim(self, partition: int) -> str:
        return self.of(partition, "claim")

    def handover(self, partition: int) -> str:
        """The highest stamp in flight when a new leader came, until it took them back (``lua/claim.lua``)."""
        return self.of(partition, "handover")

    def cancelled(self, partition: int, request: str) -> str:
        return self.of(partition, f"cancelled:{request}")

    def key_index(self, partition: int) -> str:
        return self.of(partition, "keys")

    def recurring(self, partition: int) -> str:
        return self.of(partition, "recurring")

    def recurring_putting(self, partition: int) -> str:
        return self.of(partition, "recurring:putting")

    def wait_probe(self, partition: int) -> str:
        return self.of(partition, "wait")

    def core(self, partition: int) -> list[str]:
        """The bucket index, message hash, inflight set and lanes: most scripts' first KEYS."""
        return [self.buckets(partition), self.msgs(partition), self.inflight(partition), self.lanes(partition)]

    # -- a task id's records ---------------------------------------------------
    def task(self, kind: str, task_id: str) -> str:
        """``<prefix>:<kind>:{<crc>}<id>`` for ``kind`` run, revoked or done (an id may hold braces,
        so the hash tag is its CRC-32)."""
        return f"{self.prefix}:{kind}:{{{zlib.crc32(task_id.encode()):08x}}}{task_id}"

    def run(self, task_id: str) -> str:
        return self.task("run", task_id)

    def revoked(self, task_id: str) -> str:
        return self.task("revoked", task_id)

    def done(self, task_id: str) -> str:
        return self.task("done", task_id)

    # -- etcd ------------------------------------------------------------------
    def leader(self, partition: int) -> str:
        return f"{self.leaders()}{partition}"

    def leaders(self) -> str:
        """The etcd prefix of the partitions' leader keys."""
        return f"{self.etcd_root}/leader/"

    def poller(self, poller_id: str) -> str:
        return f"{self.pollers()}{poller_id}"

    def pollers(self) -> str:
        """The etcd prefix of the live pollers' keys."""
        return f"{self.etcd_root}/pollers/"

    def epoch(self) -> str:
        return f"{self.etcd_root}/epoch"
