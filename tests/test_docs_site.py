"""The docs site (mkdocs.yml, `make docs`): it builds strict, every page is on it, and it works in
a browser.

- The repository's site builds with `mkdocs build --strict`: a link to a missing page or
  anchor, or a page left out of the navigation, fails the build and this test.
- The strict settings catch what they are there for: a small site with the same mkdocs.yml and
  hooks and one broken anchor fails, naming it, while its links written for the repository
  (`../docs/…`, `bench/README.md#…`) resolve on the site.
- The served site (`mkdocs serve`, what `make docs` runs) in headless Chromium: the home page is
  README.md, and a search query lists matching pages (the search index loaded in its worker).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import mkdocs_hooks
from tests.browser import launch, needs_chromium, watched_page
from tests.suite_rules import import_or_skip
from tests.test_docs_truth import github_anchors

REPO = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def mkdocs(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    if not MKDOCS.exists():
        import_or_skip("mkdocs", "the docs extra (mkdocs, mkdocs-material) builds the site")
    return subprocess.run([str(MKDOCS), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = mkdocs("build", "--strict", "--site-dir", str(out))
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_site_builds_strict_with_every_page(site: Path) -> None:
    pages = {doc.stem for doc in (REPO / "docs").glob("*.md")}
    pages |= {Path(page).stem for page in mkdocs_hooks.MOUNTED.values()} - {"index"}
    missing = sorted(page for page in pages if not (site / page / "index.html").exists())
    assert not missing and (site / "index.html").exists(), f"pages not on the site: {missing}"
    assert (site / "search" / "search_index.json").exists()


def test_github_anchor_rule_is_the_docs_checks_rule() -> None:
    headings = ["Does it learn? SFT + GRPO on SmolLM2, full and LoRA (`bench/real_learn.py`)",
                "`forage eval` on the demo's policies", "Index kinds at scale: 21M × 768"]
    assert ({mkdocs_hooks.github_slug(h.replace("`", "")) for h in headings}
            == github_anchors("".join(f"## {h}\n" for h in headings)))


def test_repository_links_become_site_links() -> None:
    rewrite = mkdocs_hooks.rewrite_target
    assert rewrite("../bench/README.md#gpu-check", "learner.md") == "benchmarks.md#gpu-check"
    assert rewrite("docs/retriever.md#gpu", "index.md") == "retriever.md#gpu"
    assert rewrite("bench/README.md", "results.md") == "benchmarks.md"
    assert rewrite("../docs/probe.md", "benchmarks.md") == "probe.md"
    assert rewrite("../RESULTS.md#x", "eval.md") == "results.md#x"
    for kept in ("probe.md#cuts", "#local", "https://example.org/a.md", "../configs/tiny.yaml"):
        assert rewrite(kept, "learner.md") == kept
    fenced = "```text\n[a](../bench/README.md)\n```\n[b](../bench/README.md)\n"
    assert mkdocs_hooks.rewrite_links(fenced, "eval.md") == (
        "```text\n[a](../bench/README.md)\n```\n[b](benchmarks.md)\n")


def test_strict_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    for name in ("mkdocs.yml", "mkdocs_hooks.py"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    pages = {
        "docs/a.md": "# A\n\n## Real heading\n\n[bench](../bench/README.md#gpu-check-h200)\n",
        "docs/b.md": "# B\n\n[broken](a.md#no-such-heading)\n",
        "README.md": "# Home\n\n[a](docs/a.md#real-heading) [results](RESULTS.md)\n",
        "RESULTS.md": "# Results\n\n[check](bench/README.md#gpu-check-h200)\n",
        "CHANGELOG.md": "# Changelog\n",
        "bench/README.md": "# Benchmarks\n\n## GPU check (H200)\n\n[a](../docs/a.md)\n",
    }
    for path, text in pages.items():
        (tmp_path / path).write_text(text)
    built = mkdocs("build", "--site-dir", str(tmp_path / "site"), cwd=tmp_path)
    output = built.stdout + built.stderr
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    assert built.returncode == 1 and "Aborted with 1 warnings in strict mode" in output, output
    assert len(warnings) == 1 and "'a.md#no-such-heading'" in warnings[0], output


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def search_until_results(page, query: str, timeout_error: type, deadline_s: float = 120) -> None:
    """Type `query` into the site's search box key by key until results are listed.

    Keystrokes, not `page.fill`: the theme reads the box on keyup, on focus and when its search
    worker becomes ready, never on the `input` event that `fill` sends. A filled box was read
    only if the worker happened to turn ready after the fill; under load it turned ready first,
    the box was read empty on focus, and no retyping by `fill` was ever read (seen here: 120 s
    of "Type to start searching"). The theme also re-reads the box when its worker turns
    ready, so one pass should do; retyping stays as a guard, not as the mechanism."""
    deadline = time.monotonic() + deadline_s
    box = page.locator("input.md-search__input")
    while True:
        box.fill("")
        box.press_sequentially(query)
        try:
            page.wait_for_selector(".md-search-result__item", timeout=5_000)
            return
        except timeout_error:
            assert time.monotonic() < deadline, f"no search results for {query!r} in {deadline_s} s"


@needs_chromium
def test_served_site_home_and_search_in_chromium() -> None:
    playwright = import_or_skip("playwright.sync_api", "playwright (dev extra) drives the browser")
    port = free_port()
    base = f"http://127.0.0.1:{port}/"
    server = subprocess.Popen([str(MKDOCS), "serve", "--dev-addr", f"127.0.0.1:{port}"],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    problems: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"mkdocs serve exited: {server.stdout.read()}"
            try:
                if httpx.get(base, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mkdocs serve did not answer in 120 s"
            time.sleep(0.2)
        with playwright.sync_playwright() as driver:
            browser = launch(driver)
            page = watched_page(browser, problems, base)
            page.goto(base, wait_until="load")
            title = page.inner_text("article h1")
            nav = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link",
                                            "links => links.map(a => a.textContent.trim())")
            search_until_results(page, "weight sync", playwright.TimeoutError)
            meta = page.inner_text(".md-search-result__meta")
            first = page.get_attribute(".md-search-result__item a", "href")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert problems == []
    assert title.removesuffix("¶") == "Forage", title  # the heading and its permalink
    assert {"Results", "Changelog", "Troubleshooting"} <= set(nav), nav
    assert re.match(r"\d+ matching documents?", meta), meta
    assert first and first.startswith(base), first
