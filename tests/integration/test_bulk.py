"""``apply_many``: signatures scheduled in bulk are stored as ``apply_async`` stores them, run once from
Kafka, show up as sent in the event stream, and a failure part-way leaves a list that can be sent again."""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Iterator

import pytest
import redis
from celery import Celery

from celery_delayed import ApplyManyError, DelayedPublishError, StoreUnavailable, apply_many, store_of
from celery_delayed.client import batch, bulk
from celery_delayed.envelope import Envelope
from celery_delayed.store.delayed import SKEW_KEPT_S
from celery_delayed.store.layout import task_id_of
from tasks import create_app

from . import bulk_client
from .support import ROOT, environment, wait_for

pytestmark = pytest.mark.cluster_too


def stored(app: Celery, task_id: str) -> Envelope:
    return Envelope.decode(store_of(app).message(task_id))


def same_but_ids(envelope: Envelope, task_id: str) -> dict:
    """What an envelope says, its own task id written as ``ID``."""
    def unid(value):
        return value.replace(task_id, "ID") if isinstance(value, str) else value
    return {"headers": {k: unid(v) for k, v in envelope.headers.items()}, "body": envelope.body,
            "properties": {k: unid(v) for k, v in envelope.properties.items()}, "queue": envelope.queue,
            "content": (envelope.content_type, envelope.content_encoding),
            "route": (envelope.exchange, envelope.routing_key)}


def scheduled_count(app: Celery) -> int:
    return sum(p["scheduled"] for p in store_of(app).counts())


def test_a_signature_is_stored_as_its_apply_async_stores_it(overrides):
    app = create_app(**overrides)
    work, add = app.tasks["tasks.demo.work"], app.tasks["tasks.demo.add"]
    eta = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    expires = eta + timedelta(hours=1)
    variants = {
        "plain": work.s("r"),
        "options": work.s("r", 0.5).set(priority=3, headers={"tenant": "t1"}, expires=expires,
                                       link=add.si(1, 2), shadow="shown-as"),
        "queue": add.s(1, 2).set(queue=f"{overrides['task_default_queue']}-other"),
        "msgpack": add.s(3, 4).set(serializer="msgpack"),
    }
    for name, signature in variants.items():
        single, many = f"{name}-{uuid.uuid4()}", f"{name}-{uuid.uuid4()}"
        signature.clone().set(task_id=single).apply_async(eta=eta)
        apply_many([signature.clone().set(task_id=many, countdown=99)], eta=eta, app=app)
        assert same_but_ids(stored(app, many), many) == same_but_ids(stored(app, single), single), name
        assert store_of(app).get(many)["due_ms"] == int(eta.timestamp() * 1000)

    with pytest.raises(TypeError, match="eta or countdown"):
        apply_many([work.s("r")], eta=eta, countdown=10, app=app)


def test_each_keeps_its_own_countdown_and_one_without_goes_to_the_broker(overrides):
    app = create_app(**overrides)
    add = app.tasks["tasks.demo.add"]
    before = datetime.now(timezone.utc).timestamp() * 1000
    results = apply_many([add.s(1, i).set(countdown=600 + i) for i in range(3)] + [add.s(0, 0)], app=app)
    dues = [store_of(app).get(r.id)["due_ms"] - before for r in results[:3]]
    assert all(0 <= due - (600 + i) * 1000 < 5000 for i, due in enumerate(dues)), dues
    assert store_of(app).get(results[3].id) is None
    assert redis.Redis.from_url(app.conf.broker_url).llen(overrides["task_default_queue"]) == 1


class SentEvents(threading.Thread):
    """The ids of the task-sent events on the app's event stream, as Flower receives them."""

    def __init__(self, app: Celery) -> None:
        super().__init__(daemon=True)
        self.app, self.ids, self.etas, self.events, self.probed = app, [], {}, {}, threading.Event()

    def run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.on_event})
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def on_event(self, event: dict) -> None:
        if event["type"] == "task-sent":
            self.ids.append(event["uuid"])
            self.etas[event["uuid"]] = event.get("eta")
            self.events[event["uuid"]] = event
        elif event["type"] == "test-probe":
            self.probed.set()

    def listening(self) -> None:
        """Probe until the receiver hears its own kind: a fanout only reaches a subscribed receiver."""
        def probe():
            with self.app.producer_or_acquire() as producer:
                self.app.events.Dispatcher(enabled=False).publish("test-probe", {}, producer)
            return self.probed.wait(0.5)
        wait_for(probe, 30, "the event receiver to listen")

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.join(10)


def test_bulk_scheduled_tasks_run_once_and_are_seen_sent(overrides, processes, monkeypatch):
    monkeypatch.setattr(bulk, "CHUNK", 7)  # several chunks, the last one short
    monkeypatch.setattr(batch, "EVENTS_PER_MESSAGE", 3)
    app = create_app(**overrides)
    work = app.tasks["tasks.demo.work"]
    run = uuid.uuid4().hex
    events = SentEvents(app)
    events.start()
    events.listening()
    progress: list[int] = []
    results = apply_many((work.s(run) for _ in range(30)), countdown=3, app=app, progress=progress.append)
    assert progress == [7, 14, 21, 28, 30]
    ids = [r.id for r in results]
    assert len(set(ids)) == 30 and scheduled_count(app) == 30
    channels = [app.backend.get_key_for_task(task_id) for task_id in ids]
    assert [n for _, n in app.backend.client.pubsub_numsub(*channels)] == [0] * 30  # none held open until get()
    processes.poller()
    processes.worker("w1")
    assert [r.get(timeout=90) for r in results] == ids
    runs = {k.decode(): int(v) for k, v in store_of(app).redis.hgetall(f"demo:{run}:runs").items()}
    assert runs == {task_id: 1 for task_id in ids}
    wait_for(lambda: set(events.ids) >= set(ids), 30, "a task-sent event of every task")
    events.stop()
    ours = set(ids)  # the broker's event exchange is shared with other tests' clients
    assert sorted(i for i in events.ids if i in ours) == sorted(ids)  # each once
    assert all(events.etas[task_id] for task_id in ids)


def test_a_failure_part_way_stores_the_ones_before_and_the_rest_can_be_sent_once(overrides, monkeypatch):
    monkeypatch.setattr(bulk, "CHUNK", 4)
    app = create_app(**overrides)
    add = app.tasks["tasks.demo.add"]
    signatures = [add.s(i, i) for i in range(10)]
    signatures[6] = add.s(6, 6).set(queue="not a topic!")  # a space: no Kafka topic can carry it
    with pytest.raises(ApplyManyError, match=r"stopped at signature 7 .*not a topic") as failed:
        apply_many(iter(signatures), countdown=600, app=app)
    assert failed.value.scheduled == 6 and isinstance(failed.value.__cause__, DelayedPublishError)
    assert scheduled_count(app) == 6
    assert all("task_id" not in s.options for s in signatures)  # the caller's signatures are not changed

    unsent = list(failed.value.unsent)
    assert [s.args for s in unsent] == [(6, 6), (7, 7), (8, 8), (9, 9)]
    first = apply_many(unsent[1:2], countdown=600, app=app)
    results = apply_many(unsent[1:], countdown=600, app=app)  # the one just sent is kept, not doubled
    assert scheduled_count(app) == 9 and results[0].id == first[0].id


def test_a_generator_that_raises_part_way_has_what_it_gave_stored_and_counted(overrides, monkeypatch):
    """A source of signatures that fails (a database cursor, say) after 6, in the second chunk of 4:
    the 6 are stored and ``ApplyManyError`` says so, with the source's error as its cause.  The
    signatures read in the chunk it broke were dropped unsent, and its own error said nothing of
    what was scheduled."""
    monkeypatch.setattr(bulk, "CHUNK", 4)
    app = create_app(**overrides)
    add = app.tasks["tasks.demo.add"]

    def source() -> Iterator:
        for i in range(10):
            if i == 6:
                raise ConnectionError("the source went away")
            yield add.s(i, i)

    for results in (True, False):
        with pytest.raises(ApplyManyError, match="stopped at signature 7: reading the signatures raised "
                                                 "ConnectionError: the source went away") as failed:
            apply_many(source(), countdown=600, app=app, results=results)
        assert failed.value.scheduled == 6 and list(failed.value.unsent) == []
        assert isinstance(failed.value.__cause__, ConnectionError)
    assert scheduled_count(app) == 12


def test_a_progress_callback_that_raises_stops_apply_many_with_its_count(overrides, monkeypatch):
    """A ``progress`` callback that raises (a progress bar closed, say) after the first chunk of 4 was
    stored: ``ApplyManyError`` says how many are scheduled and hands back the rest, the callback's
    error as its cause.  Its bare error said nothing of what was scheduled."""
    monkeypatch.setattr(bulk, "CHUNK", 4)
    app = create_app(**overrides)
    signatures = [app.tasks["tasks.demo.add"].s(i, i) for i in range(10)]

    def progress(count: int) -> None:
        raise RuntimeError(f"the bar is gone at {count}")

    with pytest.raises(ApplyManyError, match="stopped after signature 4: the progress callback raised "
                                             "RuntimeError: the bar is gone at 4") as failed:
        apply_many(signatures, countdown=600, app=app, progress=progress)
    assert failed.value.scheduled == 4 and isinstance(failed.value.__cause__, RuntimeError)
    assert scheduled_count(app) == 4
    apply_many(failed.value.unsent, countdown=600, app=app)  # the rest, each once
    assert scheduled_count(app) == 10


def test_the_same_signature_twice_is_two_tasks_as_with_apply_async(overrides):
    app = create_app(**overrides)
    signature = app.tasks["tasks.demo.add"].s(1, 1)
    results = apply_many([signature, signature, signature], countdown=600, app=app)
    assert len({r.id for r in results}) == 3 and scheduled_count(app) == 3


def test_a_store_that_is_down_is_reported_with_nothing_sent(overrides):
    with socket_nobody_listens_on() as port:
        app = create_app(**{**overrides, "delayed_redis_url": f"redis://127.0.0.1:{port}/0",
                            "delayed_redis_cluster": False, "task_publish_retry": False})
        add = app.tasks["tasks.demo.add"]
        # the second goes to the broker, but only once what is batched before it is stored
        with pytest.raises(ApplyManyError, match="stopped at signature 1 ") as failed:
            apply_many([add.s(1, 1).set(countdown=600), add.s(2, 2), add.s(3, 3).set(countdown=600)], app=app)
    assert failed.value.scheduled == 0 and isinstance(failed.value.__cause__, StoreUnavailable)
    assert redis.Redis.from_url(app.conf.broker_url).llen(overrides["task_default_queue"]) == 0


def test_a_store_that_stops_answering_costs_apply_many_one_clock_reading_not_one_per_task(overrides, toxiproxy,
                                                                                          monkeypatch):
    """Each task of a batch asked the store's clock (``TIME``, :meth:`.DelayedStore.on_store_clock`) while
    a silent store could not answer, each waiting out the socket timeout (5 s): a chunk of 1,000 signatures
    waited 1,000 of them before its write failed.  A failed reading is tried again a second later."""
    app = create_app(**{**overrides, "delayed_redis_url": f"redis://{toxiproxy.listen['redis']}/0",
                        "delayed_redis_cluster": False, "task_publish_retry": False})
    store, add, asked = store_of(app), app.tasks["tasks.demo.add"], []
    now_ms = store.now_ms

    def counted() -> int:
        asked.append(time.monotonic())
        return now_ms()

    monkeypatch.setattr(store, "now_ms", counted)
    apply_many([add.s(0, 0)], countdown=600, app=app)  # the layout checked, the skew measured
    time.sleep(SKEW_KEPT_S)
    asked.clear()
    with toxiproxy.toxic(["redis"], "timeout", timeout=0), pytest.raises(ApplyManyError):
        apply_many([add.s(i, i) for i in range(5)], countdown=600, app=app)
    assert len(asked) == 1, f"the store's clock asked {len(asked)} times for 5 tasks"


@contextlib.contextmanager
def socket_nobody_listens_on() -> Iterator[int]:
    """A port bound but not listening: connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_generator_is_read_a_chunk_or_two_ahead_of_what_is_stored_and_results_can_be_left_out(overrides,
                                                                                               monkeypatch):
    monkeypatch.setattr(bulk, "CHUNK", 10)
    app = create_app(**overrides)
    add = app.tasks["tasks.demo.add"]
    read: list[int] = []
    ahead: list[int] = []

    def signatures():
        for i in range(95):
            read.append(i)
            yield add.s(i, i)

    count = apply_many(signatures(), countdown=600, app=app, results=False,
                       progress=lambda stored: ahead.append(len(read) - stored))
    assert count == 95 == scheduled_count(app)
    assert ahead and max(ahead) <= 2 * bulk.CHUNK  # what is held: the chunk written and the one built

    results = apply_many((add.s(i, i) for i in range(25)), countdown=600, app=app)
    assert len(results) == 25 and len(results[3:7]) == 4 and results[-1].id == results.ids[-1]
    assert [r.id for r in results] == results.ids and len(set(results.ids)) == 25
    assert store_of(app).get(results[12].id) is not None and len(results + [results[0]]) == 26


def test_a_client_killed_halfway_leaves_what_it_reported_stored_and_no_task_half_written(overrides):
    """``kill -9`` of an ``apply_many`` client while chunks are written: every task it reported stored
    is stored, and every task the store holds is whole (indexed, with its message, the arguments sent)."""
    app = create_app(**overrides)
    store = store_of(app)
    client = subprocess.Popen([sys.executable, "-m", "tests.integration.bulk_client", "1000000"], cwd=ROOT,
                              env=environment(overrides), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    reported = 0
    try:
        for line in client.stdout:
            if line.startswith("stored "):
                reported, last = int(line.split()[1]), line.split()[2]
                assert last == bulk_client.task_id(reported - 1)
                if reported >= 5 * bulk.CHUNK:  # several chunks acknowledged, more in flight
                    client.send_signal(signal.SIGKILL)
                    break
    finally:
        client.kill()
        rest = client.stdout.read()
        client.wait(30)
    reported = max([reported, *(int(line.split()[1]) for line in rest.splitlines() if line.startswith("stored "))])
    assert client.returncode == -signal.SIGKILL and reported >= 5 * bulk.CHUNK

    entries = [(task_id_of(member), partition) for _, member, partition in store.scan()]
    held = {task_id for task_id, _ in entries}
    messages = sum(store.redis.hlen(store.keys.msgs(p)) for p in range(store.settings.partitions))
    assert len(held) == len(entries) == messages  # each indexed once, with its message
    assert {bulk_client.task_id(i) for i in range(reported)} <= held  # what it reported stored is stored
    index = {bulk_client.task_id(i): i for i in range(len(held) + 4 * bulk.CHUNK)}  # the stored ones and in flight
    for task_id in held:
        envelope = Envelope.decode(store.message(task_id))
        i = index[task_id]
        assert (envelope.headers["argsrepr"], envelope.body.startswith(f"[[{i}, {i}], ".encode())) == (f"({i}, {i})", True)
    print(f"reported {reported}, stored {len(held)} when killed")
