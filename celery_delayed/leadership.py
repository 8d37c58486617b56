"""Leadership of store partitions, elected through etcd.

Each poller holds one etcd lease and registers itself under
``/<prefix>/pollers/<id>``.  For every partition it may lead it tries a
put-if-absent of ``/<prefix>/leader/<p>`` bound to that lease; the key's create
revision is the partition's *fencing token*: it only grows, so the Redis claim
script can refuse an older leader.  A poller takes at most ``ceil(P / N)``
partitions (N = live pollers) and gives back extras when others join.  When the
lease cannot be refreshed in time, every partition is dropped at once: the keys
expire in etcd and a standby takes them over.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import pyetcd
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from .settings import Settings
from .store import partition_of

logger = logging.getLogger(__name__)


def make_etcd(settings: Settings, timeout: float = 2.0) -> MultiEndpointEtcd3Client:
    """An etcd client over all configured endpoints, with TLS and auth when set."""
    creds = (MultiEndpointEtcd3Client.get_secure_creds(open(settings.etcd_ca_cert, "rb").read())
             if settings.etcd_ca_cert else None)
    endpoints = []
    for url in settings.etcd_urls:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        endpoints.append(Endpoint(parts.hostname, parts.port, secure=secure, creds=creds if secure else None,
                                  time_retry=2.0))
    return MultiEndpointEtcd3Client(endpoints=endpoints, timeout=timeout, user=settings.etcd_user,
                                    password=settings.etcd_password, failover=True)


class Leadership:
    """This poller's share of partitions, kept current by :meth:`step`."""

    def __init__(self, settings: Settings, etcd: MultiEndpointEtcd3Client | None = None,
                 poller_id: str | None = None) -> None:
        self.settings = settings
        self.etcd = etcd or make_etcd(settings)
        self.id = poller_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._root = f"/{settings.key_prefix}"
        self._lease: pyetcd.Lease | None = None
        self._owned: dict[int, int] = {}
        self._valid_until = 0.0
        self._lock = threading.Lock()  # guards _owned and _valid_until
        self._stepping = threading.Lock()  # one step at a time, never after release
        self._closed = False

    def leader_key(self, partition: int) -> str:
        return f"{self._root}/leader/{partition}"

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
                live = len(list(self.etcd.get_prefix(f"{self._root}/pollers/", keys_only=True)))
                share = math.ceil(self.settings.partitions / max(live, 1))
                owned = self._reconcile(share)
            except Exception as exc:  # etcd down or lease lost: lead nothing until proven again
                logger.warning("poller %s cannot prove leadership (%s): dispatching nothing", self.id, exc)
                with self._lock:
                    self._owned, self._valid_until = {}, 0.0
                return {}
            with self._lock:
                if owned != self._owned:
                    logger.info("poller %s leads partitions %s", self.id, sorted(owned))
                self._owned = owned
                # Keys live `ttl` after the refresh; stop trusting them well before that.
                self._valid_until = started + self.settings.lease_ttl * 2 / 3
            return dict(owned)

    def lose(self, partition: int) -> None:
        """Forget a partition at once (its claim was fenced by a newer leader)."""
        with self._lock:
            self._owned.pop(partition, None)

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
        self.etcd.put(f"{self._root}/pollers/{self.id}", self.id, lease=self._lease)

    def _reconcile(self, share: int) -> dict[int, int]:
        owned = {}
        leaders = {int(meta.key.decode().rsplit("/", 1)[1]): (value.decode(), meta.create_revision)
                   for value, meta in self.etcd.get_prefix(f"{self._root}/leader/")}
        for p, (holder, revision) in leaders.items():
            if holder == self.id and p < self.settings.partitions:
                owned[p] = revision
        for p in sorted(owned)[share:]:  # give back extras
            self._delete_if_mine(p)
            owned.pop(p)
        # Start with the partitions after ours so pollers don't all race for partition 0.
        free = [p for p in range(self.settings.partitions) if p not in leaders]
        offset = partition_of(self.id, len(free)) if free else 0
        for p in free[offset:] + free[:offset]:
            if len(owned) >= share:
                break
            token = self._acquire(p)
            if token:
                owned[p] = token
        return owned

    def _acquire(self, partition: int) -> int | None:
        if self._lease is None:  # a key without a lease would never expire
            raise RuntimeError("no lease")
        key = self.leader_key(partition)
        tx = self.etcd.transactions
        ok, _ = self.etcd.transaction(compare=[tx.create(key) == 0],
                                      success=[tx.put(key, self.id, lease=self._lease)], failure=[])
        if not ok:
            return None
        value, meta = self.etcd.get(key)
        return meta.create_revision if value == self.id.encode() else None

    def _delete_if_mine(self, partition: int) -> None:
        key = self.leader_key(partition)
        tx = self.etcd.transactions
        self.etcd.transaction(compare=[tx.value(key) == self.id], success=[tx.delete(key)], failure=[])

