"""The web view in a real browser: ``celery delayed web`` started as a user starts it, Debian's headless
Chromium driven by Selenium: open the overview, search a task id, cancel it from its page, see it gone.
Screenshots of the overview and upcoming pages are saved as PNGs beside the test's logs."""
from __future__ import annotations

import time
import urllib.request

from selenium.webdriver.common.by import By

from celery_delayed import store_of
from tasks import create_app
from tasks.browser import headless_chromium
from tasks.processes import free_port, wait_for

from .support import envelopes


def test_search_a_task_cancel_it_from_its_page_and_see_it_gone(overrides, processes, tmp_path):
    app = create_app(**overrides)
    store = store_of(app)
    now = int(time.time() * 1000)
    for k in range(30):
        store.schedule_many(envelopes(40, "mail", now + 60_000 + k * 97_000, prefix=f"mail-{k}", task="app.mail"))
    port = free_port()
    processes.start("web", "delayed", "web", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base), 60, "celery delayed web to answer")

    browser = headless_chromium(tmp_path / "profile")
    try:
        browser.get(base + "/")
        assert browser.find_element(By.ID, "scheduled").text == "1,200"
        assert browser.find_elements(By.CSS_SELECTOR, "svg.bars rect")
        browser.save_screenshot(str(tmp_path / "overview.png"))

        victim = "mail-3-17"
        browser.find_element(By.ID, "search-id").send_keys(victim)
        browser.find_element(By.ID, "search").click()
        wait_for(lambda: browser.find_elements(By.ID, "task-id"), 20, "the task's page")
        assert browser.find_element(By.ID, "task-id").text == victim
        assert browser.find_element(By.ID, "state").text == "scheduled"

        browser.find_element(By.ID, "cancel").click()
        wait_for(lambda: browser.find_elements(By.ID, "done"), 20, "the page after the cancel")
        assert browser.find_element(By.ID, "done").text == f"cancelled {victim}"
        assert store.get(victim) is None and store.get("mail-3-16") is not None

        browser.get(f"{base}/upcoming?id_prefix=mail-3-&limit=100")
        shown = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#upcoming a")]
        assert len(shown) == 39 and victim not in shown and "mail-3-16" in shown
        browser.save_screenshot(str(tmp_path / "upcoming.png"))

        browser.get(f"{base}/tasks/{victim}")  # its page now says where it went
        assert "not in the store" in browser.find_element(By.ID, "error").text
    finally:
        browser.quit()
    for name in ("overview.png", "upcoming.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
    print(f"screenshots: {tmp_path / 'overview.png'} {tmp_path / 'upcoming.png'}")


def _answers(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/api/overview", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False
