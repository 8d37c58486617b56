"""celery-delayed: Celery ETA/countdown tasks kept in Redis until due, then run from Kafka.

Enable it on an existing app with one line::

    import celery_delayed
    celery_delayed.install(app)
"""
from __future__ import annotations

from celery import Celery
from celery.app.amqp import AMQP
from celery.utils.imports import symbol_by_name

from . import metrics
from .client import DelayedAMQP, DelayedPublishError
from .consumer import KafkaConsumerStep
from .dlq import DeadLetter, DeadLetters
from .envelope import Envelope, EnvelopeError
from .failures import park_failures
from .settings import ConfigurationError, Settings
from .store import DelayedStore, StoreUnavailable

__version__ = "0.1.0"

__all__ = ["install", "store_of", "Settings", "ConfigurationError", "DelayedStore", "StoreUnavailable",
           "DelayedPublishError", "DeadLetters", "DeadLetter", "Envelope", "EnvelopeError", "__version__"]


def install(app: Celery) -> Celery:
    """Enable celery-delayed on ``app``: ETA messages go to the store, workers read Kafka.

    Uses Celery's documented extension points: the app's ``amqp_cls`` (wrapped,
    so a custom AMQP class keeps working) and a consumer bootstep.  Safe to call
    more than once.
    """
    base = symbol_by_name(app.amqp_cls)
    if not issubclass(base, DelayedAMQP):
        app.amqp_cls = DelayedAMQP if base is AMQP else type(f"Delayed{base.__name__}", (DelayedAMQP, base), {})
        app.__dict__.pop("amqp", None)  # rebuilt from amqp_cls on next use
    if KafkaConsumerStep not in app.steps["consumer"]:
        app.steps["consumer"].add(KafkaConsumerStep)
    metrics.register_app(app)
    if not getattr(app, "_delayed_failures_parked", False):
        park_failures(app)
        app._delayed_failures_parked = True
    return app


def store_of(app: Celery) -> DelayedStore:
    """The delayed store of an app on which :func:`install` was called."""
    amqp = app.amqp
    if not isinstance(amqp, DelayedAMQP):
        raise RuntimeError("celery_delayed.install(app) was not called on this app")
    return amqp.delayed_store
