"""Replies lost after Redis ran the script: the store reaches the shared Redis through a Toxiproxy
proxy whose toxic resets the connection as the reply comes back (``Toxiproxy.replies_lost``), so the
script's writes are made and the caller sees only a broken connection (issue 41, item 7)."""
from __future__ import annotations

import time
from collections import Counter

from celery import states

from celery_delayed import store_of
from celery_delayed.poller.loop import Poller
from celery_delayed.sandbox import running
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.outcomes import Change, StoreUnavailable
from celery_delayed.store.revoke import cancel_or_revoke
from celery_delayed.store.scripts import NAMES, source
from tasks import create_app

from .support import TopicReader, envelopes, wait_for


def now_ms() -> int:
    return int(time.time() * 1000)


def scripts_loaded(store: DelayedStore) -> DelayedStore:
    """``store``, its scripts loaded in Redis: the reply lost must be the script's own, not a NOSCRIPT
    (the script then not run) to the first call of a script new to this Redis."""
    for name in NAMES:
        store.redis.script_load(source(name))
    return store


def test_a_claim_whose_reply_is_lost_is_dispatched_on_the_next_round_not_after_the_visibility_timeout(
        overrides, toxiproxy, monkeypatch):
    """The first claim takes every task in flight and its reply is lost: the poller's next round
    sends them, each once, well within the minute they would otherwise wait in flight."""
    settings = Settings.from_conf(overrides, partitions=1, visibility_timeout=60,
                                  redis_url=f"redis://{toxiproxy.listen['redis']}/0")
    store = scripts_loaded(DelayedStore(settings))
    queue = overrides["task_default_queue"]
    reader = TopicReader(settings, settings.topic(queue))
    store.schedule_many(envelopes(5, queue, now_ms()))
    claim, lost = store.claim, []

    def first_reply_lost(*args, **kwargs):
        if lost:
            return claim(*args, **kwargs)
        try:
            with toxiproxy.replies_lost("redis"):
                return claim(*args, **kwargs)
        except StoreUnavailable:
            lost.append(store.counts()[0]["inflight"])
            raise

    monkeypatch.setattr(store, "claim", first_reply_lost)
    with running(Poller(settings, store=store)):
        keys = reader.read_until(5, timeout=20)
        reader.read(timeout=1)  # a copy sent twice would be here by now
    reader.close()
    assert lost == [5], "the first claim's reply was not lost after it took the tasks: the test proved nothing"
    assert keys == Counter({f"task-{i}": 1 for i in range(5)})
    wait_for(lambda: sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0, 10, "the store to empty")


def test_a_cancel_whose_reply_is_lost_reports_the_task_cancelled_and_records_it_revoked(overrides, toxiproxy,
                                                                                     monkeypatch):
    """``delayed cancel`` (``cancel_or_revoke``): the cancel script removed the task and its reply
    was lost; the call still says cancelled, and the result backend says REVOKED."""
    app = create_app(**{**overrides, "delayed_redis_url": f"redis://{toxiproxy.listen['redis']}/0"})
    result = app.tasks["tasks.demo.add"].apply_async((1, 2), countdown=600)
    store = scripts_loaded(store_of(app))
    execute, cancel_many, lost = store.execute, store.cancel_many, []

    def reply_lost(pipe):
        """This pipeline's reply only (its scripts go as EVALSHA alone: the reply lost is theirs)."""
        monkeypatch.setattr(store, "execute", execute)
        try:
            with toxiproxy.replies_lost("redis"):
                return execute(pipe)
        except StoreUnavailable:
            lost.append(store.get(result.id))
            raise

    def first_reply_lost(task_ids):
        monkeypatch.setattr(store, "execute", reply_lost)
        return cancel_many(task_ids)

    monkeypatch.setattr(store, "cancel_many", first_reply_lost)
    assert cancel_or_revoke(app, [result.id]) == {result.id: Change.DONE}
    assert lost == [None], "the cancel's reply was not lost after it removed the task: the test proved nothing"
    assert app.backend.get_task_meta(result.id)["status"] == states.REVOKED
    assert not list(store.redis.scan_iter(f"{store.keys.prefix}:*:cancelled:*")), "the request's record was kept"
