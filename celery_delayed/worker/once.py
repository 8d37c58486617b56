"""Once per task_id: a task whose id already finished is not run again, and two
copies of one task_id never run at the same time.

Kafka and the poller deliver at least once, so a task can arrive twice.  Before
a worker hands a task to Celery it takes a *run claim* (``<prefix>:run:{<task_id>}``,
SET NX with a lease), unless the id was revoked (:func:`celery_delayed.store.records.remember_revoked`) or its
run from Kafka finished within ``delayed_done_ttl`` (:func:`remember_finished`:
this covers tasks whose result is ignored, or not stored, and attempts that ended
in a retry, whose late copies must not run again), then checks the result backend
for a terminal state.  :func:`admit` takes that decision for all the copies a
worker read together, in two round trips off the worker's event loop.  The
worker extends the claims of its running tasks while they run and releases each
when Celery settles the task; a claim left by a killed worker expires after the
lease.  A copy that finds the claim taken is put back in the store, due when the
claim would expire, so it is never dropped.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any
from collections.abc import Callable, Sequence

from celery import Celery, Task, signals, states
from celery.backends.base import BaseKeyValueStoreBackend, DisabledBackend

from celery_delayed import inert
from celery_delayed.envelope import KEY_HEADER, attempt_of
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.outcomes import STORE_ERRORS
from celery_delayed.store.redis_client import execute

logger = inert.logger(__name__)


class Refused(IntEnum):
    """Why :meth:`RunClaims.acquire` (``lua/acquire.lua``) refused a copy for good."""

    REVOKED = -1  # the task id was revoked
    FINISHED = -2  # this attempt of it, or a later one, already ended


#: Header the worker's Kafka consumer adds to each message it hands to Celery, so the
#: process that runs the task knows to remember when it finished; its value says when
#: the task was claimed, produced, read and handed to Celery (ms since the epoch).
FROM_KAFKA = "x_celery_delayed"
#: Header ``delayed drain --to-broker`` adds to each task it publishes to Celery's broker: an
#: installed worker runs such a message only as it runs a copy from Kafka, once per task id
#: (:mod:`.drained`), and remembers when it finished; its value: when it was sent (ms since the epoch).
DRAINED = "x_celery_delayed_drained"
#: Header a stopping worker adds, beside :data:`DRAINED`, to each task it hands back to Celery's broker
#: (:meth:`.Intake.let_go`): the task's Kafka copy carries it too, so such a copy is only a shortcut,
#: and one older than half of ``delayed_done_ttl`` is not run (:mod:`.drained`); its value: when it was
#: handed back (ms since the epoch).
HANDED_BACK = "x_celery_delayed_handed_back"
#: Seconds between two tries of an admission that failed (the store or result backend down).
ADMISSION_RETRY = 1.0


class RunClaims:
    """Run claims held by one worker process (``owner``), leased for ``lease_s`` seconds.

    A keeper thread extends every held claim each third of a lease until it is
    released.  It belongs to the process, not to a Kafka consumer, so a
    consumer restart (a broker reconnect) cannot leave a running task's claim
    to lapse while the task still runs.
    """

    def __init__(self, store: DelayedStore, owner: str, lease_s: float) -> None:
        self.redis = store.redis
        self.keys = store.keys
        self.owner = owner
        self.lease_ms = int(lease_s * 1000)
        self._acquire, self._release, self._extend = (store.scripts[name] for name in ("acquire", "release", "extend"))
        self._held: set[str] = set()
        self._releasing: list[str] = []  # given up, not yet told to Redis (see release)
        self._flush_failing = False
        self._lock = threading.Lock()
        self._keeper = threading.Thread(target=self._keep, name="delayed-claims", daemon=True)
        self._keeper.start()
        self._pid = os.getpid()  # a forked pool child inherits a copy it must not act on
        _claims_of_this_process.add(self)

    def acquire_many(self, copies: Sequence[tuple[str, int]]) -> list[int]:
        """Claim each ``(task_id, attempt)`` (``attempt``: Celery's ``retries``), in order, in one
        round trip that first tells Redis the releases pending (:meth:`release`).  Per copy: 0
        when claimed, a :class:`Refused` when it must not run, else the ms until the claim expires."""
        with self._lock:
            releasing, self._releasing = self._releasing, []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for task_id in releasing:
                self._release(keys=[self.keys.run(task_id)], args=[self.owner], client=pipe)
            _acquire(self._acquire, self.keys, pipe, copies, self.owner, self.lease_ms)
            replies = execute(self.redis, pipe)[len(releasing):]
        except BaseException:  # told again with the next round trip, still before any claim
            with self._lock:
                self._releasing[:0] = releasing
            raise
        claimed = [task_id for (task_id, _), wait_ms in zip(copies, replies) if wait_ms == 0]
        with self._lock:
            self._held.update(claimed)
        return _outcomes(replies)

    def forget(self, task_id: str) -> None:
        """Stop extending a claim without giving it up: it lapses after its lease, unless released."""
        with self._lock:
            self._held.discard(task_id)

    def release(self, task_id: str) -> None:
        """Give a claim up.  Redis is told with the next :meth:`acquire_many` or :meth:`flush` (the
        worker's Kafka thread calls one every 0.1 s at most), never on the caller's thread: a copy
        read later finds the claim released, as those calls tell the releases before claiming."""
        with self._lock:
            self._held.discard(task_id)
            self._releasing.append(task_id)

    def release_now(self, task_id: str) -> None:
        """Give a claim up now, on the caller's thread: before a copy of the task is written where
        another worker reads it, which must not find the claim held.  Raises a store error."""
        self.forget(task_id)
        self._release(keys=[self.keys.run(task_id)], args=[self.owner])

    def release_all(self) -> None:
        """Give up every claim held, as the process exits: the tasks that still hold one (a cold
        stop ended them, Celery saying nothing) cannot end here any more, and their copies read
        next must not wait for the claims to lapse.  Best effort: a store away lets them lapse."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._releasing.extend(self._held)
            self._held.clear()
        self.flush()

    def flush(self) -> None:
        """Tell Redis the pending releases; if it cannot be told, they are told with the next call
        (meanwhile the claims only lapse after their lease).  Called every 0.1 s at most, so a store
        that stays down is reported once, not at every call."""
        if self._releasing:
            try:
                self.acquire_many(())
            except STORE_ERRORS as exc:
                if not self._flush_failing:
                    logger.warning("%d run claims not released yet (%s); trying again", len(self._releasing), exc)
                self._flush_failing = True
                return
        self._flush_failing = False

    def _keep(self) -> None:
        """Each third of a lease: tell Redis the releases pending (a stopped feed no longer does) and
        extend every claim held; one no longer ours (lapsed, and maybe taken by another worker) is
        dropped."""
        while True:
            time.sleep(self.lease_ms / 3000)
            self.flush()
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                for task_id in held:
                    self._extend(keys=[self.keys.run(task_id)], args=[self.owner, self.lease_ms], client=pipe)
                lost = [task_id for task_id, extended in zip(held, execute(self.redis, pipe)) if not extended]
            except STORE_ERRORS as exc:  # try again next round, well within the lease
                logger.warning("could not extend %d run claims: %s", len(held), exc)
                continue
            with self._lock:
                self._held.difference_update(lost)


#: The run claims of this process, each given up when it exits (:meth:`RunClaims.release_all`).
_claims_of_this_process: weakref.WeakSet[RunClaims] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """A worker's cold shutdown (SIGQUIT, a second Ctrl-C) ends its running tasks without a word to
    its consumer, nor ``worker_shutdown``; the process's exit is the last place to give their claims up."""
    for claims in list(_claims_of_this_process):
        claims.release_all()


#: The finished record of a task id that ended for good (else: the attempt that retried).
ENDED = "F"


class Admit(Enum):
    """What a worker does with a copy of a task it read (:func:`admit`)."""

    RUN = "run"  # claimed: hand it to Celery
    FINISHED = "finished"  # this attempt, or the task, ended already: acknowledge it
    REVOKED = "revoked"  # revoked: record it REVOKED, never run it
    REPLACED = "replaced"  # its delayed_key names another task now: record it REVOKED
    BUSY = "busy"  # another copy runs: put it back in the store, due when that claim would expire


@dataclass(frozen=True)
class Verdict:
    admit: Admit
    wait_ms: int = 0  # BUSY: ms until the other copy's claim expires
    meta: dict | None = None  # FINISHED: the result backend's meta, when it holds the end


@dataclass(frozen=True)
class Copy:
    """A copy of a task read from Kafka, as :func:`admit` needs it."""

    task_id: str
    attempt: int  # Celery's ``retries``
    key: str | None = None  # its replace-mode delayed_key, if any


def admit(claims: RunClaims, copies: Sequence[Copy], backend: Any,
          key_holder: Callable[[str], str | None]) -> list[Verdict]:
    """The run-or-skip decision for copies read together, one :class:`Verdict` each, in order:
    their run claims in one round trip to the store (:meth:`RunClaims.acquire_many`), then the
    result backend's state of each in one more (MGET on a key-value backend), so a copy that
    ended between the two cannot slip through.

    Every claim taken but not run is released here, on one path: those of copies that must not
    run, and all of them when the backend or the store fails (which raises).  So each try
    decides afresh: no claim is held across an outage (it could lapse meanwhile and be taken by
    another worker) nor by a feed that stopped before trying again.
    """
    taken = claims.acquire_many([(c.task_id, c.attempt) for c in copies])
    verdicts: list[Verdict] = []
    try:
        verdicts = _judge(copies, taken, backend, key_holder)
        return verdicts
    finally:
        for i, (copy, claim) in enumerate(zip(copies, taken)):
            if claim == 0 and (i >= len(verdicts) or verdicts[i].admit is not Admit.RUN):
                claims.release(copy.task_id)


def look(store: DelayedStore, copies: Sequence[Copy], backend: Any) -> list[Verdict]:
    """What :func:`admit` would decide for each copy, taking no run claim: a drain's check before
    it sends a task to the broker (RUN: neither ended nor running now).  Two round trips."""
    pipe = store.redis.pipeline(transaction=False)
    _acquire(store.scripts["acquire"], store.keys, pipe, [(c.task_id, c.attempt) for c in copies], "", 0)
    return _judge(copies, _outcomes(execute(store.redis, pipe)), backend, store.key_holder)


def _acquire(script: Any, keys: Any, pipe: Any, copies: Sequence[tuple[str, int]], owner: str, lease_ms: int) -> None:
    """Queue ``lua/acquire.lua`` on ``pipe`` for each ``(task_id, attempt)`` (lease 0: look only)."""
    for task_id, attempt in copies:
        script(keys=[keys.task(kind, task_id) for kind in ("run", "revoked", "done")],
               args=[owner, lease_ms, attempt], client=pipe)


def _outcomes(replies: Sequence[int]) -> list[int]:
    """``lua/acquire.lua``'s replies: 0 (claimed, or free), a :class:`Refused`, else ms until the claim expires."""
    return [Refused(wait_ms) if wait_ms < 0 else wait_ms for wait_ms in replies]


def _judge(copies: Sequence[Copy], taken: Sequence[int], backend: Any,
           key_holder: Callable[[str], str | None]) -> list[Verdict]:
    """The verdict of each copy from its claim's outcome, the result backend (one more round trip)
    and the holders of the copies' keys."""
    metas = finished_many(backend, [c.task_id for c in copies])
    holders = {key: key_holder(key) for key in {c.key for c in copies if c.key is not None}}
    return [_verdict(copy, claim, metas, holders) for copy, claim in zip(copies, taken)]


def _verdict(copy: Copy, claim: int, metas: dict[str, dict], holders: dict[str, str | None]) -> Verdict:
    if copy.task_id in metas:  # before REVOKED: a task both finished and revoked is finished
        return Verdict(Admit.FINISHED, meta=metas[copy.task_id])
    if copy.key is not None and holders[copy.key] not in (None, copy.task_id):
        return Verdict(Admit.REPLACED)
    if claim is Refused.REVOKED:
        return Verdict(Admit.REVOKED)
    if claim is Refused.FINISHED:
        return Verdict(Admit.FINISHED)
    if claim:
        return Verdict(Admit.BUSY, wait_ms=claim)
    return Verdict(Admit.RUN)


def finished_many(backend: Any, task_ids: Sequence[str]) -> dict[str, dict]:
    """The result backend's meta of each id whose state is terminal (success, failure, revoked):
    one MGET on a key-value backend (Redis...), else one lookup per id.  A meta that cannot be
    decoded is taken as not terminal (logged): the run claim still keeps the task to one run."""
    if isinstance(backend, DisabledBackend) or not task_ids:
        return {}
    if not isinstance(backend, BaseKeyValueStoreBackend):
        metas = {task_id: backend.get_task_meta(task_id, cache=False) for task_id in task_ids}
    else:
        metas = {}
        for task_id, value in zip(task_ids, backend.mget([backend.get_key_for_task(t) for t in task_ids])):
            try:
                metas[task_id] = backend.decode_result(value) if value else {}
            except Exception as exc:
                logger.warning("the result of task %s cannot be read (%r): taken as not ended", task_id, exc)
    return {task_id: meta for task_id, meta in metas.items() if meta.get("status") in states.READY_STATES}


def remember_finished(app: Celery) -> None:
    """Connect a ``task_postrun`` handler recording, for ``delayed_done_ttl`` seconds, where the
    task ran, each task id from Kafka (or a drain) that ended in a terminal state (as :data:`ENDED`) or in a
    retry (as the number of the attempt that retried: its late copies must not run again)."""

    def on_postrun(sender: Task | None = None, task_id: str | None = None, state: str | None = None,
                   **_: Any) -> None:
        if sender is None or sender.app is not app:
            return
        if state in states.READY_STATES:
            record = ENDED
        elif state == states.RETRY:
            record = str(attempt_of({"retries": sender.request.retries,
                                     "replaced_task_nesting": sender.request.replaced_task_nesting}))
        else:
            return
        if not (getattr(sender.request, FROM_KAFKA, None) or getattr(sender.request, DRAINED, None)):
            return
        store = app.amqp.delayed_store
        key = getattr(sender.request, KEY_HEADER, None)
        if record == ENDED and isinstance(key, str):
            try:  # the key is free for the next task; until then a newer holder is kept
                store.release_key(key, task_id)
            except STORE_ERRORS as exc:  # a stale holder only costs memory: a new task replaces it
                logger.warning("task %s finished, but its key %r could not be released: %s", task_id, key, exc)
        ttl_ms = int(store.settings.done_ttl * 1000)
        if ttl_ms <= 0:
            return
        try:
            store.redis.set(store.keys.done(task_id), record, px=ttl_ms)
        except STORE_ERRORS as exc:  # the result backend check still applies
            logger.warning("task %s finished, but could not be recorded as such: %s", task_id, exc)

    signals.task_postrun.connect(on_postrun, weak=False)
