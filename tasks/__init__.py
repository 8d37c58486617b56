"""A small demo Celery project that uses celery-delayed (``celery -A tasks ...``)."""
from . import chaos, demo, payments  # noqa: F401  (register the shared tasks on every app)
from .celery import app, create_app

__all__ = ["app", "chaos", "create_app", "demo", "payments"]
