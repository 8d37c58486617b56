"""A chaos run's report: the per-fault table (Markdown), everything as JSON, a PNG timeline."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .faults import Injected

HEADER = ("| fault | injected (times) | tasks lost | duplicate deliveries | duplicate runs | duplicate side effects "
          "| recovery: dispatch (s) | recovery: started (s) |\n|---|---|---|---|---|---|---|---|")


def _recovery(values: list[float | str | None]) -> str:
    return ", ".join("not back" if v is None else v if isinstance(v, str) else f"{v:.1f}" for v in values) or "-"


def _lost(row: dict[str, Any]) -> str:
    if not row["lost"]:
        return "0"
    reasons = "; ".join(f"{n}: {why}" for why, n in sorted(row["lost_why"].items(), key=lambda kv: -kv[1]))
    return f"**{row['lost']}** ({reasons})"


def _live(run: dict[str, Any]) -> str:
    live = run.get("live")
    if not live:
        return ""
    return (f"Of the tasks, {live['sent']} were sent one by one by `apply_async` while the faults ran: "
            f"{live['by_broker']} of them through Celery's broker (acknowledged too late for the store), "
            f"{live['unacked']} never acknowledged; {live['refused']} calls raised and were tried again.")


def table(result: dict[str, Any]) -> str:
    """The per-fault Markdown table."""
    lines = [HEADER]
    for row in result["faults"]:
        lines.append(f"| {row['fault']} | {row['injected']} | {_lost(row)} | {row['duplicate_deliveries']} "
                     f"| {row['duplicate_runs']} | {row['duplicate_effects']} "
                     f"| {_recovery(row['dispatch_recovery_s'])} | {_recovery(row['recovery_s'])} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The whole report: run parameters, versions, checks, the table, the faults as injected."""
    run = result["run"]
    checks = "\n".join(f"- {'PASS' if ok else '**FAIL**'}: {name}" for name, ok in result["checks"].items())
    effects, dlq = result["effects"], result["dlq"]
    faults = "\n".join(f"| {i + 1} | {f['name']} | {f['at_s']:.1f} | {f['took_s']:.1f} | {f['note']} |"
                       for i, f in enumerate(result["injected"]))
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    return f"""# Chaos run {run['started']}

`{run['command']}` — seed {run['seed']}, {result['tasks']} tasks due over {run['window_s']:.0f} s,
2 pollers, 2 workers (prefork, -c 2); wall time {run['wall_s']:.0f} s. {versions}.
Delayed store on {_store(run)}. {_live(run)}

{table(result)}

Recovery: seconds from the fault's start until the first moment after its end from which every
task due within 2 s was put on Kafka (dispatch) or started by a worker (started) within 1 s of its
due time; "started" also waits out any backlog the workers have. Duplicate runs: executions of a (task id,
attempt) beyond its first; duplicate deliveries: Kafka records of one beyond its first; each is put
down to the fault that started last before it.

## Checks

{checks}

{result['executions']} executions; side effects: {effects['tasks']} tasks, {effects['rows']} rows,
{effects['attempts']} attempts to write one ({effects['absorbed_by_key']} absorbed by the idempotency key);
dead-letter queue: {dlq['held']} held, {dlq['meant_to_fail']} meant to fail; store left
{result['store_left']}; consumer lag {result['consumer_lag']}. Not run when the run ended, but not lost
(so not counted as lost above): {result['unfinished']['in_store']} still in the store,
{result['unfinished']['on_kafka']} on Kafka past the workers' committed offsets.

## Faults as injected

| # | fault | at (s) | took (s) | what happened |
|---|---|---|---|---|
{faults}
"""


def _store(run: dict[str, Any]) -> str:
    where = ("the Redis Cluster (3 primaries, a replica each)" if run.get("store") == "cluster"
             else "the standalone Redis")
    wait = run.get("schedule_wait")
    return f"{where}, delayed_schedule_wait {wait!r}" if wait else f"{where}, schedule writes not waiting for replicas"


def write(result: dict[str, Any], folder: Path, timeline: dict[str, Any]) -> list[Path]:
    """``report.md``, ``report.json`` and ``timeline.png`` into ``folder``."""
    md, js, png = folder / "report.md", folder / "report.json", folder / "timeline.png"
    md.write_text(markdown(result))
    js.write_text(json.dumps(result, indent=1, default=str))
    plot(png, **timeline)
    return [md, js, png]


def plot(path: Path, t0_ms: int, starts_ms: list[int], lags: list[tuple[int, int]], faults: list[Injected],
         title: str) -> None:
    """Tasks started per second, and due -> started lag by due time, with the faults shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, lag) = plt.subplots(2, 1, figsize=(15, 8), sharex=True)
    seconds = [(s - t0_ms) / 1000 for s in starts_ms]
    if seconds:
        rate.hist(seconds, bins=range(int(min(seconds)), int(max(seconds)) + 2), histtype="stepfilled", alpha=0.7)
    lag.plot([(d - t0_ms) / 1000 for d, _ in lags], [max(v, 1) for _, v in lags], ".", markersize=1, alpha=0.4)
    lag.set_yscale("log")
    colors = plt.get_cmap("tab20")
    names = list(dict.fromkeys(f.name for f in faults))
    for fault in faults:
        color = colors(names.index(fault.name) % 20)
        for ax in (rate, lag):
            ax.axvspan((fault.start_ms - t0_ms) / 1000, max((fault.end_ms - t0_ms) / 1000,
                                                             (fault.start_ms - t0_ms) / 1000 + 0.5),
                       color=color, alpha=0.3, label=fault.name if ax is rate else None)
    handles, labels = rate.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    rate.legend(unique.values(), unique.keys(), fontsize=8, ncol=4, loc="upper right")
    rate.set_ylabel("tasks started per second")
    lag.set_ylabel("due -> started (ms, log)")
    lag.set_xlabel("seconds since the first task was due")
    for ax in (rate, lag):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
