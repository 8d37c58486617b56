"""The demo app: plain Celery, plus the one line that enables celery-delayed."""
from __future__ import annotations

from typing import Any

from celery import Celery

import celery_delayed


def create_app(**overrides: Any) -> Celery:
    """The demo app, configured from ``config.celeryconfig`` and ``overrides``."""
    app = Celery("tasks", include=["tasks.chaos", "tasks.demo", "tasks.payments"])
    app.config_from_object("config.celeryconfig")
    app.conf.update(overrides)
    celery_delayed.install(app)
    return app


app = create_app()
