"""``celery -A proj delayed ...``: the poller and operator commands.

Registered through Celery's ``celery.commands`` entry point, like Flower.
"""
from __future__ import annotations

import json
import logging
import signal
import time

import click
import prometheus_client
from celery.bin.base import CeleryCommand, handle_preload_options
from rich.console import Console
from rich.table import Table

from . import metrics, store_of
from .poller import Poller
from .settings import ConfigurationError, Settings
from .store import DelayedStore

console = Console()


@click.group(name="delayed")
@click.pass_context
@handle_preload_options
def delayed(ctx: click.Context) -> None:
    """celery-delayed: scheduled tasks in Redis, dispatched through Kafka."""


def _load(ctx: click.Context) -> tuple[Settings, DelayedStore]:
    """The app's validated settings and its store; a bad setting is a one-line error, not a traceback."""
    try:
        store = store_of(ctx.obj.app)
        return store.settings, store
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


@delayed.command(cls=CeleryCommand)
@click.option("-l", "--loglevel", default="INFO", show_default=True, help="Logging level.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics on this port (default: delayed_metrics_port; 0 = off).")
@click.pass_context
def poller(ctx: click.Context, loglevel: str, metrics_port: int | None) -> None:
    """Run a poller: lead partitions through etcd, move due tasks to Kafka."""
    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    settings, store = _load(ctx)
    port = settings.metrics_port if metrics_port is None else metrics_port
    if port:
        metrics.register_store(store)
        prometheus_client.start_http_server(port, addr="127.0.0.1")
    the_poller = Poller(settings, store=store)

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger(__name__).info("signal %d: finishing the batch in hand, resigning", signum)
        the_poller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    the_poller.run()


@delayed.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Per-partition counts of scheduled and in-flight tasks, and the next due time."""
    counts = _load(ctx)[1].counts()
    if as_json:
        click.echo(json.dumps(counts))
        return
    table = Table("partition", "scheduled", "inflight", "next due")
    now = time.time() * 1000
    for row in counts:
        due = row["next_due_ms"]
        table.add_row(str(row["partition"]), str(row["scheduled"]), str(row["inflight"]),
                      "-" if due is None else f"{(due - now) / 1000:+.1f} s")
    table.add_row("all", str(sum(r["scheduled"] for r in counts)), str(sum(r["inflight"] for r in counts)), "",
                  style="bold")
    console.print(table)
