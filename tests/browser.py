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
