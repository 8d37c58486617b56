"""The worker hop: a ``celery worker`` bootstep reads Kafka, runs each task once per task_id
(run claims), and settles, retries or dead-letters it through the store.

May import: the store, Kafka and the shared modules; never the client or the poller.
"""
