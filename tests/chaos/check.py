"""The ledger check of a chaos run, by task id, and what each fault is to blame for.

Pure functions of what the run recorded: the plan, the executions and side
effects in the ledger, the records on Kafka, the faults as injected.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .faults import Injected
from .load import Planned

#: A task started within this many ms of its due time counts as dispatched on time.
ON_TIME_MS = 1000
#: Dispatch is back once every task due within a window this long (ms) started on time.
BACK_WINDOW_MS = 2000
#: A fault up to this long (ms) before the first copy of a duplicate may have caused it.
CAUSE_SLACK_MS = 2000
#: redis-server with ``appendfsync everysec`` may lose about this much (ms) of writes to a kill -9.
FSYNC_WINDOW_MS = 2000
#: A Redis Cluster primary killed with ``kill -9`` may take writes not yet sent to its replica (asynchronous
#: replication: milliseconds' worth; this is generous) with it, unless ``delayed_schedule_wait`` waited for them.
REPLICATION_WINDOW_MS = 2000


@dataclass
class Row:
    """What one kind of fault is to blame for."""

    fault: str
    injected: int = 0
    lost: int = 0
    lost_why: dict[str, int] = field(default_factory=dict)  # reason -> tasks
    duplicate_deliveries: int = 0
    duplicate_runs: int = 0
    duplicate_effects: int = 0
    recovery_s: list[float | str | None] = field(default_factory=list)
    dispatch_recovery_s: list[float | str | None] = field(default_factory=list)


def nearest_before(faults: list[Injected], t_ms: int) -> Injected | None:
    """The fault that started last at or before ``t_ms``."""
    starts = [f.start_ms for f in faults]
    i = bisect.bisect_right(starts, t_ms)
    return faults[i - 1] if i else None


def caused(faults: list[Injected], first_ms: int, again_ms: int) -> Injected | None:
    """The fault to blame for a second copy at ``again_ms`` of something first seen at ``first_ms``: the
    first fault started between just before the first copy and the second, else the last one before it."""
    for fault in faults:
        if first_ms - CAUSE_SLACK_MS <= fault.start_ms <= again_ms:
            return fault
    return nearest_before(faults, again_ms)


def nearest(faults: list[Injected], t_ms: int) -> Injected | None:
    """The fault whose span is closest to ``t_ms`` (0 inside it)."""
    return min(faults, key=lambda f: max(f.start_ms - t_ms, t_ms - f.end_ms, 0), default=None)


def recovery_s(fault: Injected, on_time: list[tuple[int, bool]], load_end_ms: int) -> float | str | None:
    """Seconds from the fault's start until dispatch is back: the first due time after its end from
    which every task due within :data:`BACK_WINDOW_MS` started within :data:`ON_TIME_MS`.

    ``on_time`` is ``(due_ms, started on time)`` of every execution, sorted by due time; ``"after the
    load"`` when no such window starts before the load's last due time (``load_end_ms``): the fault ended
    too late to tell, or tasks were still late when the load ran out (a backlog worked off after it;
    not "never back": every one of them ran); None when no task due after the fault's end ran at all."""
    if fault.end_ms + BACK_WINDOW_MS > load_end_ms:
        return "after the load"
    dues = [d for d, _ in on_time]
    late = [d for d, ok in on_time if not ok]
    first = bisect.bisect_left(dues, fault.end_ms)
    for due in dues[first:]:
        if due + BACK_WINDOW_MS > dues[-1]:  # no whole window of tasks left: the run's tail
            break
        j = bisect.bisect_left(late, due)
        if j == len(late) or late[j] > due + BACK_WINDOW_MS:
            return round((due - fault.start_ms) / 1000, 1)
    return "after the load" if first < len(dues) else None


def _lost(tasks: list[Planned], runs: list[tuple], faults: list[Injected], pending: set[str]
          ) -> tuple[list[Planned], dict[str, Any]]:
    """Tasks (not revoked) whose final attempt never ran and that are not ``pending`` (still in the store
    or on Kafka when the run ended), each with the fault it is put down to."""
    attempts = defaultdict(dict)
    for task_id, attempt, _, start_ms, _ in runs:
        attempts[task_id].setdefault(attempt, start_ms)
    lost, blame = [], {}
    for task in tasks:
        if not task.expected or task.final_attempt in attempts[task.task_id] or task.task_id in pending:
            continue
        lost.append(task)
        first = attempts[task.task_id].get(0)
        t_ms = first if first is not None else (task.new_due_ms or task.due_ms)
        fault = nearest(faults, t_ms)
        why = "not explained"
        if first is not None and fault is not None and fault.name == "redis-kill9" \
                and fault.start_ms - FSYNC_WINDOW_MS <= first <= fault.start_ms:
            why = "retry written to Redis within the last fsync (everysec) before its kill -9"
        elif first is not None and fault is not None and fault.name == "redis-failover" \
                and fault.start_ms - REPLICATION_WINDOW_MS <= first <= fault.start_ms:
            why = ("retry acknowledged by the cluster primary just before its kill -9, not yet on its replica "
                   "(asynchronous replication)")
        elif first is not None:
            why = "first attempt ran, its retry never did"
        elif fault is not None and fault.name == "etcd-wipe" and t_ms >= fault.start_ms:
            why = "due after etcd lost its data; never dispatched"
        blame[task.task_id] = (fault.name if fault else "no fault", why)
    return lost, blame


def analyse(tasks: list[Planned], runs: list[tuple], effect_rows: dict[str, int], effect_attempts: dict[str, int],
            absorbed: int, deliveries: list[tuple[str, int, int]], faults: list[Injected],
            dead_letters: set[str], leftovers: dict[str, int], lag: dict[str, int], in_store: set[str],
            on_kafka: set[str]) -> dict[str, Any]:
    """The verdict of a run and the per-fault table (see the module doc of :mod:`tests.chaos`)."""
    rows = {name: Row(name) for name in dict.fromkeys(f.name for f in faults)}
    rows["(no fault)"] = Row("(no fault)")
    for fault in faults:
        rows[fault.name].injected += 1

    by_id = {t.task_id: t for t in tasks}
    _count_duplicates(rows, faults, runs, deliveries, effect_rows)
    done = {(r[0], r[1]) for r in runs}
    unfinished = {t.task_id for t in tasks if t.expected and (t.task_id, t.final_attempt) not in done}
    pending = unfinished & (in_store | on_kafka)
    lost, why = _lost(tasks, runs, faults, pending)
    for task_id, (fault, reason) in why.items():
        row = rows.get(fault, rows["(no fault)"])
        row.lost += 1
        row.lost_why[reason] = row.lost_why.get(reason, 0) + 1
    load_end = max(t.new_due_ms or t.due_ms for t in tasks)
    on_time = sorted((due_ms, start_ms - due_ms <= ON_TIME_MS) for _, _, _, start_ms, due_ms in firsts(runs))
    dispatched = _dispatched_on_time(tasks, runs, deliveries)
    for fault in faults:
        rows[fault.name].recovery_s.append(recovery_s(fault, on_time, load_end) if on_time else None)
        rows[fault.name].dispatch_recovery_s.append(recovery_s(fault, dispatched, load_end) if dispatched else None)
    verdict = _verdict(by_id, runs, effect_rows, effect_attempts, absorbed, dead_letters, leftovers, lag, lost,
                       rows, len(deliveries))
    verdict["unfinished"] = {"in_store": len(unfinished & in_store), "on_kafka": len(unfinished & on_kafka - in_store)}
    return verdict


def _dispatched_on_time(tasks: list[Planned], runs: list[tuple], deliveries: list[tuple[str, int, int]]
                        ) -> list[tuple[int, bool]]:
    """``(due_ms, put on Kafka within ON_TIME_MS)`` of the first Kafka record of each (task id, attempt)
    whose due time is known (a first attempt, or a retry whose first attempt recorded it), by due time:
    dispatch as the poller does it, whatever backlog the workers have."""
    due = {(t.task_id, 0): t.new_due_ms or t.due_ms for t in tasks}
    due.update({(r[0], r[1]): r[4] for r in runs if r[1] and r[4] is not None})
    first: dict[tuple[str, int], int] = {}
    for task_id, retries, ts_ms in deliveries:
        key = (task_id, retries)
        first[key] = min(ts_ms, first.get(key, ts_ms))
    return sorted((due[key], ts - due[key] <= ON_TIME_MS) for key, ts in first.items() if key in due)


def _count_duplicates(rows: dict[str, Row], faults: list[Injected], runs: list[tuple],
                      deliveries: list[tuple[str, int, int]], effect_rows: dict[str, int]) -> None:
    """Charge each second run of a (task id, attempt), second Kafka record of one, and extra side effect
    to the fault that :func:`caused` it."""
    def blame(first_ms: int, again_ms: int) -> Row:
        fault = caused(faults, first_ms, again_ms)
        return rows[fault.name] if fault else rows["(no fault)"]

    first_run: dict[tuple[str, int], int] = {}
    for task_id, attempt, _, start_ms, _ in runs:
        if (task_id, attempt) in first_run:
            blame(first_run[task_id, attempt], start_ms).duplicate_runs += 1
        first_run.setdefault((task_id, attempt), start_ms)
    first_copy: dict[tuple[str, int], int] = {}
    for task_id, retries, ts_ms in sorted(deliveries, key=lambda d: d[2]):
        if (task_id, retries) in first_copy:
            blame(first_copy[task_id, retries], ts_ms).duplicate_deliveries += 1
        first_copy.setdefault((task_id, retries), ts_ms)
    for task_id, count in effect_rows.items():
        if count > 1:  # the idempotency key makes this impossible unless the key itself is broken
            first = first_run.get((task_id, 0), 0)
            blame(first, first).duplicate_effects += count - 1


def firsts(runs: Iterable[tuple]) -> list[tuple]:
    """The first execution of each (task id, attempt)."""
    seen, firsts = set(), []
    for run in runs:
        if (run[0], run[1]) not in seen:
            seen.add((run[0], run[1]))
            firsts.append(run)
    return firsts


def _verdict(by_id: dict[str, Planned], runs: list[tuple], effect_rows: dict[str, int],
             effect_attempts: dict[str, int], absorbed: int, dead_letters: set[str], leftovers: dict[str, int],
             lag: dict[str, int], lost: list[Planned], rows: dict[str, Row], deliveries: int) -> dict[str, Any]:
    revoked_ran = sorted({r[0] for r in runs if by_id.get(r[0]) and by_id[r[0]].role == "revoke"})
    early = sorted({r[0] for r in runs if by_id.get(r[0]) and by_id[r[0]].role == "reschedule"
                    and r[3] < by_id[r[0]].new_due_ms})
    effect_ids = {t for t, p in by_id.items() if p.kind == "effect"}
    ran = {r[0] for r in runs}
    missing_effects = sorted(t for t in effect_ids & ran if effect_rows.get(t, 0) != 1)
    meant_to_fail = {t for t, p in by_id.items() if p.kind == "fail"}
    unknown = sorted({r[0] for r in runs} - set(by_id))
    checks = {
        "no task lost (its final attempt ran, or it is still in the store or on Kafka)": not lost,
        "side effects exactly once": not missing_effects and all(c == 1 for c in effect_rows.values()),
        "revoked tasks never ran": not revoked_ran,
        "rescheduled tasks not early": not early,
        "store empty": not any(leftovers.values()),
        "no consumer lag": not any(lag.values()),
        "DLQ holds exactly the failing tasks": dead_letters == meant_to_fail,
        "no unknown task ids ran": not unknown,
    }
    return {
        "checks": checks, "ok": all(checks.values()),
        "tasks": len(by_id), "executions": len(runs), "kafka_records": deliveries, "lost": len(lost),
        "lost_ids": [t.task_id for t in lost[:20]],
        "revoked_ran": revoked_ran[:20], "rescheduled_early": early[:20],
        "effects": {"tasks": len(effect_ids), "rows": sum(effect_rows.values()),
                    "attempts": sum(effect_attempts.values()), "absorbed_by_key": absorbed,
                    "missing_or_duplicate": missing_effects[:20]},
        "dlq": {"held": len(dead_letters), "meant_to_fail": len(meant_to_fail),
                "missing": sorted(meant_to_fail - dead_letters)[:20],
                "unexpected": sorted(dead_letters - meant_to_fail)[:20]},
        "store_left": leftovers, "consumer_lag": lag,
        "faults": [row.__dict__ for row in rows.values() if row.injected or _blamed(row)],
    }


def _blamed(row: Row) -> bool:
    return bool(row.lost or row.duplicate_deliveries or row.duplicate_runs or row.duplicate_effects)
