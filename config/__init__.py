"""Configuration of the demo project (Celery settings, service configs)."""
