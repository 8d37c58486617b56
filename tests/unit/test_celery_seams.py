"""The Celery internals celery-delayed relies on beyond its documented seams, pinned: an
upgrade that moves one fails here, by name, rather than in production."""
import inspect

import pytest

from celery.app.amqp import AMQP
from celery.worker import state as worker_state
from celery.worker.consumer.consumer import Consumer
from celery.worker.request import Request

from celery_delayed.client.intercept import DelayedAMQP
from tasks import create_app


def test_every_task_message_is_sent_by_the_sender_amqp_creates():
    """client.py wraps ``AMQP._create_task_sender`` (private): ``send_task_message`` must be what it returns."""
    assert callable(getattr(AMQP, "_create_task_sender", None))
    app = create_app()
    assert isinstance(app.amqp, DelayedAMQP)
    assert app.amqp.send_task_message.__qualname__.startswith("DelayedAMQP._create_task_sender")


def test_the_worker_state_and_consumer_attributes_the_feed_reads_exist():
    """consumer.py reads ``worker.state.active_requests`` and a consumer's ``strategies``, ``qos``,
    ``hub``, ``timer``, ``pool`` (a green one says ``is_green``) and ``on_task_message`` (set up by
    Celery's own bootsteps)."""
    assert {request.id for request in worker_state.active_requests} == set()  # a set-like of requests
    source = inspect.getsource(Consumer)
    for name in ("strategies", "qos", "hub", "timer", "pool", "on_task_message"):
        assert f"self.{name}" in source, name


def test_the_green_pools_say_they_are_green():
    """consumer.py tells a green worker (no event loop; its threads are greenlets) by its pool's ``is_green``."""
    pytest.importorskip("gevent", reason="the green pools are a dev extra: scripts/test has them, test-pythons not")
    pytest.importorskip("eventlet", reason="the green pools are a dev extra")
    from celery.concurrency import eventlet, gevent, prefork
    assert gevent.TaskPool.is_green and eventlet.TaskPool.is_green and not prefork.TaskPool.is_green


@pytest.mark.parametrize("name", ["gevent", "eventlet"])
def test_a_green_pool_tells_its_free_slots(name):
    """gate.py starts a green pool's task only while it has a free slot (``free_slots``: the pool
    Celery's TaskPool keeps as ``_pool``); a slot taken by a running greenlet is not free."""
    pytest.importorskip(name, reason="the green pools are a dev extra: scripts/test has them, test-pythons not")
    from celery.concurrency import get_implementation
    from celery_delayed.worker.gate import free_slots
    pool = get_implementation(name)(limit=2)
    pool.start()
    try:
        assert free_slots(pool) == 2
        pool._pool.spawn(lambda: None)  # not run until this greenlet yields: its slot is taken meanwhile
        assert free_slots(pool) == 1
    finally:
        pool.stop()


@pytest.mark.parametrize("name", ["gevent", "eventlet"])
def test_a_green_task_whose_greenlet_is_killed_ends_as_a_lost_worker_s(name):
    """gate.lost_when_killed replaces the green pools' ``_make_killable_target``, by which Celery reports
    a task whose greenlet it killed (its cancel) a success: with it, a failure by WorkerLostError, unless
    the task was revoked (``revoke(terminate=True)``: killed on purpose, Celery's report stands)."""
    pytest.importorskip(name, reason="the green pools are a dev extra: scripts/test has them, test-pythons not")
    from celery.concurrency import get_implementation
    from celery.exceptions import WorkerLostError
    from greenlet import GreenletExit
    from celery_delayed.worker.gate import lost_when_killed

    def killed(*_):
        raise GreenletExit

    pool_class = get_implementation(name)
    assert pool_class._make_killable_target(killed)() == (False, None, None)  # Celery's: a success
    ours = type("Ours", (pool_class,), {})  # Celery's own class left as it is for the other tests
    lost_when_killed(ours.__new__(ours))
    failed, info, _ = ours._make_killable_target(killed)()
    assert failed and isinstance(info.exception.exc, WorkerLostError)  # as Request.on_success unwraps it
    assert ours._make_killable_target(lambda: 5)() == 5
    # revoke(terminate=True): Celery's own report; the task id is the trace's second argument
    assert "args=(self._type, task_id, " in inspect.getsource(Request.execute_using_pool)
    worker_state.revoked.add("revoked-id")
    try:
        assert ours._make_killable_target(killed)("task", "revoked-id") == (False, None, None)
        assert ours._make_killable_target(killed)("task", "other-id")[0]
    finally:
        worker_state.revoked.discard("revoked-id")


def test_every_request_reaches_the_pool_through_the_consumer_s_on_task_request():
    """consumer.py puts a green worker's gate (gate.py) in ``Consumer.on_task_request`` before Celery's
    Tasks step builds the strategies: the default strategy takes it when made, and the ETA timer
    (``apply_eta_task``) and the rate limits call it on the consumer."""
    from celery.worker import strategy
    from celery.worker.consumer.tasks import Tasks

    assert "handle = consumer.on_task_request" in inspect.getsource(strategy.default)
    assert "apply_eta_task = consumer.apply_eta_task" in inspect.getsource(strategy.default)
    assert "self.on_task_request(task)" in inspect.getsource(Consumer.apply_eta_task)
    assert "self.on_task_request(request)" in inspect.getsource(Consumer._limit_move_to_pool)
    assert "c.update_strategies()" in inspect.getsource(Tasks.start)


def test_a_request_dropped_by_a_consumer_restart_can_be_told_from_one_given_to_the_pool():
    """Intake._fate reads ``Request._apply_result`` (private: set once the request is
    given to the pool, by the request class and by the one ``create_request_cls`` makes for each
    task), and relies on Celery >= 5.7's ``Consumer.on_close`` cancelling the ETA timer entries
    of the requests it drops and removing every dropped one from ``requests``."""
    from celery.worker.request import create_request_cls

    from celery_delayed.worker.intake import _DROPS_ARE_FORGOTTEN

    assert Request._apply_result is None
    assert "self._apply_result = " in inspect.getsource(Request.execute_using_pool)
    assert "self._apply_result = " in inspect.getsource(create_request_cls)
    assert _DROPS_ARE_FORGOTTEN  # the tested Celery (constraints.txt) has it
    on_close = inspect.getsource(Consumer.on_close)
    assert "self.timer.cancel(entry)" in on_close and "requests.pop(r.id, None)" in on_close
    # Intake._forget_request drops a request on_close missed as on_close drops the others: its entry
    assert Request._eta_timer_entry is None and "entry = r._eta_timer_entry" in on_close


def test_a_job_the_pools_flush_dropped_can_be_told_written_and_put_back_in_its_books():
    """intake._fate and _back_in_pool read billiard's ApplyResult (private): ``_write_to``, set by
    Celery's AsynPool once it starts writing the job to a child; ``_accepted``; and the pool's books,
    ``_cache[_job]``, which ``discard`` (Celery's flush) drops the job from."""
    from billiard.pool import ApplyResult
    from celery.concurrency import asynpool

    books: dict = {}
    job = ApplyResult(books, callback=None)
    assert books == {job._job: job} and job._write_to is None and job._accepted is False
    job.discard()
    assert books == {}
    source = inspect.getsource(asynpool)
    assert "job._write_to = proc" in source and "job.discard()" in inspect.getsource(asynpool.AsynPool.flush)


def test_a_failure_after_the_body_carries_a_traceback_through_a_step_failures_py_knows():
    """failures.py tells a failure after the body from ``einfo.traceback`` of ``task_failure``: it
    must pass through a step of ``AFTER_BODY`` (here ``mark_as_done``, and ``handle_retry``), and a
    failure in the body must not."""
    from celery import Celery, signals
    from celery.app.trace import build_tracer

    from celery_delayed.worker.failures import after_body

    app = Celery("seams", backend="cache+memory://", set_as_current=False)
    seen: list[bool] = []

    @app.task(name="seams.ok")
    def ok():
        return 1

    @app.task(name="seams.boom")
    def boom():
        raise ValueError("in the body")

    @app.task(name="seams.again", bind=True)
    def again(self):
        raise self.retry(countdown=60, exc=ValueError("retry"))

    def mark_as_done(*args, **kwargs):  # as a backend's own methods, down
        raise ConnectionError("the result backend is down")

    app.backend.mark_as_done = app.backend.mark_as_retry = mark_as_done
    app.amqp.send_task_message = lambda *args, **kwargs: None  # the retry's message "sent"

    def failure(einfo=None, **_):
        seen.append(after_body(einfo.traceback))

    signals.task_failure.connect(failure, weak=False)
    try:
        for task, expected in ((ok, [True]), (boom, [False]), (again, [True])):
            seen.clear()
            build_tracer(task.name, task, app=app, eager=False)("id", (), {}, {"id": "id"})
            assert seen == expected, task.name
    finally:
        signals.task_failure.disconnect(failure)


def test_what_a_template_reads_of_celery_is_where_it_reads_it():
    """client/template.py reads ``amqp.router.routes`` (a ``MapRoute`` sees only the task's name),
    ``amqp.argsrepr_maxsize``/``kwargsrepr_maxsize``, a task's ``typing``/``__header__`` (the argument
    check of ``apply_async``), and the receivers of the publish signals."""
    from celery import signals
    from celery.app.routes import MapRoute

    app = create_app(task_routes={"tasks.demo.*": {"queue": "q"}})
    assert [type(route) for route in app.amqp.router.routes] == [MapRoute]
    assert isinstance(app.amqp.argsrepr_maxsize, int) and isinstance(app.amqp.kwargsrepr_maxsize, int)
    add = app.tasks["tasks.demo.add"]
    assert add.typing
    with pytest.raises(TypeError):
        add.__header__(1, 2, 3)
    for signal in (signals.before_task_publish, signals.after_task_publish, signals.task_sent):
        assert isinstance(signal.receivers, list)


def test_a_templates_times_are_as_task_v2s():
    """Shapes.times writes ``eta``/``expires`` as ``as_task_v2`` does, without its per-call zone lookups:
    now in UTC plus the seconds, in the app's zone."""
    from datetime import datetime, timedelta, timezone

    for zone in ("UTC", "Europe/Paris", "America/New_York"):
        app = create_app(timezone=zone)
        now = datetime(2026, 10, 25, 0, 30, 15, 123456, tzinfo=timezone.utc)  # a DST change in Paris
        for seconds in (1.5, 3600, 7200.25, 86_400 * 40):
            message = app.amqp.as_task_v2("id", "tasks.demo.add", countdown=seconds, expires=seconds * 2,
                                          now=now.astimezone(app.timezone))
            ours = (now + timedelta(seconds=seconds)).astimezone(app.timezone)
            assert message.headers["eta"] == ours.isoformat(), (zone, seconds)
            assert message.headers["expires"] == (now + timedelta(seconds=seconds * 2)).astimezone(
                app.timezone).isoformat()


def test_kombus_json_serializer_is_its_json_encoder():
    """client/template.py encodes JSON bodies with one ``kombu.utils.json.JSONEncoder`` (kombu's
    ``dumps`` makes one per call): the same bytes as kombu's registered serializer."""
    import uuid
    from datetime import datetime
    from decimal import Decimal

    from kombu.serialization import dumps

    from celery_delayed.envelope import json_encoder

    encode = json_encoder()
    assert encode is not None
    for body in [((1, "two"), {"k": [None, 1.5]}, {"callbacks": None}),
                 ((datetime(2026, 1, 2, 3, 4, 5), uuid.UUID(int=5), Decimal("1.5"), "naïve ☃"), {}, {})]:
        assert encode(body) == dumps(body, serializer="json")[2]
        assert f"[{encode(body[0])}, {encode(body[1])}, {encode(body[2])}]" == encode(body)  # as spliced
