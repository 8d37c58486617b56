"""celery-delayed: Celery ETA/countdown tasks kept in Redis until due, then run from Kafka.

Enable it on an existing app with one line::

    import celery_delayed
    celery_delayed.install(app)
"""
from __future__ import annotations

from celery import Celery, signals
from celery.app.amqp import AMQP
from celery.app.control import Control
from celery.utils.imports import symbol_by_name

from celery_delayed import inert, metrics
from celery_delayed.client.bulk import ApplyManyError, apply_many
from celery_delayed.client.intercept import DelayedAMQP, DelayedPublishError
from celery_delayed.client.schedules import Schedules, UpsertManyError
from celery_delayed.envelope import Envelope, EnvelopeError
from celery_delayed.settings import ConfigurationError, Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from celery_delayed.store.outcomes import (LayoutMismatch, StoreNotDurable, StoreRefused, StoreUnavailable,
    TaskInFlight, TaskNotScheduled)
from celery_delayed.store.revoke import DelayedControl
from celery_delayed.worker.consumer import KafkaConsumerStep
from celery_delayed.worker.failures import park_failures
from celery_delayed.worker.once import remember_finished

__version__ = "0.1.0"

__all__ = ["install", "store_of", "apply_many", "ApplyManyError", "Settings", "ConfigurationError", "DelayedStore",
           "StoreUnavailable", "StoreRefused", "StoreNotDurable", "LayoutMismatch", "TaskNotScheduled", "TaskInFlight",
           "DelayedControl", "DelayedPublishError", "DeadLetters", "DeadLetter", "Envelope", "EnvelopeError",
           "Schedules", "UpsertManyError", "__version__"]


def install(app: Celery) -> Celery:
    """Enable celery-delayed on ``app``: ETA messages go to the store, workers read Kafka.

    Uses Celery's documented extension points: the app's ``amqp_cls`` and
    ``control_cls`` (wrapped, so custom classes keep working; the control class
    makes revoke durable, see :mod:`.revoke`) and a consumer bootstep.  Safe to
    call more than once.
    """
    _extend_cls(app, "amqp", DelayedAMQP, AMQP)
    _extend_cls(app, "control", DelayedControl, Control)
    if KafkaConsumerStep not in app.steps["consumer"]:
        app.steps["consumer"].add(KafkaConsumerStep)
    metrics.register_app(app)
    if not getattr(app, "_delayed_signals_connected", False):
        park_failures(app)
        remember_finished(app)
        app._delayed_signals_connected = True
    for setup in (signals.after_setup_logger, signals.after_setup_task_logger):
        setup.connect(inert.guard_handlers, weak=False, dispatch_uid="celery_delayed.inert")
    return app


def _extend_cls(app: Celery, name: str, mixin: type, stock: type) -> None:
    """Make ``app.<name>_cls`` a subclass of ``mixin`` (``mixin`` itself over Celery's ``stock`` class)."""
    base = symbol_by_name(getattr(app, f"{name}_cls"))
    if not issubclass(base, mixin):
        setattr(app, f"{name}_cls", mixin if base is stock else type(f"Delayed{base.__name__}", (mixin, base), {}))
        app.__dict__.pop(name, None)  # rebuilt from the class on next use


def store_of(app: Celery) -> DelayedStore:
    """The delayed store of an app on which :func:`install` was called."""
    amqp = app.amqp
    if not isinstance(amqp, DelayedAMQP):
        raise RuntimeError("celery_delayed.install(app) was not called on this app")
    return amqp.delayed_store
