"""Leadership of store partitions, elected through etcd.

Each poller holds one etcd lease and registers itself under
``/<prefix>/pollers/<id>``.  For every partition it may lead it tries a
put-if-absent of ``/<prefix>/leader/<p>`` bound to that lease; the key's create
revision is the partition's *fencing token*: it only grows, so the Redis claim
script can refuse an older leader.  A poller takes at most ``ceil(P / N)``
partitions (N = live pollers) and gives back extras when others join.  When the
lease cannot be refreshed in time, every partition is dropped at once: the keys
expire in etcd and a standby takes them over.

Revisions only grow while etcd keeps its data.  An etcd recreated empty or
restored from an old backup starts again below the tokens the store has seen,
and its cluster id does not tell (a single member with the same name, peer URL
and cluster token gets the same id again).  So a token is ordered by
``(epoch, revision)``: the epoch is a counter kept in etcd at
``/<prefix>/epoch`` (0 while absent).  A claim refused with a fence higher than
any token etcd can issue now (its epoch, its current revision) proves etcd lost
history: a poller then starts the epoch after every fence in the store, and
dispatch resumes.  A paused ex-leader still holds a token of the old epoch, or
of the same epoch and an older revision, and stays refused.
"""
from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pyetcd
from pyetcd.client import Endpoint, KVMetadata, MultiEndpointEtcd3Client

from celery_delayed import inert
from celery_delayed.settings import Settings, redact_url
from celery_delayed.store.keys import Keys
from celery_delayed.store.layout import partition_of

logger = inert.logger(__name__)

#: A fencing token is ``epoch * EPOCH_SCALE + revision``: one integer, ordered by
#: (epoch, revision), that the claim script compares as it always did (a token of
#: epoch 0 is the bare revision) and that stays exact in Lua's doubles (< 2**53).
EPOCH_SCALE = 10**13
MAX_EPOCH = 2**53 // EPOCH_SCALE - 1


def token_of(epoch: int, revision: int) -> int:
    """The fencing token of a leader key created at ``revision`` during ``epoch``."""
    if not (0 <= epoch <= MAX_EPOCH and 0 <= revision < EPOCH_SCALE):
        raise OverflowError(f"fencing epoch {epoch} / etcd revision {revision} out of range")
    return epoch * EPOCH_SCALE + revision


def describe_token(token: int) -> str:
    """``epoch E revision R`` of a token, for log lines."""
    return f"epoch {token // EPOCH_SCALE} revision {token % EPOCH_SCALE}"


#: Seconds between two lines saying that leadership still cannot be proven for the same reason.
UNPROVEN_LOG_EVERY = 60.0


def etcd_address(settings: Settings) -> str:
    """Where etcd is looked for (passwords hidden), and the setting that says so, for errors."""
    return f"etcd at {','.join(map(redact_url, settings.etcd_urls))} (delayed_etcd_endpoints)"


def make_etcd(settings: Settings, timeout: float = 2.0) -> MultiEndpointEtcd3Client:
    """An etcd client over all configured endpoints, with TLS and auth when set."""
    creds = (MultiEndpointEtcd3Client.get_secure_creds(Path(settings.etcd_ca_cert).read_bytes())
             if settings.etcd_ca_cert else None)
    endpoints = []
    for url in settings.etcd_urls:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        endpoints.append(Endpoint(parts.hostname, parts.port, secure=secure, creds=creds if secure else None,
                                  time_retry=2.0))
    return MultiEndpointEtcd3Client(endpoints=endpoints, timeout=timeout, user=settings.etcd_user,
                                    password=settings.etcd_password, failover=True)


def leaders(settings: Settings, etcd: MultiEndpointEtcd3Client) -> dict[int, dict]:
    """Who leads each partition now, for operators: per led partition its leader's poller id and
    the seconds left on the leader's etcd lease (refreshed every lease_ttl / 3 while it lives)."""
    ttls: dict[int, int] = {}  # one lookup per lease: a poller's partitions share its lease
    out = {}
    for p, (holder, meta) in sorted(_leader_keys(etcd, Keys(settings.key_prefix)).items()):
        if meta.lease_id not in ttls:
            ttls[meta.lease_id] = int(etcd.get_lease_info(meta.lease_id).TTL)
        out[p] = {"poller": holder, "lease_ttl_s": ttls[meta.lease_id]}
    return out


def live_pollers(etcd: MultiEndpointEtcd3Client, keys: Keys) -> list[str]:
    """The ids of the pollers alive (each registered under its lease), from etcd."""
    return [meta.key.decode().rsplit("/", 1)[1] for _, meta in etcd.get_prefix(keys.pollers(), keys_only=True)]


def _leader_keys(etcd: MultiEndpointEtcd3Client, keys: Keys) -> dict[int, tuple[str, KVMetadata]]:
    """Partition -> (leader's poller id, its key's metadata), from etcd."""
    return {int(meta.key.decode().rsplit("/", 1)[1]): (value.decode(), meta)
            for value, meta in etcd.get_prefix(keys.leaders())}


class Leadership:
    """This poller's share of partitions, kept current by :meth:`step`."""

    def __init__(self, settings: Settings, etcd: MultiEndpointEtcd3Client | None = None,
                 poller_id: str | None = None) -> None:
        self.settings = settings
        self.etcd = etcd or make_etcd(settings)
        self.id = poller_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keys = Keys(settings.key_prefix)
        self._epoch_key = self.keys.epoch()
        self._lease: pyetcd.Lease | None = None
        self._owned: dict[int, int] = {}
        self._valid_until = 0.0
        self._lock = threading.Lock()  # guards _owned and _valid_until
        self._stepping = threading.Lock()  # one step at a time, never after release
        self._closed = False
        self._unproven_said: float | None = None  # while leadership cannot be proven: when that was last said

    def owned(self) -> dict[int, int]:
        """Partitions this poller may dispatch now, with their fencing tokens.

        Empty once the lease was last proven alive too long ago: a poller cut
        off from etcd stops dispatching before its keys can expire.
        """
        with self._lock:
            return dict(self._owned) if time.monotonic() < self._valid_until else {}

    def step(self) -> dict[int, int]:
        """Refresh the lease, then take or give back partitions toward a fair share."""
        with self._stepping:
            if self._closed:
                return {}
            started = time.monotonic()
            try:
                self._refresh()
                live = len(live_pollers(self.etcd, self.keys))
                share = math.ceil(self.settings.partitions / max(live, 1))
                owned = self._reconcile(share, self._read_epoch()[0])
            except Exception as exc:  # etcd down or lease lost: lead nothing until proven again
                self._unproven(exc)
                with self._lock:
                    self._owned, self._valid_until = {}, 0.0
                return {}
            if self._unproven_said is not None:
                logger.warning("poller %s: %s answers again: leading partitions", self.id, etcd_address(self.settings))
                self._unproven_said = None
            with self._lock:
                if owned != self._owned:
                    logger.info("poller %s leads partitions %s", self.id, sorted(owned))
                self._owned = owned
                # Keys live `ttl` after the refresh; stop trusting them well before that.
                self._valid_until = started + self.settings.lease_ttl * 2 / 3
            return dict(owned)

    def _unproven(self, exc: Exception) -> None:
        """Say why leadership cannot be proven: when it starts, then every :data:`UNPROVEN_LOG_EVERY` s
        while it lasts (a step runs twice a second, and its error alternates between kinds)."""
        now = time.monotonic()
        if self._unproven_said is None or now - self._unproven_said >= UNPROVEN_LOG_EVERY:
            logger.warning("poller %s cannot prove leadership through %s (%s: %s): dispatching nothing until it "
                           "answers (is the address right?)", self.id, etcd_address(self.settings),
                           type(exc).__name__, exc)
            self._unproven_said = now

    def fenced(self, partition: int, token: int, fences: list[int]) -> None:
        """A claim of ``partition`` with ``token`` was refused; ``fences`` are the store's fences.

        The partition is forgotten at once.  Then, by what etcd says now: if the
        fence is above any token etcd can issue, etcd lost its history and a new
        epoch starts (the partition comes back with the next step); if another
        poller already started a newer epoch than the token's, the next step
        brings the new token; otherwise a newer leader exists and this poller
        deletes its leader key, if it still holds it, so that a standby can lead.
        """
        with self._lock:
            self._owned.pop(partition, None)
        with self._stepping:
            if self._closed:
                return
            epoch, epoch_revision, revision = self._read_epoch()
            fence = fences[partition]
            if fence > token_of(epoch, revision):
                self._new_epoch(epoch, epoch_revision, max(fences) // EPOCH_SCALE + 1, partition, fence, revision)
            elif token // EPOCH_SCALE < epoch:
                logger.info("poller %s: partition %d refused a token of fencing epoch %d; etcd is at epoch %d "
                            "now: leading it with a token of that epoch from the next step", self.id, partition,
                            token // EPOCH_SCALE, epoch)
            else:
                logger.warning("poller %s: partition %d has a newer leader (fence %s, our token %s): resigning "
                               "it", self.id, partition, describe_token(fence), describe_token(token))
                self._delete_if_mine(partition, token % EPOCH_SCALE)

    def release(self) -> None:
        """Give every partition back now (clean shutdown: no standby waits for the TTL).

        Waits for a step in progress, and no step runs after it, so no leader key
        can be written once the lease is gone.
        """
        with self._lock:
            self._owned, self._valid_until = {}, 0.0
        with self._stepping:
            self._closed = True
            if self._lease is not None:
                try:
                    self._lease.revoke()  # deletes every key bound to it
                except Exception as exc:
                    logger.warning("poller %s could not revoke its lease: %s", self.id, exc)
                self._lease = None

    # -- internals ---------------------------------------------------------
    def _refresh(self) -> None:
        if self._lease is not None:
            replies = self._lease.refresh()
            if replies and replies[0].TTL > 0:
                return
            logger.warning("poller %s lost its etcd lease", self.id)
            with self._lock:
                self._owned = {}
        self._lease = self.etcd.lease(self.settings.lease_ttl)
        self.etcd.put(self.keys.poller(self.id), self.id, lease=self._lease)

    def _read_epoch(self) -> tuple[int, int, int]:
        """etcd's fencing epoch, the mod revision of its key (0 when absent) and etcd's current revision."""
        reply = self.etcd.get_response(self._epoch_key)
        if not reply.kvs:
            return 0, 0, reply.header.revision
        return int(reply.kvs[0].value), reply.kvs[0].mod_revision, reply.header.revision

    def _new_epoch(self, epoch: int, epoch_revision: int, new: int, partition: int, fence: int,
                   revision: int) -> None:
        """Replace epoch ``epoch`` (its key last written at ``epoch_revision``) by ``new``, unless
        another poller changed it first; the key has no lease: it lives as long as etcd's data."""
        token_of(new, 0)  # an epoch past MAX_EPOCH raises here
        tx = self.etcd.transactions
        unchanged = tx.mod(self._epoch_key) == epoch_revision if epoch_revision else tx.version(self._epoch_key) == 0
        ok, _ = self.etcd.transaction(compare=[unchanged], success=[tx.put(self._epoch_key, str(new))], failure=[])
        if ok:
            logger.warning("poller %s: partition %d was last claimed with fencing token %s, but etcd is at "
                           "epoch %d revision %d: etcd lost its data or was restored from a backup; started "
                           "fencing epoch %d, dispatch resumes", self.id, partition, describe_token(fence), epoch,
                           revision, new)

    def _reconcile(self, share: int, epoch: int) -> dict[int, int]:
        owned = {}
        leaders = _leader_keys(self.etcd, self.keys)
        for p, (holder, meta) in leaders.items():
            if holder == self.id and p < self.settings.partitions:
                owned[p] = token_of(epoch, meta.create_revision)
        for p in sorted(owned)[share:]:  # give back extras
            self._delete_if_mine(p)
            owned.pop(p)
        # Start with the partitions after ours so pollers don't all race for partition 0.
        free = [p for p in range(self.settings.partitions) if p not in leaders]
        offset = partition_of(self.id, len(free)) if free else 0
        for p in free[offset:] + free[:offset]:
            if len(owned) >= share:
                break
            revision = self._acquire(p)
            if revision:
                owned[p] = token_of(epoch, revision)
        return owned

    def _acquire(self, partition: int) -> int | None:
        if self._lease is None:  # a key without a lease would never expire
            raise RuntimeError("no lease")
        key = self.keys.leader(partition)
        tx = self.etcd.transactions
        ok, _ = self.etcd.transaction(compare=[tx.create(key) == 0],
                                      success=[tx.put(key, self.id, lease=self._lease)], failure=[])
        if not ok:
            return None
        value, meta = self.etcd.get(key)
        return meta.create_revision if value == self.id.encode() else None

    def _delete_if_mine(self, partition: int, revision: int | None = None) -> None:
        """Delete a leader key this poller holds (only the one created at ``revision``, when given)."""
        key = self.keys.leader(partition)
        tx = self.etcd.transactions
        compare = [tx.value(key) == self.id] + ([tx.create(key) == revision] if revision is not None else [])
        self.etcd.transaction(compare=compare, success=[tx.delete(key)], failure=[])

