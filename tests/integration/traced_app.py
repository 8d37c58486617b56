"""The demo app with OpenTelemetry's Celery instrumentation in its worker processes, as a project
that traces its tasks runs it (``celery -A tests.integration.traced_app worker``): its task
``traced.trace_id`` answers the id of the trace it runs in and those its span links to, for
``test_tracing``; :func:`link_not_parent` and :func:`link_origin` are the README's recipe for a
delayed run in a trace of its own, linked to its caller's."""
from __future__ import annotations

from celery.signals import task_prerun, worker_process_init
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider

from tasks import create_app

app = create_app()


@worker_process_init.connect(weak=False)
def _instrument(**_: object) -> None:
    """What the instrumentation's documentation says to do in a prefork worker's children."""
    trace.set_tracer_provider(TracerProvider())
    CeleryInstrumentor().instrument()
    task_prerun.connect(link_origin, weak=False)  # after the instrumentation's: its span is the current one


def link_not_parent(headers: dict, **_: object) -> None:
    """before_task_publish, after the instrumentation's: a delayed task's run gets a trace of its own."""
    if headers.get("eta") and "traceparent" in headers:
        headers["origin_traceparent"] = headers.pop("traceparent")


def link_origin(task: object, **_: object) -> None:
    """task_prerun, after the instrumentation's: the run's span links to the caller's."""
    if origin := getattr(task.request, "origin_traceparent", None):
        caller = trace.get_current_span(extract({"traceparent": origin})).get_span_context()
        trace.get_current_span().add_link(caller)


@app.task(name="traced.trace_id")
def trace_id() -> dict:
    span = trace.get_current_span()
    return {"trace": format(span.get_span_context().trace_id, "032x"),
            "links": [format(link.context.trace_id, "032x") for link in getattr(span, "links", ())]}
