from celery import Celery

from celery_delayed.drain import publish_args
from celery_delayed.envelope import Envelope


def envelope(queue: str, **kw) -> Envelope:
    return Envelope(task_id="abc", queue=queue, headers={"task": "t.add", "id": "abc", "retries": 2},
                    body=b"[[1], {}, {}]",
                    content_type="application/json", content_encoding="utf-8",
                    properties={"correlation_id": "abc", "reply_to": "r"}, **kw)


def test_a_drained_message_is_the_stored_one_with_its_due_time_as_eta_routed_to_its_queue():
    app = Celery("drain-unit", set_as_current=False)
    args = publish_args(app, envelope("reports"), 1_796_000_000_123)
    assert args["headers"] == {"task": "t.add", "id": "abc", "retries": 2, "eta": "2026-11-30T00:53:20.123000+00:00"}
    assert args["body"] == b"[[1], {}, {}]"
    assert (args["exchange"], args["routing_key"], [q.name for q in args["declare"]]) == ("reports", "reports",
                                                                                          ["reports"])
    assert (args["correlation_id"], args["reply_to"]) == ("abc", "r")


def test_a_drained_message_keeps_the_exchange_and_routing_key_it_was_sent_with():
    app = Celery("drain-unit", set_as_current=False)
    args = publish_args(app, envelope("celery", exchange="ex", routing_key="rk"), 0)
    assert (args["exchange"], args["routing_key"]) == ("ex", "rk")
