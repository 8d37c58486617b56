"""pytest fixtures for a project that uses celery-delayed with Celery's own pytest plugin.

Enable it beside Celery's, in the project's ``conftest.py``::

    pytest_plugins = ("celery.contrib.pytest", "celery_delayed.testing")

Celery's fixtures build a new app per test (``celery_app``); ``delayed_app``
installs celery-delayed on it with Redis keys, etcd keys, Kafka topics and a
consumer group of its own (prefixes unique to the test), so tests never see each
other's tasks, and removes them all after the test.  The servers are the app's
own ``delayed_*`` settings (from ``celery_config``), else the local defaults.

- ``delayed_app``: ``celery_app`` with celery-delayed installed.
- ``delayed_poller``: a poller of that app, running in a thread during the test.
- ``delayed_worker``: Celery's ``celery_worker`` (fed from Kafka) with that poller,
  so ``task.apply_async(countdown=2).get()`` runs the way it does in production.
  Like any celery-delayed worker it needs a broker with an event loop (Redis, AMQP).

An app made any other way (an app factory, ``TestApp`` by hand) takes
:func:`installed`, a context manager doing what ``delayed_app`` does.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_delayed.poller.loop import Poller
from celery_delayed.sandbox import installed, poller_of, running

__all__ = ["delayed_app", "delayed_poller", "delayed_worker"]


@pytest.fixture
def delayed_app(celery_app: Celery) -> Iterator[Celery]:
    """Celery's ``celery_app`` with celery-delayed installed on prefixes of this test's own."""
    with installed(celery_app) as app:
        yield app


@pytest.fixture
def delayed_poller(delayed_app: Celery) -> Iterator[Poller]:
    """A poller of ``delayed_app`` running in a thread for the test."""
    poller = poller_of(delayed_app)
    with running(poller):
        yield poller


@pytest.fixture
def delayed_worker(delayed_app: Celery, delayed_poller: Poller, celery_worker):
    """Celery's ``celery_worker`` for ``delayed_app`` (it reads Kafka), and the app's poller."""
    return celery_worker
