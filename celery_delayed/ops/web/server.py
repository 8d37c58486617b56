"""``celery delayed web``: the schedule and the dead letters in a browser, and the same as JSON under ``/api``.

Tornado (installed with Flower), server-rendered pages, no script at all: the
pages work offline.  Safe by default: it binds 127.0.0.1 and, without
credentials, answers only requests naming this machine as their Host (a page
elsewhere cannot reach it by DNS rebinding); with ``--basic-auth`` or
``--token`` every request must authenticate; every change is a POST, which a
browser must send from one of these pages (same Origin) with the page's XSRF
token (a request authenticated by a bearer token is not sent by a browser on
its own, so the API takes it without one); no page may be framed; a body is
read only once the headers authenticate, and no larger than a form's.  Store
calls run in a thread pool, never on the loop.
"""
from __future__ import annotations

import base64
import hmac
import json
import secrets
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from collections.abc import Callable

import redis
import tornado.web
from tornado import httputil
from tornado.ioloop import IOLoop

from celery_delayed import inert
from celery_delayed.ops.browse import Filter, parse_move, parse_when
from celery_delayed.ops.web.views import Job, JobRunning, LetterFilter, Views
from celery_delayed.store.outcomes import StoreUnavailable, TaskInFlight, TaskNotScheduled

logger = inert.logger(__name__)
HERE = Path(__file__).parent
#: Most rows a list page shows.
MAX_ROWS = 500
#: Fewest characters of a --token.
MIN_TOKEN = 16
#: Largest request body read (the forms send a few short fields), and how long it may take to arrive.
MAX_BODY, BODY_TIMEOUT = 64 * 1024, 10.0
#: Days a message the server put in a link (``/upcoming?done=...``) stays shown.
DONE_DAYS = 1


class Problem(tornado.web.HTTPError):
    """A refusal whose message the client sees (JSON or page), kept out of the HTTP status line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.message = message


class Credentials:
    """The credentials a request must carry (none: any request passes), checked on its headers alone."""

    def __init__(self, basic_auth: str | None, token: str | None) -> None:
        self.basic, self.token = basic_auth, token

    def __bool__(self) -> bool:
        return bool(self.basic or self.token)

    def by_token(self, headers: httputil.HTTPHeaders) -> bool:
        return self.token is not None and hmac.compare_digest(_given(headers, "bearer"), self.token.encode())

    def by_password(self, headers: httputil.HTTPHeaders) -> bool:
        return self.basic is not None and hmac.compare_digest(_given(headers, "basic"),
                                                              base64.b64encode(self.basic.encode()))

    def admit(self, headers: httputil.HTTPHeaders) -> bool:
        return not self or self.by_token(headers) or self.by_password(headers)


def _given(headers: httputil.HTTPHeaders, scheme: str) -> bytes:
    """The Authorization header's credentials when its scheme is ``scheme`` (in any case, RFC 7235)."""
    given, _, credentials = headers.get("Authorization", "").partition(" ")
    return credentials.strip().encode() if given.lower() == scheme else b""


class Headers(tornado.web.RequestHandler):
    """The security headers, on every answer (pages, API, static files, Tornado's own 404 and 500)."""

    def set_default_headers(self) -> None:
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'self'; form-action 'self'; "
                                                   "frame-ancestors 'none'; base-uri 'none'")
        self.set_header("Referrer-Policy", "same-origin")  # no-referrer would make a form's Origin "null"
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Cache-Control", "no-store")  # pages show arguments and headers


class Static(Headers, tornado.web.StaticFileHandler):
    """The stylesheet; a path no file can have (a NUL byte) is a 400, not a 500."""

    def parse_url_path(self, url_path: str) -> str:
        if "\0" in url_path:
            raise tornado.web.HTTPError(400, "a path with a NUL byte")
        return super().parse_url_path(url_path)


class Base(Headers):
    """Authentication, XSRF, errors, and one answer as a page or as JSON under ``/api``."""

    views: Views

    def initialize(self, views: Views, credentials: Credentials, hosts: frozenset[str]) -> None:
        self.views, self._credentials, self._hosts = views, credentials, hosts

    @property
    def api(self) -> bool:
        return self.request.path.startswith("/api/")

    def _check_host_and_origin(self) -> None:
        """Without credentials, only a Host of this machine (DNS rebinding); a browser's POST only from
        these pages (its Origin is this server)."""
        if not self._credentials and _hostname(self.request.host) not in self._hosts:
            raise Problem(403, f"Host {self.request.host!r} is not one this server answers to "
                               "(--allowed-host adds one)")
        origin = self.request.headers.get("Origin")
        if self.request.method == "POST" and origin and urllib.parse.urlsplit(origin).netloc != self.request.host:
            raise Problem(403, f"a change from another site ({origin}) is refused")

    def prepare(self) -> None:
        if not self._credentials.admit(self.request.headers):
            if self._credentials.basic:
                self.set_header("WWW-Authenticate", 'Basic realm="celery-delayed"')
            raise Problem(401, "credentials required")
        self._check_host_and_origin()
        if not self.api:
            _ = self.xsrf_token  # reading it sets the XSRF cookie on every page, so each page's forms can be posted

    def check_xsrf_cookie(self) -> None:
        """Run first for a POST (before :meth:`prepare`). A bearer token is never attached by a browser
        on its own: no XSRF check for it."""
        self._check_host_and_origin()
        if not self._credentials.by_token(self.request.headers):
            if not self._credentials.admit(self.request.headers):
                raise Problem(401, "credentials required")
            super().check_xsrf_cookie()

    async def call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a store call in the pool, turning the store's refusals into HTTP errors."""
        try:
            return await IOLoop.current().run_in_executor(self.settings["pool"], lambda: fn(*args, **kwargs))
        except tornado.web.HTTPError:
            raise
        except TaskNotScheduled as exc:
            raise Problem(404, str(exc)) from None
        except (TaskInFlight, JobRunning) as exc:
            raise Problem(409, str(exc)) from None
        except StoreUnavailable as exc:
            raise Problem(503, f"store unavailable: {exc}") from None
        except redis.RedisError as exc:  # a read made outside the store's wrapper (the dead letters)
            raise Problem(503, f"store unavailable: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise Problem(400, str(exc)) from None

    def answer(self, template: str, data: dict[str, Any], status: int = 200, **page: Any) -> None:
        """``data`` as JSON under /api, else rendered by ``template`` (with the page-only ``page`` values)."""
        self.set_status(status)
        if self.api:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(data, default=str))
        else:
            self.render(template, **data, **page)

    def done(self, data: dict[str, Any], then: str) -> None:
        """After a change: JSON for the API, else back to a page (POST, redirect, GET)."""
        if self.api:
            self.answer("", data)
        else:
            self.redirect(then, status=303)

    def started(self, job: Job) -> None:
        """After a bulk action began: its job as JSON for the API (202), else its page."""
        if self.api:
            self.answer("", job.describe(), status=202)
        else:
            self.redirect(f"/jobs/{job.id}", status=303)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """The error as JSON or a page; a 4xx of Tornado's own (XSRF) says what was wrong, not only 'Forbidden'."""
        message = self._reason
        error = kwargs.get("exc_info", (None, None))[1]
        if isinstance(error, Problem):
            message = error.message
        elif isinstance(error, tornado.web.HTTPError) and error.log_message and status_code < 500:
            message = error.log_message % error.args
        if self.api:
            self.finish({"error": message, "status": status_code})
        else:
            self.render("error.html", status=status_code, message=message)

    def arg(self, name: str) -> str | None:
        value = self.get_argument(name, "").strip()
        return value or None

    def filter(self, now_ms: int) -> Filter:
        """The filter of the request's fields: task, queue, due_after, due_before, id_prefix."""
        try:
            return Filter(task=self.arg("task"), queue=self.arg("queue"), id_prefix=self.arg("id_prefix"),
                          due_after=parse_when(self.arg("due_after"), now_ms),
                          due_before=parse_when(self.arg("due_before"), now_ms))
        except ValueError as exc:
            raise Problem(400, str(exc)) from None

    def limit(self, default: int) -> int:
        try:
            return max(1, min(MAX_ROWS, int(self.get_argument("limit", str(default)))))
        except ValueError:
            raise Problem(400, "limit must be a number") from None

    def get_template_namespace(self) -> dict[str, Any]:
        return {**super().get_template_namespace(), "utc": _utc, "local": _local, "rel": _relative,
                "age": _age, "bars": _bars, "next_page": _next_page, "quote": _quote,
                "json_encode_pretty": lambda value: json.dumps(value, indent=2, default=str)}


class Overview(Base):
    async def get(self) -> None:
        self.answer("overview.html", await self.call(self.views.overview))


class Upcoming(Base):
    async def get(self) -> None:
        task_id = self.arg("id")
        if task_id and not self.api:  # search by id: that task's page
            return self.redirect(f"/tasks/{_quote(task_id)}")
        query = {name: self.get_query_argument(name) for name in self.request.query_arguments}  # bad bytes: 400
        done = tornado.web.decode_signed_value(self.settings["cookie_secret"], "done", query.pop("done", ""),
                                               max_age_days=DONE_DAYS)  # only a message of this server
        now_ms = await self.call(self.views.store.now_ms)
        data = await self.call(self.views.upcoming, self.filter(now_ms), self.arg("after"), self.limit(50))
        self.answer("upcoming.html", data, query=query, done=done and done.decode())


class Task(Base):
    async def get(self, task_id: str) -> None:
        info = await self.call(self.views.task, task_id)
        if info is None:
            dead = await self.call(self.views.letters.holds, task_id)
            raise Problem(404, f"task {task_id} is not in the store (never scheduled, "
                                        "dispatched, or cancelled)" + ("; it is a dead letter" if dead else ""))
        self.answer("task.html", info)


class TaskAction(Base):
    async def post(self, task_id: str, action: str) -> None:
        if action == "cancel":
            data = await self.call(self.views.cancel, task_id)
            done = self.create_signed_value("done", f"cancelled {task_id}").decode()  # no link shows other text
            return self.done(data, f"/upcoming?{urllib.parse.urlencode({'done': done})}")
        if action == "run-now":
            data = await self.call(self.views.run_now, task_id)
        elif action == "reschedule":
            data = await self.call(self.views.reschedule, task_id, self.arg("eta"), self.arg("shift"))
        else:
            raise Problem(404, f"no action {action!r}")
        self.done(data, f"/tasks/{_quote(task_id)}")


class QueueAction(Base):
    async def post(self, action: str) -> None:
        """Pause, resume or rate-limit (argument ``rate``) the queue named by the ``queue`` argument."""
        queue = self.get_argument("queue", "")
        if action == "rate":
            data = await self.call(self.views.queue_rate, queue, self.arg("rate"))
        else:
            data = await self.call(self.views.queue_action, queue, action)
        self.done(data, "/#queues")


class Bulk(Base):
    async def post(self) -> None:
        now_ms = await self.call(self.views.store.now_ms)
        action = self.get_argument("action", "count")
        try:
            to_ms, shift_ms = parse_move(self.arg("eta"), self.arg("shift"), now_ms) \
                if action == "reschedule" else (None, None)
        except ValueError as exc:
            raise Problem(400, str(exc)) from None
        self.started(await self.call(self.views.bulk, action, self.filter(now_ms), shift_ms, to_ms,
                                     self.arg("confirm")))


class JobPage(Base):
    def get(self, job_id: str) -> None:
        job = self.views.jobs.get(job_id)
        if job is None:
            raise Problem(404, f"no job {job_id} (this process did not start it, or forgot it)")
        self.answer("job.html", job.describe())


class DeadLetterList(Base):
    async def get(self) -> None:
        data = await self.call(self.views.dead_letters, self.arg("task"), self.arg("reason"), self.limit(100))
        self.answer("dead_letters.html", data)


class DeadLettersAction(Base):
    async def post(self, action: str) -> None:
        """Requeue or purge every dead letter of the filter (task, reason), as a job."""
        if action not in ("requeue", "purge"):
            raise Problem(404, f"no action {action!r}")
        flt = LetterFilter(task=self.arg("task"), reason=self.arg("reason"))
        self.started(await self.call(self.views.letters_bulk, action, flt, self.get_argument("confirm", "")))


class DeadLetter(Base):
    async def get(self, task_id: str) -> None:
        info = await self.call(self.views.dead_letter, task_id)
        if info is None:
            raise Problem(404, f"no dead letter with task id {task_id}")
        self.answer("dead_letter.html", info)


class DeadLetterAction(Base):
    async def post(self, task_id: str, action: str) -> None:
        if action not in ("requeue", "purge"):
            raise Problem(404, f"no action {action!r}")
        data = await self.call(getattr(self.views, action), [task_id])
        if data.get("unknown"):
            raise Problem(404, f"no dead letter with task id {task_id}")
        if data.get("kept"):
            raise Problem(409, f"cannot requeue {data['kept_letters'][0]}")
        self.done(data, "/dead-letters")


class ScheduleList(Base):
    async def get(self) -> None:
        prefix = self.get_argument("prefix", "")
        try:
            data = await self.call(self.views.schedules, prefix, self.arg("after"), self.limit(50))
        except ValueError as exc:  # a cursor no page gave
            raise Problem(400, str(exc)) from None
        self.answer("schedules.html", data)


class Schedule(Base):
    async def get(self, schedule_id: str) -> None:
        info = await self.call(self.views.schedule, schedule_id)
        if info is None:
            raise Problem(404, f"no recurring schedule {schedule_id}")
        self.answer("schedule.html", info)


class ScheduleAction(Base):
    async def post(self, schedule_id: str, action: str) -> None:
        data = await self.call(self.views.schedule_action, schedule_id, action)
        if data is None:
            raise Problem(404, f"no recurring schedule {schedule_id}")
        self.done(data, f"/schedules/{_quote(schedule_id)}")


def make_app(views: Views, basic_auth: str | None = None, token: str | None = None,
             allowed_hosts: tuple[str, ...] = (), cookie_secret: str | None = None) -> tornado.web.Application:
    """The web view's routes; each page's path under ``/api`` answers the same as JSON.  Without
    credentials, requests must name this machine (or one of ``allowed_hosts``) as their Host."""
    if basic_auth is not None and not basic_auth.partition(":")[2]:
        raise ValueError("--basic-auth must be user:password, the password not empty")
    if token is not None and len(token) < MIN_TOKEN:
        raise ValueError(f"--token must be at least {MIN_TOKEN} characters (an empty one would let anyone in)")
    hosts = frozenset({"127.0.0.1", "localhost", "::1", *(_hostname(h) for h in allowed_hosts)})
    credentials = Credentials(basic_auth, token)
    init = {"views": views, "credentials": credentials, "hosts": hosts}
    routes = [(r"/", Overview), (r"/upcoming", Upcoming), (r"/tasks/([^/]+)", Task),
              (r"/tasks/([^/]+)/(cancel|reschedule|run-now)", TaskAction), (r"/bulk", Bulk),
              (r"/queues/(pause|resume|rate)", QueueAction), (r"/schedules", ScheduleList),
              (r"/schedules/([^/]+)", Schedule), (r"/schedules/([^/]+)/(pause|resume|run-now)", ScheduleAction),
              (r"/jobs/(\w+)", JobPage), (r"/dead-letters", DeadLetterList),
              (r"/bulk/dead-letters/(requeue|purge)", DeadLettersAction), (r"/dead-letters/([^/]+)", DeadLetter),
              (r"/dead-letters/([^/]+)/(requeue|purge)", DeadLetterAction)]
    handlers = [(path, cls, init) for path, cls in routes]
    handlers += [("/api/overview" if path == "/" else "/api" + path, cls, init) for path, cls in routes]
    return Application(
        handlers, credentials, template_path=str(HERE / "templates"), static_path=str(HERE / "static"),
        static_handler_class=Static, default_handler_class=NotFound, default_handler_args=init,
        xsrf_cookies=True, cookie_secret=cookie_secret or secrets.token_hex(32),
        pool=ThreadPoolExecutor(8, thread_name_prefix="delayed-web"), autoescape="xhtml_escape")


class NotFound(Base):
    """A path no route has: a 404 like the others (behind the credentials, with the security headers)."""

    def prepare(self) -> None:
        super().prepare()
        raise Problem(404, f"no page {self.request.path}")


class Application(tornado.web.Application):
    """Reads a request's body only once its headers carry the credentials, and then at most
    :data:`MAX_BODY` bytes within :data:`BODY_TIMEOUT` seconds, however the server was made."""

    def __init__(self, handlers: list, credentials: Credentials, **settings: Any) -> None:
        super().__init__(handlers, **settings)
        self.credentials = credentials

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection
                      ) -> httputil.HTTPMessageDelegate:
        return _HeadersFirst(super().start_request(server_conn, request_conn), request_conn, self.credentials)


class _HeadersFirst(httputil.HTTPMessageDelegate):
    """Caps the body of the request ``delegate`` handles once its headers are in: none without credentials
    (the connection answers 400 at once, before a byte of it is read)."""

    def __init__(self, delegate: httputil.HTTPMessageDelegate, connection: Any, credentials: Credentials) -> None:
        self.delegate, self.connection, self.credentials = delegate, connection, credentials

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> Any:
        self.connection.set_max_body_size(MAX_BODY if self.credentials.admit(headers) else 0)
        self.connection.set_body_timeout(BODY_TIMEOUT)
        return self.delegate.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        return self.delegate.data_received(chunk)

    def finish(self) -> None:
        self.delegate.finish()

    def on_connection_close(self) -> None:
        self.delegate.on_connection_close()


def _hostname(host: str) -> str:
    """The name of a Host header or ``--allowed-host`` value, without its port or IPv6 brackets."""
    return urllib.parse.urlsplit(f"//{host}").hostname or host


# -- formatting for the templates ---------------------------------------------
def _quote(value: str) -> str:
    """A task id as one path segment (a '/' in it included)."""
    return urllib.parse.quote(value, safe="")



def _utc(ms: int | None) -> str:
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _local(ms: int | None) -> str:
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _age(seconds: float | None) -> str:
    """A compact age: 42s, 5m, 3h, 2d."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def _relative(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return "-"
    seconds = (ms - now_ms) / 1000
    return f"in {_age(seconds)}" if seconds >= 0 else f"{_age(-seconds)} ago"


def _next_page(query: dict[str, str], cursor: str) -> str:
    """The query string of the next page: the same filter, after ``cursor``."""
    return urllib.parse.urlencode({**query, "after": cursor})


def _bars(histogram: dict[str, Any], label: Callable[[int], str], width: int = 720, height: int = 120) -> str:
    """An inline SVG bar chart of a histogram (no script, no external resource); a title per bar."""
    counts, start, step = histogram["counts"], histogram["start_ms"], histogram["bin_s"] * 1000
    top = max(counts, default=0) or 1
    w = width / max(1, len(counts))
    bars = []
    for i, n in enumerate(counts):
        h = (height - 14) * n / top
        when = _utc(start + i * step)
        bars.append(f'<rect x="{i * w:.1f}" y="{height - 14 - h:.1f}" width="{max(1.0, w - 1):.1f}" '
                    f'height="{h:.1f}"><title>{when}: {n:,} tasks</title></rect>')
    ticks = "".join(f'<text x="{i * w:.1f}" y="{height - 2}">{label(start + i * step)}</text>'
                    for i in range(0, len(counts), max(1, len(counts) // 6)))
    return (f'<svg class="bars" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
            f'{"".join(bars)}{ticks}</svg>')
