"""Messages from a template (``client/template.py``): what ``apply_many`` stores for a task made from its
shape's template is, field by field, what the per-task path (``apply_async``) stores for the same call."""
from __future__ import annotations

import random
import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, signals
from celery.result import AsyncResult
from celery.utils.time import maybe_iso8601
from kombu.compression import decompress
from kombu.serialization import loads

from celery_delayed import ApplyManyError, DelayedPublishError, apply_many, store_of
from celery_delayed.client import template
from celery_delayed.envelope import Envelope, deflate, inflate
from tasks import create_app

from .support import wait_for
from .test_bulk import SentEvents

pytestmark = pytest.mark.cluster_too

ACCEPT = {"application/json", "application/x-python-serialize", "application/x-msgpack"}
#: How far apart two calls' "now" may be (their countdowns and relative expiries are counted from it).
CALLS_APART_MS = 120_000
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def app_with_any_task(overrides: dict) -> Celery:
    app = create_app(**overrides)

    @app.task(name="tests.template.anything", shared=False)
    def anything(*args: Any, **kwargs: Any) -> None:
        """Takes any arguments."""

    return app


def varied_signatures(app: Celery, count: int, seed: int) -> list:
    """``count`` signatures over a few dozen shapes (options, links, priorities, headers, expiries,
    serializers, compression, queues), each shape with varied arguments, and a few chains."""
    rng = random.Random(seed)
    anything, add = app.tasks["tests.template.anything"], app.tasks["tasks.demo.add"]
    queue = app.conf.task_default_queue
    soon = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=2)
    pools: dict[str, list[Any]] = {
        "priority": [None, 0, 3, 9], "headers": [None, {"tenant": "t1"}, {"tenant": "t2", "n": [1, 2]}],
        "expires": [None, 172_800.0, 86_400 * 3, soon + timedelta(days=2)],
        "link": [None, add.si(1, 2), [add.si(3, 4), anything.s("x").set(queue=f"{queue}-links")]],
        "link_error": [None, anything.si("failed")], "serializer": ["json", "pickle", "msgpack"],
        "compression": [None, "zlib", "bzip2"], "queue": [None, f"{queue}-other"], "shadow": [None, "shown-as"],
        "time_limit": [None, 30], "soft_time_limit": [None, 20], "ignore_result": [None, True],
        "argsrepr": [None, "(hidden)"], "retries": [None],
    }
    shapes = [{k: v for k, v in ((k, rng.choice(vs)) for k, vs in pools.items()) if v is not None}
              for _ in range(60)]
    signatures = []
    for i in range(count):
        options = dict(rng.choice(shapes))
        if options.get("serializer") == "msgpack":  # msgpack has no tuples nor datetimes
            options.pop("argsrepr", None)
        if rng.random() < 0.02:
            signatures.append((add.s(i, i) | add.s(1)).set(countdown=3600))  # a canvas: per task in both
            continue
        timing = {"countdown": 3600 + rng.random() * 86_400} if rng.random() < 0.7 else \
            {"eta": soon + timedelta(seconds=rng.randrange(86_400), microseconds=rng.randrange(10**6))}
        signatures.append(anything.s(*arguments(rng, options.get("serializer"))[0],
                                     **arguments(rng, options.get("serializer"))[1]).set(**timing, **options))
    return signatures


def arguments(rng: random.Random, serializer: str | None) -> tuple[tuple, dict]:
    """Arguments of the kinds campaigns send: numbers, strings (quotes, unicode, long), None, lists, maps."""
    values = [rng.randrange(-10**12, 10**12), rng.random() * 1000, True, None, "plain", "it's \"quoted\"",
              "naïve ☃", "x" * rng.choice((10, 63, 64, 200, 1500)), [1, "two", {"three": 3}], {"k": [None, 1.5]},
              "line\nbreak", rng.randrange(100)]
    args = tuple(rng.choice(values) for _ in range(rng.randrange(4)))
    kwargs = {rng.choice(("a", "b", "user_id", "größe")): rng.choice(values) for _ in range(rng.randrange(3))}
    return args, kwargs


def comparable(envelope: Envelope) -> str:
    """What a worker receives of a stored task (headers, properties, decoded body, routing), every
    task id in it (its own, a chain's next ones) written ``ID``.  Not compared here: ``expires``
    (per call when relative; see :func:`close`)."""
    headers = {k: v for k, v in envelope.headers.items() if k != "expires"}
    body = decompress(envelope.body, envelope.headers["compression"]) if envelope.headers.get("compression") \
        else envelope.body
    return UUID.sub("ID", repr({
        "headers": headers, "properties": envelope.properties, "queue": envelope.queue,
        "body": loads(body, envelope.content_type, envelope.content_encoding, accept=ACCEPT),
        "content": (envelope.content_type, envelope.content_encoding), "route": (envelope.exchange,
                                                                                  envelope.routing_key)}))


def first(result: AsyncResult) -> AsyncResult:
    """The first task of a chain's result (the one stored), or the result itself."""
    while result.parent is not None:
        result = result.parent
    return result


def close(a: str | None, b: str | None) -> bool:
    """Two ``expires`` headers naming the same time, or times two calls' "now" apart (a relative expiry)."""
    if a is None or b is None:
        return a == b
    return abs((maybe_iso8601(a) - maybe_iso8601(b)).total_seconds() * 1000) < CALLS_APART_MS


def test_a_task_made_from_a_template_is_stored_as_apply_async_stores_it(overrides):
    app = app_with_any_task(overrides)
    signatures = varied_signatures(app, 3000, seed=44)
    make = template.Template.make
    made_ids: set[str] = set()

    def counted_make(self, task_id, *args):
        result = make(self, task_id, *args)
        if result is not None:
            made_ids.add(task_id)
        return result

    ids_per_task = [str(uuid.uuid4()) for _ in signatures]
    ids_template = [str(uuid.uuid4()) for _ in signatures]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(template.Template, "make", counted_make)
        per_task = apply_many([s.clone().set(task_id=i) for s, i in zip(signatures, ids_per_task)], app=app,
                              per_task=True)
        assert not made_ids
        made = apply_many([s.clone().set(task_id=i) for s, i in zip(signatures, ids_template)], app=app)
    store = store_of(app)
    compared = 0
    for a, b, signature in zip(per_task, made, signatures):
        a, b = first(a), first(b)
        one, other = Envelope.decode(store.message(a.id)), Envelope.decode(store.message(b.id))
        assert comparable(other) == comparable(one), signature
        stored = store.message(b.id)  # deflated, as the per-task path deflates its frame:
        assert stored == deflate(inflate(stored), app.amqp.delayed_settings.compress_min_bytes), signature
        assert close(one.headers.get("expires"), other.headers.get("expires")), signature
        due_one, due_other = store.get(a.id)["due_ms"], store.get(b.id)["due_ms"]
        if "eta" in signature.options:
            assert due_one == due_other, signature
        else:
            assert abs(due_one - due_other) < CALLS_APART_MS, signature
        assert (a.ignored, type(a)) == (b.ignored, type(b))
        compared += b.id in made_ids
    assert compared > 2500, compared  # most were made from a template (the first of a shape is not)
    print(f"{compared} tasks made from a template equal their apply_async's")


def test_a_receiver_before_publish_sends_each_by_apply_async_and_its_change_is_kept(overrides):
    app = app_with_any_task(overrides)
    anything = app.tasks["tests.template.anything"]

    def stamp(headers: dict, **_: Any) -> None:
        headers["traceparent"] = f"00-{uuid.uuid4().hex}-01"

    signals.before_task_publish.connect(stamp, weak=False)
    try:
        results = apply_many([anything.s(i).set(countdown=600) for i in range(5)], app=app)
    finally:
        signals.before_task_publish.disconnect(stamp)
    parents = {Envelope.decode(store_of(app).message(r.id)).headers["traceparent"] for r in results}
    assert len(parents) == 5


def test_after_publish_receivers_see_every_task_with_its_headers(overrides):
    app = app_with_any_task(overrides)
    anything = app.tasks["tests.template.anything"]
    seen: list[tuple[dict, tuple]] = []

    def record(headers: dict, body: tuple, **_: Any) -> None:
        seen.append((dict(headers), body))

    signals.after_task_publish.connect(record, weak=False)
    try:
        results = apply_many([anything.s(i, k=str(i)).set(countdown=600) for i in range(5)], app=app,
                             per_task=True)
        results += apply_many([anything.s(i, k=str(i)).set(countdown=600) for i in range(5)], app=app)
    finally:
        signals.after_task_publish.disconnect(record)
    assert [h["id"] for h, _ in seen] == [r.id for r in results]
    per_task, made = seen[:5], seen[5:]
    for (one, one_body), (other, other_body) in zip(per_task, made):
        assert {k for k in one if one[k] != other[k]} == {"id", "root_id", "eta"}
        assert one_body == other_body


def test_a_task_made_from_a_template_is_seen_sent_as_apply_async_sends_its_event(overrides):
    """Its task-sent event (JSON made from its template's) carries what the per-task path's event of
    the same call carries: the same fields, the same values but for its id, times and clock."""
    app = app_with_any_task(overrides)
    anything = app.tasks["tests.template.anything"]
    events = SentEvents(app)
    events.start()
    events.listening()
    expires = datetime.now(timezone.utc) + timedelta(days=3)
    calls = [((i, "it's ☃"), {"k": [i, None]}) for i in range(4)]
    results = [apply_many([anything.s(*args, **kwargs).set(countdown=600, expires=expires, priority=3)
                           for args, kwargs in calls], app=app, per_task=per_task) for per_task in (True, False)]
    ids = [r.id for rs in results for r in rs]
    wait_for(lambda: set(events.events) >= set(ids), 30, "a task-sent event of every task")
    events.stop()

    def comparable(task_id: str) -> dict:
        event = events.events[task_id]
        return {k: v for k, v in event.items() if k not in ("uuid", "root_id", "eta", "clock", "timestamp",
                                                              "local_received")}
    for one, other in zip(*results):
        assert comparable(other.id) == comparable(one.id)
        assert (events.events[other.id]["root_id"], events.events[other.id]["eta"] is not None) == (other.id, True)
    assert set(comparable(ids[0])) >= {"args", "kwargs", "expires", "queue", "name", "hostname", "pid", "type"}


def test_a_task_too_big_for_its_template_is_refused_as_apply_async_refuses_it(overrides):
    app = app_with_any_task({**overrides, "delayed_max_message_bytes": 2000})
    anything = app.tasks["tests.template.anything"]
    signatures = [anything.s("x" * 10).set(countdown=600) for _ in range(3)] + [anything.s("x" * 3000).set(
        countdown=600)]
    for per_task in (True, False):
        with pytest.raises(ApplyManyError, match="over delayed_max_message_bytes=2000") as failed:
            apply_many(signatures, app=app, per_task=per_task)
        assert failed.value.scheduled == 3 and isinstance(failed.value.__cause__, DelayedPublishError)
