import pytest
from celery import Celery
from kombu import Exchange, Queue

from celery_delayed.envelope import Envelope
from celery_delayed.worker.broker import publish_args
from celery_delayed.worker.once import DRAINED

DUE_MS = 1_796_000_000_123


def envelope(queue: str, headers: dict | None = None, **kw) -> Envelope:
    return Envelope(task_id="abc", queue=queue, headers={"task": "t.add", "id": "abc", "retries": 2, **(headers or {})},
                    body=b"[[1], {}, {}]",
                    content_type="application/json", content_encoding="utf-8",
                    properties={"correlation_id": "abc", "reply_to": "r"}, **kw)


def test_a_drained_message_is_the_stored_one_with_its_due_time_as_eta_sent_to_its_queue_by_name():
    app = Celery("drain-unit", set_as_current=False)
    args = publish_args(app, envelope("reports"), DUE_MS, DUE_MS - 60_000)
    assert args["headers"] == {"task": "t.add", "id": "abc", "retries": 2, "eta": "2026-11-30T00:53:20.123000+00:00",
                               DRAINED: DUE_MS - 60_000}  # when sent: an installed worker runs it only once
    assert args["body"] == b"[[1], {}, {}]"
    # as Celery sends to a direct queue: the default exchange, the queue's name as routing key
    assert (args["exchange"], args["routing_key"], [q.name for q in args["declare"]]) == ("", "reports", ["reports"])
    assert (args["correlation_id"], args["reply_to"], args["delivery_mode"]) == ("abc", "r", 2)  # persistent
    assert "expiration" not in args


def test_a_task_sent_through_another_exchange_goes_straight_to_its_queue_with_the_apps_definition_declared():
    app = Celery("drain-unit", set_as_current=False)
    topic = Queue("bulk", Exchange("campaigns", type="topic", delivery_mode=1), routing_key="bulk.#")
    app.conf.task_queues = [topic]
    args = publish_args(app, envelope("bulk", exchange="campaigns", routing_key="bulk.mail"), DUE_MS, 0)
    assert (args["exchange"], args["routing_key"], args["declare"], args["delivery_mode"]) == ("", "bulk", [topic], 1)


def test_expires_becomes_the_messages_expiration_in_seconds_left_at_the_drain_as_celery_sets_it():
    app = Celery("drain-unit", set_as_current=False)
    stored = envelope("reports", headers={"expires": "2026-11-30T01:00:00+00:00"})  # due 00:53:20.123
    assert publish_args(app, stored, DUE_MS, 1_796_000_000_000 + 3_000)["expiration"] == 400 - 3
    assert publish_args(app, stored, DUE_MS, 1_796_000_000_000 + 700_000)["expiration"] == 0


def test_a_handed_back_copy_runs_within_half_the_done_ttl_and_an_older_one_is_acknowledged_unrun(monkeypatch):
    """A copy a stopping worker handed back is a shortcut: its Kafka copy carries the task.  One a worker
    killed while it held it comes back from the broker an hour later (Redis' visibility timeout), when
    the done record of the Kafka copy that ran (a result ignored) may have expired: it must not run
    again.  Within half of delayed_done_ttl it is admitted as any drained copy; past it, acknowledged
    without running and without asking the store."""
    import time
    from types import SimpleNamespace

    from celery_delayed.worker import drained
    from celery_delayed.worker.once import HANDED_BACK

    admitted, acked, ran = [], [], []

    def admit(claims, copies, backend, key_holder):
        admitted.extend(copy.task_id if hasattr(copy, "task_id") else copy for copy in copies)
        return [SimpleNamespace(admit=drained.Admit.RUN)]

    monkeypatch.setattr(drained, "admit", admit)
    app = SimpleNamespace(amqp=SimpleNamespace(delayed_settings=SimpleNamespace(done_ttl=3600.0),
                                               delayed_store=SimpleNamespace(key_holder=None)), backend=None)
    c = SimpleNamespace(app=app, connection_errors=())
    guard = drained.Guard(c, SimpleNamespace(release=lambda task_id: None), lambda *a, **k: ran.append(a[0]))
    now_ms = int(time.time() * 1000)
    for age_s, task_id in ((60, "young"), (1790, "near"), (1810, "old"), (3700, "restored")):
        message = SimpleNamespace(headers={"id": task_id, "task": "t.add", DRAINED: now_ms - age_s * 1000,
                                           HANDED_BACK: now_ms - age_s * 1000})
        guard(message, None, lambda *a, task_id=task_id: acked.append(task_id), lambda *a: None, None)
    assert [m.headers["id"] for m in ran] == ["young", "near"]
    assert acked == ["old", "restored"]
    assert len(admitted) == 2


@pytest.mark.parametrize("stamp", ["1765000000000", 1.5, True, {"ms": 1}, -1])
def test_a_handed_back_copy_with_a_stamp_that_is_no_time_is_acknowledged_unrun(monkeypatch, stamp):
    """Only a stopping worker writes ``HANDED_BACK`` (an int, ms).  Any other value, from whatever sent it,
    cannot say the copy is young enough to run: it is acknowledged without running and without asking
    the store (its Kafka copy, if it has one, runs the task); nothing raises in the consumer."""
    from types import SimpleNamespace

    from celery_delayed.worker import drained
    from celery_delayed.worker.once import HANDED_BACK

    monkeypatch.setattr(drained, "admit", lambda *a: pytest.fail("a copy with a bad stamp was admitted"))
    app = SimpleNamespace(amqp=SimpleNamespace(delayed_settings=SimpleNamespace(done_ttl=3600.0),
                                               delayed_store=SimpleNamespace(key_holder=None)), backend=None)
    acked: list = []
    guard = drained.Guard(SimpleNamespace(app=app, connection_errors=()), None,
                          lambda *a, **k: pytest.fail("a copy with a bad stamp ran"))
    message = SimpleNamespace(headers={"id": "t1", "task": "t.add", DRAINED: 1, HANDED_BACK: stamp})
    guard(message, None, lambda *a: acked.append("t1"), lambda *a: None, None)
    assert acked == ["t1"]
