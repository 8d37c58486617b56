"""Celery settings of the demo project, defaults for the local services.

Any setting can be overridden from the environment: ``DELAYED_FOO=bar`` sets
``delayed_foo`` and ``CELERY_FOO=bar`` sets ``foo`` (e.g. ``CELERY_BROKER_URL``),
which is how docker/ and the tests configure the same project; a value starting
with ``[`` or ``{`` is read as a Python literal (a list or dict setting),
``True`` / ``False`` as booleans, and digits as an int.
"""
import ast
import os

# The servers of scripts/services, on the ports it was given (CD_*_PORT, as there).
_redis = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}"
broker_url = f"{_redis}/1"
# celery-delayed's Redis result backend: the first terminal result of a task id is final
result_backend = f"celery_delayed.backend:RedisBackend+{_redis}/2"
result_extended = True          # results record the worker that ran them
result_backend_always_retry = True  # a result write retries while Redis restarts, not failing the task
task_acks_late = True           # a task's Kafka offset settles when it ends...
task_reject_on_worker_lost = True  # ...and a killed pool child's task runs again
worker_prefetch_multiplier = 4
worker_send_task_events = True  # Flower
task_send_sent_event = True
broker_connection_retry_on_startup = True

# celery-delayed (see celery_delayed.settings for every setting and its default)
delayed_redis_url = f"{_redis}/0"
delayed_kafka_servers = f"127.0.0.1:{os.environ.get('CD_KAFKA_PORT', '9092')}"
delayed_etcd_endpoints = f"http://127.0.0.1:{os.environ.get('CD_ETCD_PORT', '2379')}"
delayed_partitions = 8


def _setting(value: str):
    """An environment value as a setting: a list or dict when written as a Python literal
    (e.g. ``CELERY_ACCEPT_CONTENT="['json', 'pickle']"``), a bool for ``True`` or ``False``, an
    int for digits (``CELERY_WORKER_ETA_TASK_LIMIT=1000``: Celery does not convert it), else the
    string itself."""
    literal = value[:1] in ("[", "{") or value in ("True", "False") or value.isdigit()
    return ast.literal_eval(value) if literal else value


for _name, _value in os.environ.items():
    if _name.startswith("DELAYED_"):
        globals()[_name.lower()] = _setting(_value)
    elif _name.startswith("CELERY_") and _name not in ("CELERY_CONFIG_MODULE",):
        globals()[_name[len("CELERY_"):].lower()] = _setting(_value)
