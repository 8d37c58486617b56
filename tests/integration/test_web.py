"""``celery delayed web`` over HTTP: every page and its /api twin, auth, XSRF, bulk actions, dead letters.

The server runs in a thread of the test on a free port, on the real store
(standalone Redis and the Redis Cluster); requests go through urllib with a
cookie jar, as a browser's would.
"""
from __future__ import annotations

import asyncio
import base64
import http.cookiejar
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import tornado.httpserver
import tornado.ioloop
import tornado.netutil
from celery import states
from confluent_kafka import Producer

from celery_delayed import store_of
from celery_delayed.kafka import ensure_topics
from celery_delayed.ops.web.server import make_app
from celery_delayed.ops.browse import Filter
from celery_delayed.ops.web.views import JobRunning, LetterFilter, Views
from celery_delayed.store.dlq import DeadLetter, DeadLetters
from tasks import create_app
from tasks.processes import free_port, wait_for

from .support import envelopes

pytestmark = pytest.mark.cluster_too

MINUTE = 60_000


class Server:
    """The web app on a free loopback port, in a thread with its own event loop."""

    def __init__(self, app, metrics_urls: tuple[str, ...] = (), **auth) -> None:
        self.app = app
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(asyncio.new_event_loop())
            self.loop = tornado.ioloop.IOLoop.current()
            tornado.httpserver.HTTPServer(make_app(Views(app, metrics_urls), **auth)).add_sockets(sockets)
            ready.set()
            self.loop.start()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)

    def stop(self) -> None:
        self.loop.add_callback(self.loop.stop)
        self.thread.join(10)


class Client:
    """A browser's part: cookies kept, the XSRF token sent with every form, redirects followed."""

    def __init__(self, base: str, headers: dict | None = None) -> None:
        self.base, self.headers = base, headers or {}
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def request(self, path: str, form: dict | None = None, xsrf: bool = True) -> tuple[int, str]:
        data = None
        if form is not None:
            if xsrf:
                if not any(c.name == "_xsrf" for c in self.jar):
                    self.request("/")  # any page sets the cookie
                form = {**form, "_xsrf": next(c.value for c in self.jar if c.name == "_xsrf")}
            data = urllib.parse.urlencode(form).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with self.opener.open(req, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def json(self, path: str, form: dict | None = None, **kw) -> tuple[int, dict]:
        status, body = self.request(path, form, **kw)
        return status, json.loads(body)


@pytest.fixture
def app(overrides):
    return create_app(**overrides)


@pytest.fixture
def server(app):
    srv = Server(app)
    yield srv
    srv.stop()


def _schedule(app, now: int) -> None:
    store = store_of(app)
    for k in range(6):
        store.schedule_many(envelopes(20, "mail", now + (k + 1) * MINUTE, prefix=f"mail-{k}", task="app.mail"))
        store.schedule_many(envelopes(10, "web", now + (k + 1) * MINUTE, prefix=f"web-{k}", task="app.page"))


def test_every_page_answers_and_its_api_twin_returns_the_same_data(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    client = Client(server.url)
    status, overview = client.json("/api/overview")
    assert status == 200 and overview["totals"]["scheduled"] == 180
    assert sum(overview["histogram"]["next_hour"]["counts"]) == 180 and len(overview["partitions"]) == 4
    status, page = client.request("/")
    assert status == 200 and 'id="scheduled">180<' in page and "<svg" in page

    status, upcoming = client.json("/api/upcoming?task=app.page&limit=7")
    assert status == 200 and len(upcoming["items"]) == 7 and {i["task"] for i in upcoming["items"]} == {"app.page"}
    status, page = client.request("/upcoming?task=app.page&limit=7")
    assert status == 200 and page.count('href="/tasks/web-') == 7 and 'id="next"' in page

    task_id = upcoming["items"][0]["task_id"]
    status, task = client.json(f"/api/tasks/{task_id}")
    assert status == 200 and task["task"] == "app.page" and task["state"] == "scheduled"
    status, page = client.request(f"/tasks/{task_id}")
    assert status == 200 and task_id in page and 'id="cancel"' in page
    status, page = client.request(f"/upcoming?id={task_id}")  # search by id: its page
    assert status == 200 and f'<code id="task-id">{task_id}</code>' in page

    status, error = client.json("/api/tasks/no-such-task")
    assert status == 404 and "not in the store" in error["error"]
    status, error = client.json("/api/upcoming?due_after=yesterday")
    assert status == 400 and "not a time: 'yesterday'" in error["error"]


def test_the_overview_counts_tasks_per_name_and_flags_the_names_the_app_does_not_register(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)  # app.mail and app.page: names the demo app does not register
    store_of(app).schedule_many(envelopes(4, "web", now + 2 * MINUTE, prefix="add", task="tasks.demo.add"))
    client = Client(server.url)
    client.json("/api/overview")  # starts the count, in the background (None until it ends)
    names = wait_for(lambda: client.json("/api/overview")[1]["task_names"], 30, "the count per task name")
    assert [(row["task"], row["count"], row["registered"]) for row in names["tasks"]] == [
        ("app.mail", 120, False), ("app.page", 60, False), ("tasks.demo.add", 4, True)]
    assert names["tasks"][0]["next_due_ms"] == now + MINUTE
    page = client.request("/")[1]
    flagged = page[page.index('id="task-names"'):].split("</table>")[0]
    assert flagged.count("NO: dead-lettered when due") == 2 and 'href="/upcoming?task=app.mail"' in flagged


def test_the_overview_answers_when_the_task_names_cannot_be_counted(app):
    """The app's task modules fail to import where the web view runs (a dependency only the workers
    have): the overview says so in place of the table, and the rest of the page shows."""
    app.conf.imports = ("tasks.no_such_module_for_the_web_test",)
    srv = Server(app)
    try:
        client = Client(srv.url)
        client.json("/api/overview")  # starts the count
        names = wait_for(lambda: client.json("/api/overview")[1]["task_names"], 30, "the count to end")
        assert "No module named 'tasks.no_such_module_for_the_web_test'" in names["error"]
        status, page = client.request("/")
        assert status == 200 and 'id="task-names-error"' in page and 'id="scheduled">' in page
    finally:
        srv.stop()


def test_upcoming_pages_through_every_partition_in_due_order(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    client = Client(server.url)
    seen, after = [], None
    while True:
        query = urllib.parse.urlencode({"queue": "mail", "limit": 13, **({"after": after} if after else {})})
        status, page = client.json(f"/api/upcoming?{query}")
        assert status == 200
        seen += page["items"]
        if (after := page["cursor"]) is None:
            break
    assert len(seen) == len({i["task_id"] for i in seen}) == 120
    assert {i["partition"] for i in seen} == {0, 1, 2, 3}
    assert [i["due_ms"] for i in seen] == sorted(i["due_ms"] for i in seen)


def test_cancel_reschedule_and_run_now_from_a_task_page(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    store, client = store_of(app), Client(server.url)
    status, _ = client.request("/tasks/mail-0-1/cancel", {})
    assert status == 200 and store.get("mail-0-1") is None
    assert app.AsyncResult("mail-0-1").state == states.REVOKED
    status, moved = client.json("/api/tasks/mail-0-2/reschedule", {"shift": "90m"})
    assert status == 200 and store.get("mail-0-2")["due_ms"] == now + MINUTE + 90 * MINUTE == moved["due_ms"]
    status, moved = client.json("/api/tasks/mail-0-3/reschedule", {"eta": "2031-01-02T03:04:05"})
    assert status == 200 and store.get("mail-0-3")["eta"] == "2031-01-02T03:04:05.000+00:00"
    status, _ = client.json("/api/tasks/mail-0-4/run-now", {})
    assert status == 200 and store.get("mail-0-4")["due_ms"] <= int(time.time() * 1000)
    status, error = client.json("/api/tasks/mail-0-1/cancel", {})
    assert status == 404 and "no scheduled task with id mail-0-1" in error["error"]


def test_bulk_cancel_by_filter_needs_its_count_and_leaves_the_others(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    store, client = store_of(app), Client(server.url)
    flt = {"task": "app.mail", "due_before": str(now + 4 * MINUTE)}
    status, error = client.json("/api/bulk", {**flt, "action": "cancel"})
    assert status == 400 and "count the tasks of this filter first" in error["error"]

    status, job = client.json("/api/bulk", {**flt, "action": "count"})
    assert status == 202
    counted = _finished(client, job["id"])
    assert counted["result"] == {"matched": 60}
    status, error = client.json("/api/bulk", {**flt, "task": "app.page", "action": "cancel", "confirm": job["id"]})
    assert status == 400  # a count of another filter does not confirm this one

    counted_id = job["id"]
    status, job = client.json("/api/bulk", {**flt, "action": "cancel", "confirm": counted_id})
    assert status == 202 and _finished(client, job["id"])["result"] == {"cancelled": 60, "dispatching": 0}
    status, error = client.json("/api/bulk", {**flt, "action": "cancel", "confirm": counted_id})
    assert status == 400 and "each count confirms one change" in error["error"]  # a double submit
    left = store.counts()
    assert sum(r["scheduled"] for r in left) == 120
    assert store.get("mail-3-0") is not None and store.get("web-0-0") is not None and store.get("mail-0-0") is None
    status, page = client.request(f"/jobs/{job['id']}")
    assert status == 200 and "cancelled: 60" in page


def test_bulk_reschedule_by_filter_shifts_every_match(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    store, client = store_of(app), Client(server.url)
    status, job = client.json("/api/bulk", {"queue": "web", "action": "count"})
    _finished(client, job["id"])
    status, job = client.json("/api/bulk", {"queue": "web", "action": "reschedule", "shift": "2m",
                                            "confirm": job["id"]})
    assert status == 202 and _finished(client, job["id"])["result"] == {"moved": 60, "dispatching": 0}
    assert store.get("web-5-3")["due_ms"] == now + 8 * MINUTE and store.get("mail-5-3")["due_ms"] == now + 6 * MINUTE
    status, job = client.json("/api/bulk", {"queue": "web", "action": "reschedule", "shift": "2m",
                                            "confirm": job["id"]})  # submitted twice: refused, shifted once
    assert status == 400 and store.get("web-5-3")["due_ms"] == now + 8 * MINUTE
    status, error = client.json("/api/bulk", {"action": "cancel", "confirm": "x"})
    assert status == 400 and "needs a filter" in error["error"]


def test_overview_shows_each_partitions_leader_and_the_pollers_dispatch_rate(app, processes):
    metrics_port = free_port()
    processes.start("poller", "delayed", "poller", "--metrics-port", str(metrics_port))
    server = Server(app, metrics_urls=(f"http://127.0.0.1:{metrics_port}/metrics",))
    try:
        store_of(app).schedule_many(envelopes(50, "q", int(time.time() * 1000), prefix="due"))
        client = Client(server.url)

        def led_and_dispatched() -> dict | None:
            overview = client.json("/api/overview")[1]
            dispatch = overview["dispatch"] or {}
            done = overview["totals"]["led"] == 4 and dispatch.get("dispatched", 0) >= 50
            return overview if done else None

        overview = wait_for(led_and_dispatched, 60, "the poller to lead all 4 partitions and dispatch 50 tasks")
        assert overview["totals"]["pollers"] == 1 and overview["totals"]["scheduled"] == 0
        assert all(row["poller"] and 0 < row["lease_ttl_s"] <= 2 for row in overview["partitions"])
        assert overview["dispatch"]["errors"] == [] and overview["dispatch"]["lag_p99_s"] is not None
        page = client.request("/")[1]
        assert "dispatch rate" in page and overview["partitions"][0]["poller"] in page
    finally:
        server.stop()



def _finished(client: Client, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, job = client.json(f"/api/jobs/{job_id}")
        assert status == 200
        if job["state"] != "running":
            assert job["state"] == "done", job
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still running after 60 s")


def test_dead_letters_list_show_requeue_and_purge(app, server):
    letters = DeadLetters(store_of(app))
    parked = {task_id: data for task_id, _, data in envelopes(5, "q", 0, prefix="dead")}
    for i, (task_id, data) in enumerate(parked.items()):
        letters.add(DeadLetter(task_id=task_id, reason="boom" if i < 3 else "unknown task", source="worker",
                               message=data, traceback="Traceback: boom"))
    client = Client(server.url)
    status, listed = client.json("/api/dead-letters?reason=BOOM")
    assert status == 200 and listed["count"] == 5 and len(listed["items"]) == 3
    status, page = client.request("/dead-letters")
    assert status == 200 and page.count('href="/dead-letters/dead-') == 5
    status, page = client.request("/dead-letters/dead-1")
    assert status == 200 and "Traceback: boom" in page and "/dead-letters/dead-1/requeue" in page
    status, letter = client.json("/api/dead-letters/dead-0")
    assert status == 200 and letter["traceback"] == "Traceback: boom" and letter["task"] == "tasks.demo.add"

    status, done = client.json("/api/dead-letters/dead-0/requeue", {})
    assert status == 200 and done == {"requeued": 1, "unknown": 0, "kept": 0, "kept_letters": []}
    assert store_of(app).get("dead-0") is not None and not letters.holds("dead-0")
    status, error = client.json("/api/bulk/dead-letters/purge", {"reason": "boom"})
    assert status == 400 and "needs confirm=<how many match>" in error["error"]
    status, error = client.json("/api/bulk/dead-letters/purge", {"reason": "boom", "confirm": "0"})
    assert status == 400 and "needs confirm=2" in error["error"]
    status, job = client.json("/api/bulk/dead-letters/purge", {"reason": "boom", "confirm": "2"})
    assert status == 202 and _finished(client, job["id"])["result"] == {"purged": 2, "unknown": 0}
    assert letters.count() == 2
    status, job = client.json("/api/bulk/dead-letters/requeue", {"reason": "unknown task", "confirm": "2"})
    assert status == 202 and _finished(client, job["id"])["result"] == {"requeued": 2, "unknown": 0, "kept": 0,
                                                                        "kept_letters": []}
    assert letters.count() == 0 and store_of(app).get("dead-3") is not None and store_of(app).get("dead-4") is not None
    status, page = client.request(f"/jobs/{job['id']}")
    assert status == 200 and "requeued: 2" in page and "reason=unknown task" in page and "Back to dead letters" in page


def test_a_bulk_requeue_goes_past_letters_it_cannot_requeue_and_names_them(app, server):
    """F8: the first letter whose message is not one of its task ended the job: the valid letters after
    it stayed parked, and no result was shown.  They are requeued now; the others stay, named."""
    letters = DeadLetters(store_of(app))
    for i, (task_id, _, data) in enumerate(envelopes(6, "q", 0, prefix="mixed")):
        letters.add(DeadLetter(task_id=task_id, reason="boom", source="worker",
                               message=b"not an envelope" if i in (1, 3) else data))
    client = Client(server.url)
    status, job = client.json("/api/bulk/dead-letters/requeue", {"reason": "boom", "confirm": "6"})
    result = _finished(client, job["id"])
    assert status == 202
    assert {k: result["result"][k] for k in ("requeued", "unknown", "kept")} == {"requeued": 4, "unknown": 0, "kept": 2}
    assert sorted(line.split(":")[0] for line in result["result"]["kept_letters"]) == ["mixed-1", "mixed-3"]
    assert sorted(letter.task_id for letter in letters.list(10)) == ["mixed-1", "mixed-3"]
    status, page = client.request(f"/jobs/{job['id']}")
    assert status == 200 and "kept parked" in page and "mixed-3" in page
    status, error = client.json("/api/dead-letters/mixed-1/requeue", {})
    assert status == 409 and "mixed-1" in error["error"]


def test_credentials_are_required_and_a_form_without_the_xsrf_token_is_refused(app):
    server = Server(app, basic_auth="ops:s3cret", token="t0ken-of-the-tests")
    try:
        anonymous = Client(server.url)
        status, _ = anonymous.request("/")
        assert status == 401
        status, _ = anonymous.request("/api/overview")
        assert status == 401
        status, _ = anonymous.request("/tasks/x/cancel", {}, xsrf=False)
        assert status in (401, 403)

        basic = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
        wrong = Client(server.url, {"Authorization": "Basic " + base64.b64encode(b"ops:guess").decode()})
        assert wrong.request("/")[0] == 401
        operator = Client(server.url, basic)
        assert operator.request("/")[0] == 200
        store_of(app).schedule_many(envelopes(1, "q", int(time.time() * 1000) + MINUTE, prefix="keep"))
        status, body = operator.request("/api/tasks/keep-0/cancel", {}, xsrf=False)
        assert status == 403 and "_xsrf" in body and store_of(app).get("keep-0") is not None
        status, _ = operator.request("/api/tasks/keep-0/cancel", {})
        assert status == 200 and store_of(app).get("keep-0") is None

        api = Client(server.url, {"Authorization": "Bearer t0ken-of-the-tests"})
        assert api.json("/api/overview")[0] == 200
        assert Client(server.url, {"Authorization": "bearer t0ken-of-the-tests"}).request("/")[0] == 200  # RFC 7235
        assert Client(server.url, {"Authorization": "BASIC " + basic["Authorization"][6:]}).request("/")[0] == 200
        assert Client(server.url, {"Authorization": "Bearer t0ken"}).request("/")[0] == 401
        status, job = api.json("/api/bulk", {"action": "count"}, xsrf=False)  # a bearer token needs no XSRF
        assert status == 202
    finally:
        server.stop()


@pytest.mark.parametrize("auth", [{"token": ""}, {"token": "short"}, {"basic_auth": "ops:"}, {"basic_auth": ""}])
def test_empty_or_short_credentials_are_an_error_not_no_auth(app, auth):
    with pytest.raises(ValueError, match="at least 16 characters|the password not empty"):
        make_app(Views(app), **auth)


def test_what_users_wrote_is_shown_escaped_and_odd_ids_get_clean_errors(app, server):
    store = store_of(app)
    due = int(time.time() * 1000) + MINUTE
    store.schedule_many(envelopes(1, "q", due, prefix="<script>alert(1)</script>", task="<b>evil</b>"))
    client = Client(server.url)
    page = client.request("/upcoming")[1]
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;-0" in page
    assert "<b>evil</b>" not in page and "&lt;b&gt;evil&lt;/b&gt;" in page
    status, page = client.request("/tasks/%3Cscript%3Ealert(1)%3C%2Fscript%3E-0")
    assert status == 200 and "<script>alert(1)" not in page
    for odd in ("a%0D%0ASet-Cookie:%20x=1", "%E2%9C%93%20space", "nope%25"):  # CR LF, unicode, percent
        status, error = client.json(f"/api/tasks/{odd}")
        assert status == 404 and "not in the store" in error["error"], (odd, status, error)
    status, error = client.json("/api/upcoming?after=garbage")
    assert status == 400 and "not a cursor" in error["error"]
    assert client.json("/api/upcoming?limit=100000")[0] == 200  # capped, not refused
    for path in ("/upcoming?done=%ff", "/upcoming?zzz=%ff&limit=2", "/api/upcoming?zzz=%ff"):  # bad bytes
        status, page = client.request(path)
        assert status == 400 and "Invalid unicode" in page, (path, status, page)
    assert client.request("/static/app.css%00x")[0] == 400
    status, page = client.request("/upcoming?done=Your+session+expired%3A+call+%2B1-555-0100")  # a link's own text
    assert status == 200 and "555-0100" not in page and 'id="done"' not in page
    status, page = client.request("/tasks/%3Cscript%3Ealert(1)%3C%2Fscript%3E-0/cancel", {})  # the server's own
    assert status == 200 and '<p class="ok" id="done">cancelled &lt;script&gt;alert(1)&lt;/script&gt;-0</p>' in page
    for path in ("/upcoming", "/api/upcoming", "/static/app.css", "/no/such/page", "/api/no/such"):
        try:
            reply = urllib.request.urlopen(server.url + path)
        except urllib.error.HTTPError as exc:
            reply = exc
        assert reply.headers["X-Content-Type-Options"] == "nosniff" and reply.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in reply.headers["Content-Security-Policy"], path
        assert path.startswith("/static/") or reply.headers["Cache-Control"] == "no-store", path
    assert client.json("/api/no/such") == (404, {"error": "no page /api/no/such", "status": 404})


def test_no_body_is_read_before_its_request_authenticates_and_none_beyond_what_forms_need(app):
    """Without credentials in its headers a POST is answered at once, its body unread; with them, a body
    larger than any form is refused at its headers too."""
    server = Server(app, token="t0ken-of-the-tests")
    try:
        for headers, length in (("", 50_000_000), ("Authorization: Bearer t0ken-of-the-tests\r\n", 1_000_000)):
            with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=60) as conn:
                conn.sendall(f"POST /api/bulk HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Length: {length}\r\n"
                             "Content-Type: application/x-www-form-urlencoded\r\n\r\naction=count&".encode())
                reply = conn.recv(1000)  # without a cap, the server would wait for the rest of the body
                assert reply.startswith(b"HTTP/1.1 400 "), (headers, reply)
                assert conn.recv(1000) == b""  # and closed the connection
        api = Client(server.url, {"Authorization": "Bearer t0ken-of-the-tests"})
        assert api.json("/api/bulk", {"action": "count", "task": "x" * 10_000}, xsrf=False)[0] == 202
    finally:
        server.stop()


def test_one_bulk_job_of_each_kind_at_a_time_and_a_dead_letter_bulk_checks_confirm_first(app, server,
                                                                                         monkeypatch):
    store_of(app).schedule_many(envelopes(3, "q", int(time.time() * 1000) + MINUTE))
    client = Client(server.url)
    release = threading.Event()
    views = Views(app)
    first = views.jobs.start("count", Filter(), lambda progress: {"matched": release.wait(60) and 0})
    try:
        with pytest.raises(JobRunning, match=first.id):
            views.bulk("count", Filter())
        assert views.jobs.start("purge", LetterFilter(), lambda progress: {}).action == "purge"  # another kind
    finally:
        release.set()
    walked = []
    monkeypatch.setattr(views.letters, "matching", lambda *args: walked.append(args) or [])
    for confirm in (None, "", "all"):
        with pytest.raises(ValueError, match="needs confirm=<how many match>"):
            views.letters_bulk("purge", LetterFilter(), confirm)
    assert walked == []  # refused before reading a letter
    status, job = client.json("/api/bulk", {"action": "count"})
    assert status == 202 and _finished(client, job["id"])["result"] == {"matched": 3}


def test_a_page_elsewhere_cannot_reach_it_by_another_host_name_frame_it_or_post_to_it(app, server):
    store = store_of(app)
    store.schedule_many(envelopes(1, "q", int(time.time() * 1000) + MINUTE, prefix="keep"))
    rebound = Client(server.url, {"Host": "attacker.example:80"})  # DNS rebinding: their name, our address
    status, error = rebound.json("/api/upcoming")
    assert status == 403 and "not one this server answers to" in error["error"]
    client = Client(server.url)
    status, _ = client.request("/")
    cross_site = Client(server.url, {"Origin": "http://127.0.0.1:9"})
    cross_site.jar = client.jar  # the XSRF cookie is shared by every port of 127.0.0.1
    status, error = cross_site.json("/api/tasks/keep-0/cancel", {})
    assert status == 403 and "from another site" in error["error"] and store.get("keep-0") is not None
    with urllib.request.urlopen(server.url + "/") as reply:
        assert reply.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in reply.headers["Content-Security-Policy"]


def test_a_task_id_with_a_slash_opens_and_is_cancelled_and_actions_refuse_get(app, server):
    store = store_of(app)
    store.schedule_many(envelopes(1, "q", int(time.time() * 1000) + MINUTE, prefix="tenant/7"))
    client = Client(server.url)
    page = client.request("/upcoming")[1]
    assert 'href="/tasks/tenant%2F7-0"' in page
    status, page = client.request("/tasks/tenant%2F7-0")
    assert status == 200 and 'action="/tasks/tenant%2F7-0/cancel"' in page
    assert client.request("/tasks/tenant%2F7-0/cancel")[0] == 405  # a GET changes nothing
    assert client.request("/tasks/tenant%2F7-0/cancel", {})[0] == 200 and store.get("tenant/7-0") is None


def test_a_store_that_is_down_is_a_503_on_every_page(overrides):
    down = create_app(**{**overrides, "delayed_redis_url": "redis://127.0.0.1:1/0", "delayed_redis_cluster": False})
    server = Server(down)
    try:
        client = Client(server.url)
        for path in ("/api/overview", "/api/upcoming", "/api/tasks/x", "/api/dead-letters", "/api/dead-letters/x"):
            status, error = client.json(path)
            assert status == 503 and "unavailable" in error["error"], (path, status, error)
        assert client.request("/dead-letters")[0] == 503
    finally:
        server.stop()


def test_a_queue_is_paused_resumed_and_rate_limited_from_the_overview_and_its_api(app, server):
    now = int(time.time() * 1000)
    _schedule(app, now)
    store, client = store_of(app), Client(server.url)
    status, page = client.request("/queues/pause", {"queue": "mail"})  # the overview's form
    assert status == 200 and "mail" in store.paused()
    assert 'name="queue" value="mail"><button type="submit" class="">Resume</button>' in page
    status, overview = client.json("/api/overview")
    queues = {row["queue"]: row for row in overview["queues"]}
    assert queues["mail"]["paused_since_ms"] == store.paused()["mail"] and queues["web"]["paused_since_ms"] is None
    assert queues["mail"]["next_due_ms"] == now + MINUTE
    status, done = client.json("/api/queues/pause", {"queue": "mail"})
    assert status == 200 and done == {"queue": "mail", "paused": True, "changed": False}
    status, done = client.json("/api/queues/resume", {"queue": "mail"})
    assert status == 200 and done["changed"] and store.paused() == {}
    status, error = client.json("/api/queues/pause", {"queue": ""})
    assert status == 400 and "a queue to pause must be a name" in error["error"]
    status, page = client.request("/queues/rate", {"queue": "mail", "rate": "250"})
    assert status == 200 and store.rates() == {"mail": 250.0} and "<td>250/s</td>" in page
    status, done = client.json("/api/queues/rate", {"queue": "mail", "rate": "off"})
    assert status == 200 and done == {"queue": "mail", "rate": None}
    status, error = client.json("/api/queues/rate", {"queue": "mail", "rate": "fast"})
    assert status == 400 and "a rate must be tasks a second, or off; got 'fast'" in error["error"]


def test_the_overview_names_a_queue_whose_topic_no_worker_reads(app):
    """A worker started without celery_delayed.install(app) never reads Kafka: its queue's tasks
    wait on their topic, and the overview says so, with the likely cause."""
    settings = store_of(app).settings
    queue = app.conf.task_default_queue
    ensure_topics(settings, [queue])
    producer = Producer(settings.kafka())
    producer.produce(settings.topic(queue), key="task-1", value=b"{}")
    assert producer.flush(30) == 0
    warning = (f"queue {queue}: 1 task(s) wait on Kafka topic {settings.topic(queue)} and no worker of group "
               f"{settings.consumer_group} reads it")
    srv = Server(app)  # Kafka is first read as the view starts: after the record is there
    try:
        client = Client(srv.url)
        wait_for(lambda: any(w.startswith(warning) for w in client.json("/api/overview")[1]["kafka_warnings"]), 30,
                 "the overview's warning of the unread queue")
        assert warning in client.request("/")[1]
    finally:
        srv.stop()


def test_the_schedules_page_lists_shows_pauses_resumes_and_runs_a_schedule_now(app, server):
    """Recurring schedules in the web view (issue 43): a page of them by id prefix, paged; each one's
    page with its next run and that task's state; pause, resume and run-now, as forms and in the API;
    an id holding markup is shown escaped; an unknown id or a bad cursor is a one-line error."""
    from celery.schedules import crontab
    from celery_delayed import Schedules
    schedules = Schedules(app)
    for i in range(7):
        schedules.upsert(f"digest:user:{i}", app.signature("tasks.demo.add", (i, i)), crontab(minute=0, hour=8),
                         tz="Europe/Paris")
    schedules.upsert("poll:<b>x</b>", app.signature("tasks.demo.add", (1, 1)), 300, overlap=False)
    client = Client(server.url)

    status, page = client.json("/api/schedules?prefix=digest:&limit=3")
    seen, pages = {i["schedule_id"] for i in page["items"]}, 1
    while page["cursor"]:
        page = client.json(f"/api/schedules?prefix=digest:&limit=3&after={page['cursor']}")[1]
        seen, pages = seen | {i["schedule_id"] for i in page["items"]}, pages + 1
    assert status == 200 and seen == {f"digest:user:{i}" for i in range(7)} and pages > 1
    status, html = client.request("/schedules?prefix=digest:")
    assert status == 200 and html.count('href="/schedules/digest%3Auser%3A') == 7 and "0 8 * * *" in html

    status, one = client.json("/api/schedules/digest:user:3")
    assert status == 200 and one["task"] == "tasks.demo.add" and one["next_state"] == "scheduled"
    assert one["paused"] is False and one["next_id"]
    status, html = client.request("/schedules/digest:user:3")
    assert status == 200 and 'id="pause"' in html and one["next_id"] in html

    status, html = client.request("/schedules/digest:user:3/pause", {})
    assert status == 200 and 'id="resume"' in html and ">paused<" in html
    assert client.json("/api/schedules/digest:user:3")[1]["paused"] is True
    assert store_of(app).get(one["next_id"]) is None  # its pending occurrence cancelled
    status, resumed = client.json("/api/schedules/digest:user:3/resume", {})
    assert status == 200 and resumed == {"schedule_id": "digest:user:3", "paused": False}
    assert client.json("/api/schedules/digest:user:3")[1]["next_state"] == "scheduled"
    status, ran = client.json("/api/schedules/digest:user:3/run-now", {})
    assert status == 200 and store_of(app).get(ran["task_id"])["task"] == "tasks.demo.add"

    html = client.request("/schedules?prefix=poll:")[1]
    assert "<b>x</b>" not in html and "poll:&lt;b&gt;x&lt;/b&gt;" in html
    assert client.json("/api/schedules/no-such")[1] == {"error": "no recurring schedule no-such", "status": 404}
    assert client.json("/api/schedules/no-such/pause", {})[0] == 404
    status, error = client.json("/api/schedules?after=garbage")
    assert status == 400 and "not a cursor" in error["error"]
    assert client.request("/schedules/digest:user:3/pause")[0] == 405  # an action is a POST only
