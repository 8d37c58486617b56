"""``celery -A proj delayed ...``: the poller and operator commands.

Registered through Celery's ``celery.commands`` entry point, like Flower.
"""
from __future__ import annotations

import dataclasses
import gc
import ipaddress
import json
import logging
import os
import signal
import textwrap
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from collections.abc import Callable, Iterator

import click
import prometheus_client
from confluent_kafka import KafkaException
from kombu import Connection
from redis.exceptions import ResponseError
from kombu.exceptions import OperationalError
from celery import Celery
from celery.bin.base import CeleryCommand, handle_preload_options
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from celery_delayed import store_of
from celery_delayed.client.schedules import beat_entries
from celery_delayed.inert import inert
from celery_delayed.kafka import address as kafka_address
from celery_delayed.kafka import Fleet, fleet, fleet_report, grow_topic
from celery_delayed.ops import browse, drain
from celery_delayed.ops.browse import Filter, parse_move, parse_rate, parse_when
from celery_delayed.poller.leadership import etcd_address, leaders, live_pollers, make_etcd
from celery_delayed.poller.loop import Poller
from celery_delayed.recurring.definitions import Definition, Definitions
from celery_delayed.settings import Settings
from celery_delayed.store.delayed import DelayedStore
from celery_delayed.store.dlq import DeadLetterError, DeadLetters
from celery_delayed.store.inspection import MAX_PAGE, totals
from celery_delayed.store.keys import Keys
from celery_delayed.store.layout import iso_of
from celery_delayed.store.outcomes import Change, StoreUnavailable, TaskInFlight, TaskNotScheduled
from celery_delayed.store.records import is_revoked
from celery_delayed.store.revoke import cancel_or_revoke
from celery_delayed.worker.broker import connect as broker_connect

console = Console()
err_console = Console(stderr=True)


class _OneLineErrors(click.Group):
    """A group whose sub-commands' foreseen failures are one line (click's ``Error: ...``) and exit
    code 1, not a traceback: in one place, for every command here and in sub-groups."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        # the store down or refusing (full, read-only, an ACL), laid out otherwise; a bad setting or
        # argument (ValueError: ConfigurationError, DeadLetterError...); a task the store cannot change
        # (each message inert: an id, a queue or a reason in it may hold what a scheduler wrote)
        except (StoreUnavailable, ValueError, TaskNotScheduled, TaskInFlight) as exc:
            raise click.ClickException(inert(str(exc))) from None
        except KafkaException as exc:
            raise click.ClickException(inert(f"Kafka: {exc}")) from None
        except ResponseError as exc:  # e.g. WRONGTYPE: a key of ours that something else wrote
            raise click.ClickException(inert(f"the delayed store refused a command: {exc}")) from None
        except OperationalError as exc:  # kombu's, for the broker (a revoke of a task in flight)
            raise click.ClickException(inert(f"Celery's broker: {exc}")) from None


@click.group(name="delayed", cls=_OneLineErrors)
@click.pass_context
@handle_preload_options
def delayed(ctx: click.Context) -> None:
    """celery-delayed: scheduled tasks in Redis, dispatched through Kafka."""


def _load(ctx: click.Context, check: bool = True) -> tuple[Settings, DelayedStore]:
    """The app's validated settings and its store, whose layout is checked unless ``check`` is off."""
    store = store_of(ctx.obj.app)
    if check:
        store.check_layout()
    return store.settings, store


@delayed.command(cls=CeleryCommand)
@click.option("-l", "--loglevel", default="INFO", show_default=True, help="Logging level.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics on this port (default: delayed_metrics_port; 0 = off).")
@click.pass_context
def poller(ctx: click.Context, loglevel: str, metrics_port: int | None) -> None:
    """Run a poller: lead partitions through etcd, move due tasks to Kafka."""
    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    settings, store = _load(ctx, check=False)  # the poller checks the store itself, waiting for it while down
    port = settings.metrics_port if metrics_port is None else metrics_port
    if port:
        with _listening("127.0.0.1", port):
            prometheus_client.start_http_server(port, addr="127.0.0.1")
    the_poller = Poller(settings, store=store, backend=ctx.obj.app.backend, beat_schedule=beat_entries(ctx.obj.app))

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger(__name__).info("signal %d: finishing the batch in hand, resigning", signum)
        the_poller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gc.collect()
    gc.freeze()  # what start-up loaded (Celery, the app) is never scanned by the GC again
    the_poller.run()  # a bad layout or memory policy raises ConfigurationError before anything runs


@delayed.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: {partitions (one object each), "
              "fleet (pollers, leaderless, etcd_error, kafka)}, and tasks with --tasks.")
@click.option("--tasks", "by_task", is_flag=True, help="Also per task name: how many, next due, whether this app "
              "registers it (reads the whole schedule).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, by_task: bool) -> None:
    """Per partition: scheduled, in flight and overdue tasks, the oldest overdue one's age, the next due time;
    then the pollers alive and what each leads, whether Kafka answers, and the queues no worker reads."""
    store = _load(ctx)[1]
    counts, now_ms, paused = store.counts(), store.now_ms(), store.paused()
    names = _task_names(ctx) if by_task else None
    the_fleet = _fleet(store.settings)
    if as_json:
        tasks = {} if names is None else {"tasks": names}
        click.echo(json.dumps({"partitions": counts, "fleet": the_fleet, **tasks}))
        return
    columns = ("scheduled", "inflight", "overdue", "failing")
    table = Table("partition", *columns, "oldest overdue", "next due")
    for row in counts:
        table.add_row(str(row["partition"]), *(str(row[k]) for k in columns), _overdue_age(row["oldest_overdue_s"]),
                      _due_in(row["upcoming_due_ms"], now_ms))
    every = totals(counts)
    table.add_row("all", *(str(every[k]) for k in columns), _overdue_age(every["oldest_overdue_s"]),
                  _due_in(every["upcoming_due_ms"], now_ms), style="bold")
    console.print(table)
    if every["failing"]:
        click.echo(f"{every['failing']} task(s) failing: their delivery to Kafka failed and has not gone through "
                   "since (each tried again shortly; the oldest overdue counts them from the due time they failed "
                   "at); the poller's log says why")
    for line in _fleet_lines(the_fleet):
        click.echo(line)  # not wrapped: a line to grep
    if paused:
        console.print(_cell("paused queues (their tasks stay in the store; `delayed queues`, `delayed resume`): "
                            + ", ".join(f"{queue} (since {_age((now_ms - since) / 1000)})"
                                        for queue, since in sorted(paused.items()))))
    if names is not None:
        console.print(_task_table(names, now_ms))


def _fleet(settings: Settings) -> dict:
    """What ``status`` says beyond the store (its JSON's ``fleet``): ``pollers``, those alive, each with
    the ``partitions`` it leads, and ``leaderless``, the partitions none leads (both None, and
    ``etcd_error`` says why, when etcd cannot be reached); ``kafka``: its ``address``, its ``topics`` and
    ``idle_workers`` as ``delayed topics --json`` gives them (None when it cannot be reached), and its
    ``warnings`` (unreachable, queues no worker reads; none when all is well)."""
    out: dict = {"pollers": None, "leaderless": None, "etcd_error": None}
    try:
        etcd = make_etcd(settings)
        alive, led = live_pollers(etcd, Keys(settings.key_prefix)), leaders(settings, etcd)
    except Exception as exc:  # pyetcd raises its own kinds
        out["etcd_error"] = f"{etcd_address(settings)} cannot be reached ({exc})"
    else:
        out["pollers"] = [{"poller": poller, "partitions": [p for p, held in led.items() if held["poller"] == poller]}
                          for poller in alive]
        out["leaderless"] = [p for p in range(settings.partitions) if p not in led]
    state, warnings = fleet_report(settings)
    out["kafka"] = {"address": kafka_address(settings), **(_topics_json(state) if state else
                                                         {"topics": None, "idle_workers": None}),
                    "warnings": warnings}
    return out


def _fleet_lines(fleet: dict) -> Iterator[str]:
    """:func:`_fleet` as ``status`` prints it: the pollers alive and the partitions each leads, those no
    poller leads, whether Kafka answers, the queues no worker reads."""
    if fleet["etcd_error"]:
        yield f"{fleet['etcd_error']}: pollers and leaders unknown; no poller dispatches while it is away"
    else:
        for poller in fleet["pollers"]:
            yield f"poller {poller['poller']} alive, leads partitions {_ranges(poller['partitions']) or 'none'}"
        if not fleet["pollers"]:
            yield "no poller alive: nothing is dispatched; start one with `celery -A proj delayed poller`"
        elif fleet["leaderless"]:
            yield f"partitions without a leader (not dispatched until one takes them): {_ranges(fleet['leaderless'])}"
    kafka = fleet["kafka"]
    yield from kafka["warnings"] or [f"{kafka['address']} answers; a worker reads every queue's topic that holds tasks"]


def _ranges(numbers: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7] (sorted)."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _task_names(ctx: click.Context, elsewhere: tuple[str, ...] = ()) -> list[dict]:
    """:func:`.browse.by_task` of the app, with progress."""
    with _progress("reading the schedule") as progress:
        return browse.by_task(ctx.obj.app, elsewhere, progress)


def _task_table(names: list[dict], now_ms: int) -> Table:
    table = Table("task", "scheduled", "next due", "registered")
    for row in names:
        table.add_row(_cell(row["task"]), f"{row['count']:,}", f"{iso_of(row['next_due_ms'])} "
                      f"({_due_in(row['next_due_ms'], now_ms)})", "yes" if row["registered"] else "NO",
                      style=None if row["registered"] else "bold red")
    return table


@delayed.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--grow", "queue", metavar="QUEUE", help="Give this queue's topic more partitions (--partitions).")
@click.option("--partitions", type=click.IntRange(min=1), help="With --grow: the partitions it is to have in all.")
@click.pass_context
def topics(ctx: click.Context, as_json: bool, queue: str | None, partitions: int | None) -> None:
    """Per queue: its Kafka topic's partitions, the workers reading them, and their lag (records not
    committed); the workers that read nothing.  A queue's topic feeds at most one worker per partition."""
    settings = _load(ctx, check=False)[0]
    if (queue is None) != (partitions is None):
        raise click.UsageError("--grow QUEUE and --partitions N go together")
    if queue is not None and partitions is not None:
        grow_topic(settings, queue, partitions)
        err_console.print(f"{settings.topic(queue)} has {partitions} partitions now")
    state = fleet(settings)
    if as_json:
        click.echo(json.dumps(_topics_json(state)))
        return
    table = Table("queue", "topic", "partitions", "workers reading", "lag")
    for topic in state.topics:
        table.add_row(_cell(topic.queue), _cell(settings.topic(topic.queue)), str(topic.partitions),
                      str(topic.consumers), str(topic.lag))
    console.print(table)
    if state.idle:
        err_console.print(f"[yellow]{state.idle} worker(s) of group {settings.consumer_group} read no partition: "
                          "their queues have more consumers than partitions. Grow a topic with "
                          "`celery -A proj delayed topics --grow QUEUE --partitions N`.")


def _topics_json(state: Fleet) -> dict:
    """``delayed topics --json``: each queue's topic, how many partitions it has and workers read it,
    its lag; the workers that read nothing."""
    return {"topics": [dataclasses.asdict(t) for t in state.topics], "idle_workers": state.idle}


def _task_id_of(store: DelayedStore, task_id: str | None, key: str | None) -> str:
    """The task id given, or the one scheduled under replace-by-key ``key``."""
    if task_id is not None and key is None:
        return task_id
    if task_id is not None or key is None:
        raise click.UsageError("give a TASK_ID or --key KEY")
    holder = store.key_holder(key)
    if holder is None:
        raise click.ClickException(f"no task is scheduled under key {key!r}")
    return holder


@delayed.command(name="show", cls=CeleryCommand)
@click.argument("task_id", required=False)
@click.option("--key", help="The task scheduled under this replace-by-key key (delayed_key header).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show_task(ctx: click.Context, task_id: str | None, key: str | None, as_json: bool) -> None:
    """One task in the store: due time, task, queue, partition, state and its message's headers."""
    store = _load(ctx)[1]
    task_id = _task_id_of(store, task_id, key)
    info, now_ms = store.get(task_id), store.now_ms()
    if info is None and is_revoked(store, task_id):
        raise click.ClickException(inert(f"task {task_id} was cancelled or revoked: it will not run"))
    if info is None:
        raise click.ClickException(f"no task with id {task_id} in the store (never scheduled, or already "
                                   "dispatched)")
    if as_json:
        click.echo(json.dumps(info))
        return
    table = Table(show_header=False, box=None)
    for key, value in info.items():
        if key == "eta" and value is not None:
            value = f"{value} ({_due_in(info['due_ms'], now_ms)})"
        shown = json.dumps(value, indent=2) if isinstance(value, dict) else str(value)
        table.add_row(Text(key, style="bold"), _cell(shown))
    console.print(table)


def _filter_options(command: Callable) -> Callable:
    """The options selecting many scheduled tasks (browse.Filter's fields), for bulk commands."""
    for name, help_ in reversed([("--task", "Tasks of this name."), ("--queue", "Tasks of this queue."),
                                 ("--due-after", "Due at or after this time (ISO 8601, ms, or now+1h)."),
                                 ("--due-before", "Due before this time."),
                                 ("--id-prefix", "Task ids starting with this.")]):
        command = click.option(name, metavar="NAME" if name in ("--task", "--queue") else None, help=help_)(command)
    command = click.option("--dry-run", is_flag=True,
                           help="Count the tasks the filter selects; change nothing.")(command)
    return click.option("-y", "--yes", is_flag=True, help="Act on the matches without asking.")(command)


def _bulk_filter(store: DelayedStore, fields: dict) -> Filter | None:
    """The filter of the bulk options given, None when none was given."""
    now_ms = store.now_ms()
    flt = Filter(task=fields["task"], queue=fields["queue"], id_prefix=fields["id_prefix"],
                 due_after=parse_when(fields["due_after"], now_ms),
                 due_before=parse_when(fields["due_before"], now_ms))
    return None if flt.is_empty() else flt


def _bulk(store: DelayedStore, flt: Filter, verb: str, yes: bool, act: Callable[[browse.Progress], dict] | None
          ) -> dict | None:
    """Count first, say how many, ask (unless --yes), then ``act``, with progress; without one (--dry-run),
    stop after the count.  Returns what ``act`` counted (None when it did not act)."""
    with _progress("counting") as progress:
        matched = browse.count(store, flt, progress)
    what = ", ".join(f"{k}={v}" for k, v in flt.as_dict().items())
    if act is None or not matched:
        click.echo(f"{matched} scheduled tasks " + (f"match {what}" if what else "in all")
                   + ("; nothing changed" if act is None else ""))
        return None
    if not yes:
        click.confirm(f"This will {verb} {matched} scheduled tasks" + (f" ({what})" if what else "") + ". Go on?",
                      abort=True)
    with _progress(verb) as progress:
        counted = act(progress)
    click.echo(", ".join(f"{k} {v}" for k, v in counted.items()))
    return counted


@contextmanager
def _progress(what: str) -> Iterator[browse.Progress]:
    """A rich progress line counting entries examined and matched."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(what)
        yield lambda examined, matched: bar.update(task, description=f"{what}: {examined:,} examined, "
                                                                      f"{matched:,} match")


@delayed.command(cls=CeleryCommand)
@click.argument("task_id", required=False)
@click.option("--key", help="The task scheduled under this replace-by-key key (delayed_key header).")
@_filter_options
@click.pass_context
def cancel(ctx: click.Context, task_id: str | None, key: str | None, dry_run: bool, yes: bool, **fields) -> None:
    """Cancel a scheduled task for good (as a revoke does): out of the store, marked REVOKED.

    A task a poller is already dispatching is revoked in the workers instead.
    With filter options instead of a TASK_ID: every scheduled task they select,
    counted first and confirmed (--yes: without asking; --dry-run: only count).
    """
    app = ctx.obj.app
    store = _load(ctx)[1]
    flt = _bulk_filter(store, fields)
    if flt is not None:
        if task_id or key:
            raise click.UsageError("give a TASK_ID, --key, or filter options, not several")
        _bulk(store, flt, "cancel", yes, None if dry_run else lambda progress: browse.cancel(app, flt, progress))
        return
    task_id = _task_id_of(store, task_id, key)
    if key is not None:
        store.release_key(key, task_id)
    outcome = cancel_or_revoke(app, [task_id])[task_id]
    if outcome is Change.UNKNOWN:
        raise click.ClickException(f"no scheduled task with id {task_id} (never scheduled, already dispatched, "
                                   "or cancelled)")
    click.echo(inert(f"cancelled {task_id}" if outcome is Change.DONE
                     else f"{task_id} is being dispatched: revoke sent to the workers"))


@delayed.command(cls=CeleryCommand)
@click.argument("task_id", required=False)
@click.option("--key", help="The task scheduled under this replace-by-key key (delayed_key header).")
@click.option("--eta", help="The new due time (ISO 8601, ms since the epoch, or now+10m).")
@click.option("--shift", help="Move by this much: 3600, 90m, -1h, 2d.")
@_filter_options
@click.pass_context
def reschedule(ctx: click.Context, task_id: str | None, key: str | None, eta: str | None, shift: str | None,
               dry_run: bool, yes: bool, **fields) -> None:
    """Move a scheduled task to a new due time (--eta) or by an amount (--shift).

    With filter options instead of a TASK_ID: every scheduled task they select,
    counted first and confirmed, as for cancel.
    """
    if (eta is None) == (shift is None):
        raise click.UsageError("give --eta or --shift")
    store = _load(ctx)[1]
    to_ms, shift_ms = parse_move(eta, shift, store.now_ms())
    flt = _bulk_filter(store, fields)
    if flt is not None:
        if task_id or key:
            raise click.UsageError("give a TASK_ID, --key, or filter options, not several")
        _bulk(store, flt, "reschedule", yes, None if dry_run else lambda progress: browse.reschedule(
            store, flt, shift_ms=shift_ms, to_ms=to_ms, progress=progress))
        return
    task_id = _task_id_of(store, task_id, key)
    due_ms = browse.move(store, task_id, to_ms=to_ms, shift_ms=shift_ms)
    click.echo(inert(f"{task_id} now due {iso_of(due_ms)}"))


@delayed.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: [{task, count, next_due_ms, "
              "registered}].")
@click.option("--ignore", metavar="NAME", multiple=True, help="A task name another service's workers run, not "
              "this app's (taken as registered; repeatable).")
@click.pass_context
def check(ctx: click.Context, as_json: bool, ignore: tuple[str, ...]) -> None:
    """Before a deploy: fail (exit 1) when scheduled tasks name a task this app does not register.

    A task renamed or removed in the new code would reach the workers under its
    old name and be parked in the dead-letter queue.  Lists every scheduled task
    name with its count and next due time, the unregistered ones flagged.  Reads
    the whole schedule, in batches, with progress.
    """
    store = _load(ctx)[1]
    names = _task_names(ctx, ignore)
    if as_json:
        click.echo(json.dumps(names))
    else:
        console.print(_task_table(names, store.now_ms()))
    if unknown := [row for row in names if not row["registered"]]:
        raise click.ClickException(f"{len(unknown)} scheduled task name(s) this app does not register: "
                                   + ", ".join(f"{inert(row['task'])} ({row['count']:,} scheduled, next due "
                                               f"{iso_of(row['next_due_ms'])})" for row in unknown)
                                   + "; register them again (an alias task of the old name) or cancel them "
                                   "(delayed cancel --task NAME); a name another service's workers run: --ignore NAME")


@delayed.command(name="drain", cls=CeleryCommand)
@click.option("--to-broker", is_flag=True, help="Publish them to the app's broker with their ETA (required: the "
              "only way out there is).")
@click.option("--force", is_flag=True, help="Drain while pollers run (a task one dispatches meanwhile goes to "
              "Kafka as well as to the broker).")
@_filter_options
@click.pass_context
def drain_command(ctx: click.Context, to_broker: bool, force: bool, dry_run: bool, yes: bool, **fields) -> None:
    """Send scheduled tasks back to Celery's broker, as Celery would have sent them, and out of the store.

    The way back from celery-delayed: each task (every one, or those the filter
    options select) is published to the app's broker with its ETA, then removed
    from the store; a plain Celery worker runs it at its ETA.  Counted first and
    confirmed (--yes: without asking; --dry-run: only count).  Stop the pollers
    first (refused while any runs, unless --force).  Stopped at any point, it can
    be run again: nothing is lost, at most the task it was sending is sent twice.
    """
    if not to_broker:
        raise click.UsageError("say where to: --to-broker (the app's broker, with each task's ETA)")
    app = ctx.obj.app
    store = _load(ctx)[1]
    flt = _bulk_filter(store, fields) or Filter()
    if not (force or dry_run):
        try:
            pollers = drain.running_pollers(store)
        except Exception as exc:  # etcd's client raises its own kinds
            raise click.ClickException(f"cannot tell whether pollers run (etcd: {exc}); pass --force once they "
                                       "are stopped") from None
        if pollers:
            raise click.ClickException(f"{len(pollers)} poller(s) running ({', '.join(pollers)}): stop them first, "
                                       "or pass --force (a task they dispatch while it is drained would reach "
                                       "Kafka as well as the broker)")
    broker = app.connection_for_write().as_uri()  # its password masked
    with nullcontext() if dry_run else _broker_connection(app, broker) as connection:
        returned, claimed = drain.return_lapsed_claims(store) if not dry_run else (0, 0)
        if returned:
            click.echo(f"{returned} tasks whose poller died while dispatching them are scheduled again")
        try:
            counted = _bulk(store, flt, "send to the broker", yes, None if connection is None
                            else lambda progress: drain.to_broker(app, connection, flt, progress))
        except OperationalError as exc:
            raise click.ClickException(f"Celery's broker {broker} stopped answering ({exc}): run drain again once "
                                       "it answers (what was sent is out of the store, the rest still in it)") from None
    if counted and counted["running"]:
        click.echo(f"{counted['running']} tasks run now from Kafka (a copy their poller delivered): left in the "
                   "store; run drain again once they ended")
    if claimed:
        click.echo(f"{claimed} tasks are still claimed by a poller (dispatching them, or dead for less than "
                   "delayed_visibility_timeout): run drain again once that has passed")


def _broker_connection(app: Celery, broker: str) -> Connection:
    """The drain's connection to Celery's broker (:func:`.broker.connect`); a one-line error, before the
    store is touched, when the broker cannot be reached or does not answer."""
    try:
        return broker_connect(app)
    except OperationalError as exc:
        raise click.ClickException(f"Celery's broker {broker} is unreachable or does not answer ({exc}): nothing "
                                   "was sent or removed; run drain again once it answers") from None


@delayed.command(cls=CeleryCommand)
@click.option("--limit", type=click.IntRange(1, MAX_PAGE), default=20, show_default=True, help="Tasks shown.")
@click.option("--after", metavar="CURSOR", default=None, help="Continue after a previous page (its cursor).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: {items, cursor}.")
@click.pass_context
def upcoming(ctx: click.Context, limit: int, after: str | None, as_json: bool) -> None:
    """The next scheduled tasks across all partitions, soonest first."""
    store = _load(ctx)[1]
    page, now_ms = store.upcoming(limit, after), store.now_ms()
    if as_json:
        click.echo(json.dumps({"items": page.items, "cursor": page.cursor}))
        return
    for item in page.items:  # one line per task, whole ids: easy to copy and to grep
        click.echo(inert(f"{item['eta']}  {_due_in(item['due_ms'], now_ms):>9}  {item['task_id']}  {item['task']}  "
                         f"queue={item['queue']} partition={item['partition']}"))
    if page.cursor:
        click.echo(inert(f"next page: --after {page.cursor}"))


@delayed.command(cls=CeleryCommand)
@click.argument("queues", nargs=-1, required=True)
@click.pass_context
def pause(ctx: click.Context, queues: tuple[str, ...]) -> None:
    """Hold QUEUES' tasks in the store, due or not, until resumed: every poller stops dispatching them
    within a second, and after restarts and failovers."""
    store = _load(ctx)[1]
    for queue in queues:
        click.echo(f"{queue}: {'paused' if store.pause(queue) else 'already paused'}")


@delayed.command(cls=CeleryCommand)
@click.argument("queues", nargs=-1, required=True)
@click.pass_context
def resume(ctx: click.Context, queues: tuple[str, ...]) -> None:
    """Let QUEUES' tasks go again: the due ones at once, oldest first."""
    store = _load(ctx)[1]
    for queue in queues:
        click.echo(f"{queue}: {'resumed' if store.resume(queue) else 'was not paused'}")


@delayed.command(name="rate", cls=CeleryCommand)
@click.argument("queue")
@click.argument("rate", required=False)
@click.option("--reset", is_flag=True, help="Drop the rate set here: delayed_queue_rates applies again.")
@click.pass_context
def rate_command(ctx: click.Context, queue: str, rate: str | None, reset: bool) -> None:
    """Dispatch at most RATE of QUEUE's tasks a second, in all pollers together, from the next second
    on ("off": no limit); overrides delayed_queue_rates until --reset."""
    store = _load(ctx)[1]
    if reset == (rate is not None):
        raise click.UsageError("give a RATE (tasks a second, or off), or --reset")
    try:
        value = parse_rate(rate)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="RATE") from None
    store.set_rate(queue, value)
    limit = store.queue_rates().get(queue)
    click.echo(f"{queue}: {'no limit' if limit is None else f'at most {limit:g} tasks/s'}")


@delayed.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one object per queue).")
@click.pass_context
def queues(ctx: click.Context, as_json: bool) -> None:
    """Per queue with scheduled tasks, paused or rate-limited: its overdue tasks (held back, when paused),
    its next due time, whether it is paused, its rate limit."""
    store = _load(ctx)[1]
    rows, now_ms = store.queues(), store.now_ms()
    if as_json:
        click.echo(json.dumps(rows))
        return
    table = Table("queue", "overdue", "next due", "paused", "rate")
    for row in rows:
        since = row["paused_since_ms"]
        table.add_row(_cell(row["queue"] or "(stored before lanes)"), str(row["overdue"]),
                      _due_in(row["next_due_ms"], now_ms),
                      "-" if since is None else f"since {_age((now_ms - since) / 1000)}",
                      "-" if row["rate"] is None else f"{row['rate']:g}/s")
    console.print(table)


@contextmanager
def _listening(address: str, port: int) -> Iterator[None]:
    """A port that cannot be served on (in use, privileged, an address not this machine's) is one line."""
    try:
        yield
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {address}:{port}: {exc.strerror or exc}") from None


def _cell(value: object) -> Text:
    """A value from the store for rich: inert, and a Text, never read as rich markup."""
    return Text(inert(str(value)))


def _due_in(due_ms: int | None, now_ms: int) -> str:
    """``in 5m`` / ``12s ago`` relative to Redis' clock; ``-`` for no time."""
    if due_ms is None:
        return "-"
    seconds = (due_ms - now_ms) / 1000
    return f"in {_age(seconds)}" if seconds >= 0 else f"{_age(-seconds)} ago"


def _overdue_age(seconds: float | None) -> str:
    return "-" if seconds is None else _age(seconds)


@delayed.command(cls=CeleryCommand)
@click.option("--port", type=int, default=5566, show_default=True, help="Port to serve on.")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to bind (127.0.0.1: this machine only; give another only behind auth).")
@click.option("--basic-auth", envvar="CELERY_DELAYED_WEB_BASIC_AUTH", metavar="USER:PASSWORD",
              help="Require HTTP basic auth (better: set CELERY_DELAYED_WEB_BASIC_AUTH, not shown by ps).")
@click.option("--token", envvar="CELERY_DELAYED_WEB_TOKEN",
              help="Accept 'Authorization: Bearer TOKEN', 16 characters at least (API clients; better: "
              "CELERY_DELAYED_WEB_TOKEN).")
@click.option("--metrics", "metrics_urls", multiple=True, metavar="URL",
              help="A poller's Prometheus endpoint (repeatable), for the dispatch rate and lag.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Without credentials, a Host name besides 127.0.0.1/localhost to answer (repeatable).")
@click.option("--insecure-serve-without-auth", "without_auth", is_flag=True,
              help="Serve an --address beyond this machine without --basic-auth or --token: whoever reaches it "
              "can cancel, reschedule and purge tasks.")
@click.pass_context
def web(ctx: click.Context, port: int, address: str, basic_auth: str | None, token: str | None,
        metrics_urls: tuple[str, ...], allowed_hosts: tuple[str, ...], without_auth: bool) -> None:
    """Serve the web view of the schedule and the dead letters (and its JSON API under /api)."""
    import tornado.ioloop

    from celery_delayed.ops.web.server import make_app
    from celery_delayed.ops.web.views import Views

    for name in ("CELERY_DELAYED_WEB_BASIC_AUTH", "CELERY_DELAYED_WEB_TOKEN"):
        if os.environ.get(name) == "":  # click takes an empty variable for an unset one: no auth at all
            raise click.ClickException(f"{name} is empty: set it to the credentials, or unset it")
    beyond = not _loopback(address)
    if beyond and not (basic_auth or token or without_auth):
        raise click.ClickException(f"{address} is beyond this machine: give --basic-auth or --token (or, to let "
                                   "whoever reaches it change tasks, --insecure-serve-without-auth)")
    _load(ctx, check=False)  # a store that is down answers 503 until it is back
    try:
        application = make_app(Views(ctx.obj.app, metrics_urls), basic_auth=basic_auth, token=token,
                               allowed_hosts=(*allowed_hosts, address))
    except ValueError as exc:
        raise click.ClickException(inert(str(exc))) from None
    with _listening(address, port):
        application.listen(port, address)
    auth = " and ".join(name for name, given in (("basic auth", basic_auth), ("token", token)) if given)
    click.echo(f"celery-delayed web on http://{address}:{port}/ ({auth or 'no auth'})")
    if beyond and not auth:
        click.echo("warning: served beyond this machine without credentials (--insecure-serve-without-auth)",
                   err=True)
    tornado.ioloop.IOLoop.current().start()


def _loopback(address: str) -> bool:
    """Whether ``address`` (an IP address or localhost) is this machine's loopback."""
    try:
        return address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return False


# -- recurring schedules -------------------------------------------------------
@delayed.group()
def schedules() -> None:
    """Recurring schedules (beat_schedule's and those made at run time): list, show, pause, resume,
    run now, remove."""


def _definitions(ctx: click.Context) -> Definitions:
    return Definitions(_load(ctx)[1])


def _no_schedule(schedule_id: str) -> click.ClickException:
    return click.ClickException(inert(f"no recurring schedule {schedule_id!r}"))


def _schedule_line(definition: Definition, now_ms: int) -> str:
    """One line: id, task, rule, next run (or paused, ended), options; whole ids, to copy and grep."""
    info = definition.describe()
    state = "paused" if info["paused"] else "ended" if info["next_ms"] is None else \
        f"next {iso_of(info['next_ms'])} ({_due_in(info['next_ms'], now_ms)})"
    options = " ".join(f"{k}={v}" for k, v in info["options"].items())
    return inert(f"{info['schedule_id']}  {info['task']}  {info['rule']}  {state}  {options}".rstrip())


@schedules.command(name="list", cls=CeleryCommand)
@click.option("--prefix", default="", help="Only the schedules whose id starts with this.")
@click.option("--limit", type=click.IntRange(1, MAX_PAGE), default=100, show_default=True,
              help="About this many a page.")
@click.option("--after", metavar="CURSOR", default="", help="Continue after a previous page (its cursor).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: {items, cursor}.")
@click.pass_context
def list_schedules(ctx: click.Context, prefix: str, limit: int, after: str, as_json: bool) -> None:
    """A page of the recurring schedules (in no order), and the cursor of the next."""
    definitions = _definitions(ctx)
    page, cursor = definitions.page(prefix, after, limit)
    if as_json:
        click.echo(json.dumps({"items": [d.describe() for d in page], "cursor": cursor}))
        return
    now_ms = definitions.store.now_ms()
    for definition in page:
        click.echo(_schedule_line(definition, now_ms))
    if cursor:
        click.echo(inert(f"next page: --after {cursor}"))


@schedules.command(name="show", cls=CeleryCommand)
@click.argument("schedule_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show_schedule(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """One recurring schedule: task, rule, options, version, state and its next occurrence."""
    definitions = _definitions(ctx)
    if (definition := definitions.get(schedule_id)) is None:
        raise _no_schedule(schedule_id)
    if as_json:
        click.echo(json.dumps(definition.describe()))
        return
    info, now_ms = definition.describe(), definitions.store.now_ms()
    for key in ("next_ms", "last_ms"):
        if info[key] is not None:
            info[key] = f"{iso_of(info[key])} ({_due_in(info[key], now_ms)})"
    for key, value in info.items():
        click.echo(inert(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}"))


def _schedule_command(name: str, act: Callable[[Definitions, str], object], said: Callable[[object], str],
                      doc: str) -> None:
    """``delayed schedules NAME SCHEDULE_ID``: ``act`` on it, then say what it did (``said`` of what
    ``act`` returned); None or False, no such schedule: a one-line error."""
    @schedules.command(name=name, cls=CeleryCommand, help=doc)
    @click.argument("schedule_id")
    @click.pass_context
    def command(ctx: click.Context, schedule_id: str) -> None:
        done = act(_definitions(ctx), schedule_id)
        if done is None or done is False:
            raise _no_schedule(schedule_id)
        click.echo(inert(f"{schedule_id}: {said(done)}"))


for _name, _act, _said, _doc in (
        ("pause", Definitions.pause, lambda _: "paused",
         "Stop running SCHEDULE_ID until resumed (its pending occurrence is cancelled)."),
        ("resume", Definitions.resume, lambda _: "resumed",
         "Run SCHEDULE_ID again; what it missed meanwhile runs by its misfire policy."),
        ("run-now", Definitions.run_now, lambda task_id: f"runs now as task {task_id}",
         "Run SCHEDULE_ID once now, besides its chain; prints that run's task id."),
        ("remove", Definitions.remove, lambda _: "removed",
         "Delete SCHEDULE_ID: its pending occurrence never runs (a beat_schedule entry comes back at the "
         "next poller start while it is configured).")):
    _schedule_command(_name, _act, _said, _doc)


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
    """The most recent dead letters: task, where and why they were parked, and when (a table on a
    terminal, else a line each with the whole task id; --json for scripts)."""
    letters = _dead_letters(ctx)
    rows = [letter.describe() for letter in letters.list(limit)]
    if as_json:
        click.echo(json.dumps([{k: row[k] for k in LIST_FIELDS} for row in rows]))
        return
    title, now = f"{len(rows)} of {letters.count()} dead letters", time.time()
    cells = [[inert(str(v)) for v in (row["task_id"], row["task"], row["source"], _shorten(row["reason"]),
                                      row["attempts"], _age(now - row["timestamp"]))] for row in rows]
    if not console.is_terminal:  # a pipe: a line per letter, its whole id to copy into `dlq requeue`
        click.echo("\n".join([title, *("  ".join(line) for line in cells)]))
        return
    table = Table("task id", "task", "source", "reason", "attempts", "age", title=title)
    for line in cells:  # Text: reasons are shown as written, never read as rich markup
        table.add_row(*map(Text, line))
    console.print(table)


@dlq.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """One dead letter in full: why it was parked, its traceback and its message's headers."""
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
        lines = [inert(line) for line in text.rstrip().split("\n")]  # a traceback keeps its lines
        if len(lines) > 1:
            click.echo(f"{key}:\n" + textwrap.indent("\n".join(lines), "  "))
        else:
            click.echo(f"{key}: {lines[0]}")


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
        if not letters.requeue(task_id, backend):
            raise _unknown(task_id)
        click.echo(f"requeued {task_id}")
        return
    kept: list[str] = []

    def report(requeued_id: str, error: DeadLetterError | None) -> None:
        if error is None:
            click.echo(inert(f"requeued {requeued_id}"))
        else:
            kept.append(inert(str(error)))

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
    try:
        go = yes or click.confirm(f"Purge all {letters.count()} dead letters?")
    except click.Abort:  # no answer: stdin is not a terminal, or closed
        go = False
    if not go:
        raise click.ClickException("nothing purged: pass --yes to purge every dead letter without asking")
    click.echo(f"purged {letters.purge_all()} dead letters")


def _dead_letters(ctx: click.Context) -> DeadLetters:
    return DeadLetters(_load(ctx)[1])


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
