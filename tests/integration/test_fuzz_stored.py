"""Whatever bytes the store holds, a real poller delivers them intact or dead-letters them with their
bytes and a reason, delivers every good task beside them, and lives on."""
from __future__ import annotations

import time

from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetters

from .support import TopicReader, envelopes, wait_for


def test_an_envelope_stored_behind_a_lane_head_that_cannot_be_one_is_dead_lettered_not_fatal(
        overrides, processes):
    """An envelope led by a NUL is stored behind no lane head, and its NUL reads as one: cut short,
    or not UTF-8 (the review's poison pill: the claim raised, the poller exited, and every restart
    did the same).  Such a message is dead-lettered, bytes and all."""
    overrides.update(delayed_partitions=1, result_expires=300)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue, tag = overrides["task_default_queue"], overrides["delayed_key_prefix"]
    reader = TopicReader(settings, settings.topic(queue))
    now = int(time.time() * 1000)
    old = {f"{tag}-not-utf8": b"\0\xff\xfe", f"{tag}-cut-short": b"\0\x09cut", f"{tag}-both": b"\0\x02\xff"}
    store.schedule_many([(task_id, now, data) for task_id, data in old.items()])
    store.schedule_many(envelopes(8, queue, now))
    poller = processes.poller()
    assert len(reader.read_until(8, timeout=30)) == 8, \
        f"the good tasks beside them were not delivered; poller exit status {poller.poll()}, its log:\n" \
        + processes.log(poller)[-1500:]
    reader.close()
    letters = DeadLetters(store)
    for task_id, data in old.items():
        letter = wait_for(lambda: letters.get(task_id), 10, f"{task_id} in the dead-letter queue")
        assert letter.message == data and "undecodable stored message" in letter.reason
    assert poller.poll() is None, "the poller died:\n" + processes.log(poller)[-3000:]
