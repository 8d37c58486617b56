"""Debian's headless Chromium driven by Selenium through Debian's chromedriver (``scripts/services browser``
installs both): the web view's browser test and its screenshots.  Never a downloaded browser build."""
from __future__ import annotations

import os
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

#: The flags this machine's closed network needs (without the background ones Chromium keeps
#: dialling Google and its connections are refused), root's --no-sandbox, and a page size for
#: screenshots.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1440,1000")


def headless_chromium(profile: Path) -> webdriver.Chrome:
    """A new headless Chromium with an empty profile in ``profile``; quit() it when done."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is missing: install it with scripts/services browser")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not look for a browser to download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
