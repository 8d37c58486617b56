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
