"""The client hop: every ETA path of a Celery app (``apply_async``, ``send_task``, ``retry``, canvas)
writes its task to the store instead of the broker; ``apply_many`` schedules in bulk; ``Schedules`` keeps
recurring schedules of signatures.

May import: recurring, the store, and the shared modules (settings, envelope); never Kafka, the poller or
the worker.
"""
