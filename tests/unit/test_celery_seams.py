"""The Celery internals celery-delayed relies on beyond its documented seams, pinned: an
upgrade that moves one fails here, by name, rather than in production."""
import inspect

from celery.app.amqp import AMQP
from celery.worker import state as worker_state
from celery.worker.consumer.consumer import Consumer

from celery_delayed.client import DelayedAMQP
from tasks import create_app


def test_every_task_message_is_sent_by_the_sender_amqp_creates():
    """client.py wraps ``AMQP._create_task_sender`` (private): ``send_task_message`` must be what it returns."""
    assert callable(getattr(AMQP, "_create_task_sender", None))
    app = create_app()
    assert isinstance(app.amqp, DelayedAMQP)
    assert app.amqp.send_task_message.__qualname__.startswith("DelayedAMQP._create_task_sender")


def test_the_worker_state_and_consumer_attributes_the_feed_reads_exist():
    """consumer.py reads ``worker.state.active_requests`` and a consumer's ``strategies``, ``qos``,
    ``hub`` and ``on_task_message`` (set up by Celery's own bootsteps)."""
    assert {request.id for request in worker_state.active_requests} == set()  # a set-like of requests
    source = inspect.getsource(Consumer)
    for name in ("strategies", "qos", "hub", "on_task_message"):
        assert f"self.{name}" in source, name


def test_a_result_that_cannot_be_stored_is_signalled_as_an_internal_error_through_mark_as_done():
    """failures.py tells a failure after the body by ``task_internal_error`` (sent before
    ``task_failure``, in the same thread) and a traceback through a step of ``AFTER_BODY``;
    a failure in the body must not look like one."""
    from celery import Celery, signals
    from celery.app.trace import build_tracer

    from celery_delayed.failures import after_body

    app = Celery("seams", backend="cache+memory://", set_as_current=False)
    seen: list[tuple[str, bool]] = []

    @app.task(name="seams.ok")
    def ok():
        return 1

    @app.task(name="seams.boom")
    def boom():
        raise ValueError("in the body")

    def mark_as_done(*args, **kwargs):  # as a backend's own method, down
        raise ConnectionError("the result backend is down")

    app.backend.mark_as_done = mark_as_done

    def internal(traceback=None, **_):
        seen.append(("internal", after_body(traceback)))

    def failure(**_):
        seen.append(("failure", False))

    signals.task_internal_error.connect(internal, weak=False)
    signals.task_failure.connect(failure, weak=False)
    try:
        build_tracer(ok.name, ok, app=app, eager=False)("id-1", (), {}, {"id": "id-1"})
        assert seen == [("internal", True), ("failure", False)]
        seen.clear()
        build_tracer(boom.name, boom, app=app, eager=False)("id-2", (), {}, {"id": "id-2"})
        assert seen == [("failure", False)]
    finally:
        signals.task_internal_error.disconnect(internal)
        signals.task_failure.disconnect(failure)
