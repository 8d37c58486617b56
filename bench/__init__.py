"""Benchmarks of celery-delayed on the real local servers (``python -m bench.dispatch``)."""
