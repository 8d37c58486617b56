"""Fuzzing what the store holds: whatever bytes are scheduled, a real poller delivers them intact or
dead-letters them with their bytes and a reason, delivers every good task beside them, and lives on.

Seeded: ``CD_FUZZ_SEED=<n>`` replays a run; each run prints its seed, shown when it fails.
"""
from __future__ import annotations

import os
import random
import time

from confluent_kafka.admin import AdminClient

from celery_delayed.envelope import deflate
from celery_delayed.settings import Settings
from celery_delayed.store import delayed
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetters
from celery_delayed.store.layout import bucket_of

from .support import TopicReader, envelopes, wait_for

#: Bad messages of each kind (random, truncated, mutated, behind a lane head of their own).
EACH = 750


def bad_messages(rng: random.Random, frames: list[bytes], queue: str) -> list[bytes]:
    """Stored messages no poller can dispatch as they are, or barely: random bytes (half of them led
    by the NUL a lane head starts with), real envelopes (compact and deflated) truncated or with
    bytes flipped, envelopes behind a lane head of their own (wrong length, not UTF-8, or the right
    queue: only the store may write one), the review's cases, nothing at all, and two huge ones."""
    def frame() -> bytes:
        chosen = rng.choice(frames)
        return deflate(chosen, 0) if rng.random() < 0.5 else chosen

    def flipped(data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
        return bytes(out)

    def lane_head() -> bytes:
        name = rng.choice([queue.encode(), rng.randbytes(rng.randrange(0, 8)), b"\xfe", b"ok"])
        length = len(name) if rng.random() < 0.5 else rng.randrange(256)
        return b"\0" + bytes((length,)) + name

    random_bytes = [(b"\0" if rng.random() < 0.5 else b"") + rng.randbytes(rng.randrange(0, 80)) for _ in range(EACH)]
    truncated = [(f := frame())[:rng.randrange(len(f))] for _ in range(EACH)]
    mutated = [flipped(frame()) for _ in range(EACH)]
    headed = [lane_head() + frame() for _ in range(EACH)]
    huge = [b"\0" + rng.randbytes(2_000_000),  # and a real envelope past Kafka's message size
            next(envelopes(1, queue, 0))[2] + rng.randbytes(1_500_000)]
    fixed = [b"", b"\0", b"\0\0", b"\0\xff\xfe", b"\xff\xfe\0\x01", b"\0\x01a" + frames[0]]
    return random_bytes + truncated + mutated + headed + huge + fixed


def test_every_stored_byte_string_is_delivered_intact_or_dead_lettered_and_the_poller_lives_on(
        overrides, processes):
    seed = int(os.environ.get("CD_FUZZ_SEED") or random.randrange(2**32))
    print(f"\nfuzz seed {seed} (CD_FUZZ_SEED={seed} replays it)")
    rng = random.Random(seed)
    overrides.update(result_expires=300)  # each dead letter records a FAILURE result: gone soon
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue, tag = overrides["task_default_queue"], overrides["delayed_key_prefix"]
    now = int(time.time() * 1000)
    good = {task_id: data for task_id, _, data in envelopes(500, queue, now, prefix=f"{tag}-good")}
    bad = {f"{tag}-bad-{i}": data for i, data in enumerate(bad_messages(rng, list(good.values()), queue))}
    items = [(task_id, now, data) for task_id, data in [*good.items(), *bad.items()]]
    rng.shuffle(items)
    assert store.schedule_many(items) == len(items), f"seed {seed}: not every message was stored"

    poller = processes.poller()
    wait_for(lambda: poller.poll() is not None or sum(r["scheduled"] + r["inflight"] for r in store.counts()) == 0,
             60, lambda: f"the store to empty (seed {seed}): {store.counts()}")
    assert poller.poll() is None, f"seed {seed}: the poller died:\n" + processes.log(poller)[-3000:]

    letters = {letter.task_id: letter for letter in DeadLetters(store).list(limit=len(items))}
    assert not letters.keys() & good.keys(), f"seed {seed}: good tasks dead-lettered"
    for task_id in letters.keys() & bad.keys():
        letter = letters[task_id]
        assert letter.message == bad[task_id] and letter.reason and letter.source == "poller", \
            f"seed {seed}: {task_id} ({bad[task_id][:60]!r}) dead-lettered as {letter.message[:60]!r}: {letter.reason}"
    delivered = {**good, **{task_id: data for task_id, data in bad.items() if task_id not in letters}}
    topics = [t for t in AdminClient(settings.kafka()).list_topics(timeout=10).topics
              if t.startswith(settings.topic_prefix)]
    readers = [TopicReader(settings, topic, values=True) for topic in topics]
    seen: dict[str, list[bytes]] = {}

    def read_all() -> bool:
        for reader in readers:
            reader.read(timeout=0.2)
            seen.update(reader.values)
        return delivered.keys() <= seen.keys()

    wait_for(read_all, 30, lambda: f"{len(delivered.keys() - seen.keys())} tasks neither dead-lettered nor "
                                   f"on Kafka (seed {seed}), e.g. {sorted(delivered.keys() - seen.keys())[:5]}")
    for reader in readers:
        reader.close()
    for task_id, data in delivered.items():
        assert set(seen[task_id]) == {data}, f"seed {seed}: {task_id} ({data[:60]!r}) delivered as {seen[task_id]!r}"
    print(f"{len(bad)} bad messages: {len(bad) - len(delivered) + len(good)} dead-lettered, "
          f"{len(delivered) - len(good)} delivered intact; {len(good)} good tasks delivered")
    assert poller.poll() is None, f"seed {seed}: the poller died:\n" + processes.log(poller)[-3000:]


def test_an_envelope_an_older_version_stored_behind_no_lane_head_is_dead_lettered_not_fatal(
        overrides, processes, monkeypatch):
    """Before an envelope led by a NUL got an empty lane head, it was stored behind none, and its NUL
    read as a lane head: cut short, or not UTF-8 (the review's poison pill: the claim raised, the
    poller exited, and every restart did the same).  Such a message is dead-lettered, bytes and all."""
    overrides.update(delayed_partitions=1, result_expires=300)
    settings = Settings.from_conf(overrides)
    store = DelayedStore(settings)
    queue, tag = overrides["task_default_queue"], overrides["delayed_key_prefix"]
    reader = TopicReader(settings, settings.topic(queue))
    now = int(time.time() * 1000)
    old = {f"{tag}-not-utf8": b"\0\xff\xfe", f"{tag}-cut-short": b"\0\x09cut", f"{tag}-both": b"\0\x02\xff"}
    with monkeypatch.context() as older:  # how versions before the empty lane head stored these
        older.setattr(delayed, "stored_message",
                       lambda due_ms, data, queue=None: bucket_of(due_ms).to_bytes(4, "big") + data)
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
