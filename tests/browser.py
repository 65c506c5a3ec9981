"""Headless Chromium for the suite's page tests (the run report, the docs site).

Debian's chromium, driven by playwright (dev extra); `make browser` installs it as root. The
flags keep it off the network and out of first-run work: the pages under test load nothing
from outside, and a test that records requests sees only its own.
"""

from __future__ import annotations

import shutil

import pytest

from tests.suite_rules import MISSING_TOOL

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason=f"{MISSING_TOOL} Chromium is not installed (make test installs "
    "Debian's chromium as root); the page is not opened")


def launch(driver):
    """A headless Chromium from a playwright driver (its own fresh temporary profile)."""
    return driver.chromium.launch(
        executable_path=CHROMIUM, headless=True,
        args=[flag for flag in CHROMIUM_FLAGS if flag != "--headless"])


def watched_page(browser, problems: list[str], local_prefix: str):
    """A 1280x900 page that appends to `problems` every console error or warning, page error,
    failed request, and request to anything outside `local_prefix` (the page under test must
    load nothing from elsewhere)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("request", lambda r: problems.append(f"remote request: {r.url}")
            if not r.url.startswith(local_prefix) else None)
    return page
