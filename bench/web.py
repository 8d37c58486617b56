"""Web view benchmark: how fast each page of ``celery delayed web`` answers with N tasks in the store.

Every page must answer from bounded reads, so its time should not grow with the
store.  The run fills one store with N tasks (default 1M; four task names, two
queues, due times spread over two days but a tenth of them a campaign due at one
ms a day ahead, plus 1,000 dead letters) and a second,
the baseline, with 1,000 tasks, starts a poller (leading every partition,
dispatching what falls due) and ``celery -A tasks delayed web`` (real processes)
on each, and requests every page R times, one after another, timing each
answer over HTTP.  Reported per page: p50 / p99 / max ms with N tasks and
with the baseline, and their p99 ratio; the issue's goal is p99 <= 200 ms.
Then the bulk count of one filter (a job, not a page: a walk of every match)
gives the walk's tasks/s.  With ``--screenshots``, headless Chromium (``scripts/services
browser``) saves the overview and upcoming pages of the big store as PNGs.

``python -m bench.web [--quick] [--tasks N] [--requests R] [--screenshots]``
Results (Markdown, JSON, a PNG of the p99s) go to ``bench/results/web-*``.
"""
from __future__ import annotations

import argparse
import dataclasses
import http.cookiejar
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from celery_delayed import store_of
from celery_delayed.envelope import Envelope
from celery_delayed.sandbox import remove_everything
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from celery_delayed.store.layout import member_of
from tasks import create_app
from tasks.processes import Processes, free_port, wait_for

from .common import RESULTS, exclusive, new_overrides, summary, versions
from .dispatch import capture_template, envelope_bytes, git_state

console = Console(width=None if Console().is_terminal else 150)
NAMES = ("app.mail.send", "app.billing.charge", "app.reports.build", "app.push.notify")
QUEUES = ("mail", "default")
SPREAD_MS = 2 * 86_400_000
CHUNK = 20_000
BASELINE = 1_000
DEAD_LETTERS = 1_000
GOAL_P99_MS = 200


def _chunk(job: tuple[dict[str, Envelope], int, int, int]) -> list[tuple[str, int, bytes]]:
    """``count`` stored items of the four task names (run in a pool process)."""
    templates, first_due, count, seed, spread_ms = job
    rng = random.Random(seed)
    items = []
    for i in range(count):
        name = NAMES[i % len(NAMES)]
        task_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        due_ms = first_due + rng.randrange(spread_ms)
        items.append((task_id, due_ms, envelope_bytes(templates[name], QUEUES[i % 2], task_id, due_ms)))
    return items


def fill(app: Any, n: int, templates: dict[str, Envelope], progress: Progress) -> tuple[list[str], str]:
    """``n`` tasks (a tenth of them a campaign due at one ms, a day ahead) and the dead letters into
    ``app``'s store; a few task ids to open pages of, and a cursor halfway through the campaign."""
    store = store_of(app)
    first_due = store.now_ms() + 60_000
    campaign = n // 10
    jobs = [(templates, first_due, min(CHUNK, n - campaign - start), start, SPREAD_MS)
            for start in range(0, n - campaign, CHUNK)]
    jobs += [(templates, first_due + SPREAD_MS // 2, min(CHUNK, campaign - start), n + start, 1)
             for start in range(0, campaign, CHUNK)]
    bar = progress.add_task(f"store {n:,} tasks", total=n)
    some: list[str] = []
    stored: list[tuple[str, int]] = []  # the campaign's (id, due)
    with mp.get_context("fork").Pool(os.cpu_count() or 2) as pool:
        for job, items in zip(jobs, pool.imap(_chunk, jobs)):
            store.schedule_many(items)
            some.append(items[0][0])
            if job[4] == 1:
                stored += [(task_id, due) for task_id, due, _ in items]
            progress.advance(bar, len(items))
    letters = DeadLetters(store)
    for i, (task_id, _, data) in enumerate(_chunk((templates, first_due, DEAD_LETTERS, 7, SPREAD_MS))):
        letters.add(DeadLetter(task_id=task_id, reason="boom" if i % 3 else "unknown task", source="worker",
                               message=data, traceback="Traceback (most recent call last): ..."))
    middle = sorted(stored, key=lambda s: member_of(s[0]))[len(stored) // 2]
    return some, f"{middle[1]}:{member_of(middle[0]).hex()}"


def time_pages(base: str, task_ids: list[str], campaign: str, requests: int, progress: Progress
               ) -> dict[str, dict[str, float]]:
    """Per page, the summary of ``requests`` answer times (ms), each request on a new connection."""
    with _open(f"{base}/api/upcoming?limit=50") as reply:
        cursor = json.loads(reply.read())["cursor"]
    for _ in range(18):  # the 20th page of the schedule
        with _open(f"{base}/api/upcoming?limit=50&after={cursor}") as reply:
            cursor = json.loads(reply.read())["cursor"]
    pages = {
        "overview": "/", "overview (api)": "/api/overview", "upcoming, first page": "/upcoming",
        "upcoming, 20th page": f"/upcoming?after={cursor}", "upcoming, halfway into a campaign":
        f"/upcoming?after={campaign}", "upcoming, task filter": f"/upcoming?task={NAMES[2]}",
        "upcoming, due window + queue": "/upcoming?queue=mail&due_after=now%2B1d&due_before=now%2B25h",
        "upcoming, no match (budget)": "/upcoming?task=no.such.task", "task page": "/tasks/{id}",
        "search by id": "/upcoming?id={id}", "dead letters": "/dead-letters",
        "dead letters, reason filter": "/dead-letters?reason=unknown",
    }
    bar = progress.add_task("pages", total=len(pages) * requests)
    timings = {}
    for name, path in pages.items():
        times = []
        for i in range(requests):
            url = base + path.replace("{id}", task_ids[i % len(task_ids)])
            started = time.perf_counter()
            with _open(url) as reply:
                reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"{url}: HTTP {reply.status}")
            times.append((time.perf_counter() - started) * 1000)
            progress.advance(bar)
        timings[name] = summary(times)
    return timings


def bulk_count(base: str) -> dict[str, float]:
    """The bulk count of one task name: matches, seconds, tasks examined per second."""
    started = time.perf_counter()
    with _open(f"{base}/api/bulk", {"action": "count", "task": NAMES[1]}) as reply:
        job = json.loads(reply.read())
    while job["state"] == "running":
        time.sleep(0.2)
        with _open(f"{base}/api/jobs/{job['id']}") as reply:
            job = json.loads(reply.read())
    seconds = time.perf_counter() - started
    if job["state"] != "done":
        raise RuntimeError(f"bulk count failed: {job['error']}")
    return {"matched": job["matched"], "examined": job["examined"], "seconds": round(seconds, 2),
            "examined_per_s": round(job["examined"] / seconds)}


def screenshots(base: str) -> list[Path]:
    from tasks.browser import headless_chromium

    shots = []
    with tempfile.TemporaryDirectory() as profile:
        browser = headless_chromium(Path(profile))
        try:
            for name, path in (("overview", "/"), ("upcoming", f"/upcoming?task={NAMES[0]}&limit=25")):
                browser.get(base + path)
                shots.append(RESULTS / f"web-{name}.png")
                browser.save_screenshot(str(shots[-1]))
        finally:
            browser.quit()
    return shots


def run_case(n: int, requests: int, templates: dict[str, Envelope], logdir: Path, shots: bool,
             progress: Progress) -> dict[str, Any]:
    """One store of ``n`` tasks: its pages' timings (and the bulk count), then everything removed."""
    overrides = {**new_overrides(16), "delayed_lease_ttl": 5}
    app = create_app(**overrides)
    procs = Processes(logdir, overrides)
    try:
        task_ids, campaign = fill(app, n, templates, progress)
        port, metrics = free_port(), free_port()
        procs.start(f"poller-{n}", "delayed", "poller", "--metrics-port", str(metrics))  # leads, dispatches
        procs.start(f"web-{n}", "delayed", "web", "--port", str(port), "--metrics",
                    f"http://127.0.0.1:{metrics}/metrics")
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), 60, "celery delayed web to answer")
        result = {"tasks": n, "pages": time_pages(base, task_ids, campaign, requests, progress),
                  "bulk_count": bulk_count(base)}
        if shots:
            result["screenshots"] = [str(p.relative_to(RESULTS.parent.parent)) for p in screenshots(base)]
        return result
    finally:
        procs.stop_all()
        remove_everything(store_of(app).settings)


_COOKIES = http.cookiejar.CookieJar()
_OPENER = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(_COOKIES))



def _open(url: str, form: dict | None = None, timeout: float = 30) -> Any:
    """A request as a browser makes it: cookies kept, a form posted with the XSRF token of the cookie."""
    data = None
    if form is not None:
        xsrf = next((c.value for c in _COOKIES if c.name == "_xsrf"), None)
        if xsrf is None:
            _OPENER.open(url.split("/api/")[0] + "/", timeout=timeout).read()
            xsrf = next(c.value for c in _COOKIES if c.name == "_xsrf")
        data = urllib.parse.urlencode({**form, "_xsrf": xsrf}).encode()
    return _OPENER.open(urllib.request.Request(url, data=data), timeout=timeout)


def _answers(base: str) -> bool:
    try:
        with _open(base + "/api/overview", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def report(big: dict[str, Any], small: dict[str, Any], ran: dict[str, str], name: str) -> Path:
    """The table (printed and written as Markdown), the JSON, and a PNG of the p99s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, base_n = big["tasks"], small["tasks"]
    each = big["pages"]["overview"]["count"]
    table = Table(title=f"web pages with {n:,} tasks vs {base_n:,} (ms, {each} requests each)")
    for column in ("page", f"p50 @{n:,}", f"p99 @{n:,}", f"max @{n:,}", f"p99 @{base_n:,}", "p99 ratio"):
        table.add_column(column, justify="left" if column == "page" else "right")
    lines = [f"| page | p50 ms @{n:,} | p99 ms @{n:,} | max ms @{n:,} | p99 ms @{base_n:,} | p99 ratio |",
             "|---|---|---|---|---|---|"]
    for page, s in big["pages"].items():
        b = small["pages"][page]
        row = [page, f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}", f"{b['p99']:.1f}",
               f"{s['p99'] / b['p99']:.2f}x"]
        table.add_row(*row, style="red" if s["p99"] > GOAL_P99_MS else None)
        lines.append("| " + " | ".join(row) + " |")
    console.print(table)
    count = big["bulk_count"]
    tail = (f"bulk count of one task name with {n:,} tasks: {count['matched']:,} matched, {count['examined']:,} "
            f"examined in {count['seconds']} s ({count['examined_per_s']:,}/s)")
    console.print(tail)
    worst = max(s["p99"] for s in big["pages"].values())
    met = "met" if worst <= GOAL_P99_MS else "NOT met"
    verdict = f"slowest page p99 {worst:.1f} ms (goal <= {GOAL_P99_MS} ms: {met})"
    console.print(verdict)
    head = ", ".join(f"{k} {v}" for k, v in ran.items())
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n{head}\n\n" + "\n".join(lines) + f"\n\n{tail}\n\n{verdict}\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({"versions": ran, "big": big, "baseline": small}, indent=2))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    pages = list(big["pages"])
    y = range(len(pages))
    ax.barh([i + 0.2 for i in y], [big["pages"][p]["p99"] for p in pages], 0.4, label=f"{n:,} tasks")
    ax.barh([i - 0.2 for i in y], [small["pages"][p]["p99"] for p in pages], 0.4, label=f"{base_n:,} tasks")
    ax.axvline(GOAL_P99_MS, color="red", linestyle="--", label=f"goal {GOAL_P99_MS} ms")
    ax.set_yticks(list(y), pages)
    ax.invert_yaxis()
    ax.set_xlabel("p99 answer time, ms")
    ax.set_title("celery delayed web: page p99 by store size")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    return RESULTS / f"{name}.md"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.web", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20,000 tasks, 10 requests a page (~1 min)")
    parser.add_argument("--tasks", type=int, help="tasks in the big store (default 1,000,000)")
    parser.add_argument("--requests", type=int, help="requests per page (default 50)")
    parser.add_argument("--screenshots", action="store_true",
                        help="save the overview and upcoming pages of the big store as PNGs (needs Chromium)")
    args = parser.parse_args(argv)
    n = args.tasks or (20_000 if args.quick else 1_000_000)
    requests = args.requests or (10 if args.quick else 50)
    name = "web-quick" if args.quick else "web-latest"
    with exclusive("bench.web"):
        ran = {**versions(), **git_state()}
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in ran.items()))
        base = capture_template(16)
        templates = {task: dataclasses.replace(base, headers={**base.headers, "task": task}) for task in NAMES}
        logdir = Path(tempfile.mkdtemp(prefix="bench-web-"))
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            small = run_case(BASELINE, requests, templates, logdir, False, progress)
            big = run_case(n, requests, templates, logdir, args.screenshots, progress)
        console.print(f"results: {report(big, small, ran, name)}")


if __name__ == "__main__":
    main()
