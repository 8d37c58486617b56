"""Recurring schedules (celery beat without a single point of failure): a definition per schedule in
the store, partitioned as tasks are, and one pending occurrence, an ordinary scheduled task whose id
derives from (schedule id, nominal time); the poller writes each occurrence's successor before it
dispatches it.  ``rules`` (when), ``occurrences`` (their ids and messages), ``definitions`` (the store).

May import: the store and the shared modules (settings, envelope); never Kafka, the client, the poller
or the worker (the poller and the client import it).
"""
