"""``celery -A proj delayed ...``: the poller and operator commands.

Registered through Celery's ``celery.commands`` entry point, like Flower.
"""
from __future__ import annotations

import json
import logging
import signal
import textwrap
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator

import click
import prometheus_client
from celery.bin.base import CeleryCommand, handle_preload_options
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import store_of
from .dlq import DeadLetterError, DeadLetters
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


# -- dead-letter queue ---------------------------------------------------------
#: Fields of each dead letter in ``dlq list --json``.
LIST_FIELDS = ("task_id", "task", "queue", "source", "reason", "attempts", "timestamp")


@delayed.group()
def dlq() -> None:
    """The dead-letter queue: list, show, requeue and purge parked messages."""


@dlq.command(name="list", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              help="Most dead letters shown, newest first.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool, limit: int) -> None:
    """The most recent dead letters: task, where and why they were parked, and when."""
    letters = _dead_letters(ctx)
    with _dlq_errors():
        rows = [letter.describe() for letter in letters.list(limit)]
    if as_json:
        click.echo(json.dumps([{k: row[k] for k in LIST_FIELDS} for row in rows]))
        return
    table = Table("task id", "task", "source", "reason", "attempts", "age",
                  title=f"{len(rows)} of {letters.count()} dead letters")
    now = time.time()
    for row in rows:  # Text: reasons are shown as written, never read as rich markup
        table.add_row(*(Text(str(v)) for v in (row["task_id"], row["task"], row["source"], _shorten(row["reason"]),
                                               row["attempts"], _age(now - row["timestamp"]))))
    console.print(table)


@dlq.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """One dead letter in full: why it was parked, its traceback and its message's headers."""
    with _dlq_errors():
        letter = _dead_letters(ctx).get(task_id)
    if letter is None:
        raise _unknown(task_id)
    info = letter.describe()
    if as_json:
        click.echo(json.dumps(info))
        return
    info["timestamp"] = (f"{datetime.fromtimestamp(info['timestamp'], timezone.utc).isoformat(timespec='seconds')}"
                         f" ({_age(time.time() - info['timestamp'])} ago)")
    for key, value in info.items():
        text = json.dumps(value, indent=2) if isinstance(value, dict) else str(value)
        if "\n" in text:
            click.echo(f"{key}:\n{textwrap.indent(text.rstrip(), '  ')}")
        else:
            click.echo(f"{key}: {text}")


@dlq.command(cls=CeleryCommand)
@click.argument("task_id", required=False)
@click.option("--all", "every", is_flag=True, help="Requeue every dead letter.")
@click.pass_context
def requeue(ctx: click.Context, task_id: str | None, every: bool) -> None:
    """Run dead letters again: back through the store, due now, under the same task id.

    The task's stored result is forgotten first, so the rerun is not skipped.
    Records whose message is not a valid envelope stay in the queue.
    """
    _one_or_all(task_id, every)
    letters, backend = _dead_letters(ctx), ctx.obj.app.backend
    if task_id is not None:
        with _dlq_errors():
            if not letters.requeue(task_id, backend):
                raise _unknown(task_id)
        click.echo(f"requeued {task_id}")
        return
    kept: list[str] = []

    def report(requeued_id: str, error: DeadLetterError | None) -> None:
        if error is None:
            click.echo(f"requeued {requeued_id}")
        else:
            kept.append(str(error))

    click.echo(f"requeued {letters.requeue_all(backend, report)} dead letters")
    if kept:
        raise click.ClickException(f"{len(kept)} dead letters could not be requeued and stay in the queue:\n"
                                   + "\n".join(kept))


@dlq.command(cls=CeleryCommand)
@click.argument("task_id", required=False)
@click.option("--all", "every", is_flag=True, help="Purge every dead letter.")
@click.option("-y", "--yes", is_flag=True, help="Purge --all without asking.")
@click.pass_context
def purge(ctx: click.Context, task_id: str | None, every: bool, yes: bool) -> None:
    """Drop dead letters for good."""
    _one_or_all(task_id, every)
    letters = _dead_letters(ctx)
    if task_id is not None:
        if not letters.purge(task_id):
            raise _unknown(task_id)
        click.echo(f"purged {task_id}")
        return
    if not yes:
        click.confirm(f"Purge all {letters.count()} dead letters?", abort=True)
    click.echo(f"purged {letters.purge_all()} dead letters")


def _dead_letters(ctx: click.Context) -> DeadLetters:
    return DeadLetters(_load(ctx)[1])


@contextmanager
def _dlq_errors() -> Iterator[None]:
    """A record that cannot be read or requeued is a one-line error, not a traceback."""
    try:
        yield
    except DeadLetterError as exc:
        raise click.ClickException(str(exc)) from None


def _unknown(task_id: str) -> click.ClickException:
    return click.ClickException(f"no dead letter with task id {task_id}")


def _one_or_all(task_id: str | None, every: bool) -> None:
    if (task_id is not None) == every:
        raise click.UsageError("give either a TASK_ID or --all")


def _shorten(text: str, width: int = 60) -> str:
    """The first line of ``text``, cut to ``width`` characters."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= width else line[:width - 1] + "…"


def _age(seconds: float) -> str:
    """A compact age: 42s, 5m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"
