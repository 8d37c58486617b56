"""Trace continuity: with opentelemetry-instrumentation-celery, the trace of the ``apply_async`` call
reaches the task's run through the store and Kafka, as it does on Celery's own path (a real worker
instrumented as the instrumentation's documentation says, the caller's spans in memory)."""
from __future__ import annotations

from celery.signals import before_task_publish
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_delayed import store_of
from tasks import create_app

from .support import Processes, wait_for
from .traced_app import link_not_parent


def test_the_callers_trace_reaches_the_run_through_the_store_as_through_the_broker(overrides, tmp_path):
    app = create_app(**overrides)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    processes = Processes(tmp_path, overrides, app="tests.integration.traced_app")
    try:
        processes.poller()
        worker = processes.worker()
        wait_for(lambda: "ready." in processes.log(worker), 60, "the worker (it declares the broker queue)")
        tracer = provider.get_tracer(__name__)
        sent = {}
        for path, options in (("store", {"countdown": 2}), ("broker", {}), ("store, linked", {"countdown": 2})):
            if path == "store, linked":  # the README's recipe: a trace of its own, linked to the caller's
                before_task_publish.connect(link_not_parent, weak=False)
            with tracer.start_as_current_span(f"caller via the {path}") as span:
                result = app.send_task("traced.trace_id", **options)
                sent[path] = (result, format(span.get_span_context().trace_id, "032x"))
            if path.startswith("store"):
                assert store_of(app).get(result.id) is not None, "the countdown task is not in the store"
        for path, (result, caller_trace) in sent.items():
            run = result.get(timeout=90)
            if path == "store, linked":
                assert run["trace"] != caller_trace and run["links"] == [caller_trace], run
            else:
                assert run == {"trace": caller_trace, "links": []}, f"the run via the {path} is in another trace"
        published = [s for s in exporter.get_finished_spans() if s.name.startswith("apply_async/")]
        assert len(published) == 3  # the instrumentation traced every publish
    finally:
        before_task_publish.disconnect(link_not_parent)
        instrumentor.uninstrument()
        processes.stop_all()
