"""The suite's own rules, as a pytest plugin (tests/conftest.py takes its hooks and helpers).

1. No green skip for what the install provides. A test that needs a package that `make
   install` puts in the venv, or a system tool that `make test` installs with apt-get as root
   (Makefile: `browser`, `docker-tools`), skips through `missing_package` / `import_or_skip` or
   `missing_tool` / `require_tool`, or with a `skipif` whose reason starts with
   `MISSING_PACKAGE` / `MISSING_TOOL`. On a developer's machine that stays a skip with its
   reason. Under CI (CI=true, as `.ci/run` runs) the install was supposed to bring it, so the
   skip is reported as a failure instead: always for a package, and for a tool where the run
   is root with apt-get (elsewhere `make test` could not have installed it, and it stays a
   skip). Every other skip (a CUDA device, a non-root user, another OS) is untouched.

2. A time budget per test: `test_budget_s` (pyproject.toml) for each test's own time, the
   call phase plus the setup phase less the setup of module-, class-, package- and
   session-scoped fixtures. Those shared fixtures are set up once, by whichever test needs them
   first, so their time belongs to no single test and is not counted (its `--durations` line
   still shows it as that test's setup); teardown is not counted either. A test over the budget
   is listed at the end of every run; under CI the session then fails (exit status 1) unless
   the test is marked `@pytest.mark.allow_slow(reason="...")` with a non-empty reason.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from collections import defaultdict
from typing import NoReturn

import pytest

MISSING_PACKAGE = "missing package:"
MISSING_TOOL = "missing tool:"
# Report properties the time budget reads (also in JUnit XML): seconds of shared fixtures set up
# during the test, and its allow_slow reason.
SHARED_PROPERTY = "forage_shared_fixture_s"
ALLOW_PROPERTY = "forage_allow_slow"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def can_install_tools() -> bool:
    """Root with apt-get: there `make test` installs the system tools, and fails if it cannot."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def missing_package(reason: str) -> NoReturn:
    """Skip (a failure under CI): a Python package that `make install` installs is missing."""
    pytest.skip(f"{MISSING_PACKAGE} {reason}", allow_module_level=True)


def missing_tool(reason: str) -> NoReturn:
    """Skip (a failure under CI as root with apt-get): a system tool `make test` installs."""
    pytest.skip(f"{MISSING_TOOL} {reason}", allow_module_level=True)


def require_tool(name: str, reason: str) -> str:
    """The path of the command `name`, else `missing_tool`."""
    path = shutil.which(name)
    if path is None:
        missing_tool(f"no {name} on PATH; {reason}")
    return path


def import_or_skip(module: str, reason: str):
    """`pytest.importorskip` for a package `make install` installs: a failure under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing_package(f"{module} cannot be imported ({exc}); {reason}")


def must_not_skip(reason: str) -> bool:
    """Whether a skip with this reason is a failure in this run (rule 1)."""
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith(MISSING_PACKAGE):
        return under_ci()
    if reason.startswith(MISSING_TOOL):
        return under_ci() and can_install_tools()
    return False


def _fail_instead_of_skip(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if must_not_skip(reason):
        report.outcome = "failed"
        report.longrepr = (f"{reason.removeprefix('Skipped: ')}\nCI=true: the install provides "
                           "this (make install, make test as root with apt-get), so this skip "
                           "fails (tests/suite_rules.py)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_instead_of_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module-level skip (`import_or_skip` at import)
    _fail_instead_of_skip(report)
    return report


def pytest_addoption(parser) -> None:
    parser.addini("test_budget_s", "seconds of its own time one test may take (tests/"
                  "suite_rules.py)", default="300")


def pytest_configure(config) -> None:
    config.pluginmanager.register(TimeBudget(float(config.getini("test_budget_s"))),
                                  "forage-time-budget")


class TimeBudget:
    """Rule 2: each test's own time (see the module's docstring) against the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.phases: dict[str, float] = defaultdict(float)  # setup + call, as pytest times them
        self.shared: dict[str, float] = defaultdict(float)  # shared fixtures set up meanwhile
        self.allowed: dict[str, str] = {}
        # What the reports carried: the same figures, also in a parallel run's controller.
        self.reported_shared: dict[str, float] = {}
        self.reported_allowed: dict[str, str] = {}
        self.current: str | None = None
        self._depth = 0

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        self.current = item.nodeid
        marker = item.get_closest_marker("allow_slow")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            if str(reason).strip():
                self.allowed[item.nodeid] = str(reason)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item) -> None:
        self.current = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function" or self.current is None:
            return (yield)
        self._depth += 1
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            self._depth -= 1
            if self._depth == 0:  # a shared fixture inside another is counted once
                self.shared[self.current] += time.perf_counter() - started

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """What only the process that ran the test knows travels on its report (a parallel
        run's controller sees reports, not fixtures or markers)."""
        report = yield
        if call.when in ("setup", "call"):
            shared = self.shared.get(item.nodeid, 0.0)
            if shared:
                report.user_properties.append((SHARED_PROPERTY, round(shared, 3)))
            if item.nodeid in self.allowed:
                report.user_properties.append((ALLOW_PROPERTY, self.allowed[item.nodeid]))
        return report

    def pytest_runtest_logreport(self, report) -> None:
        if report.when in ("setup", "call"):
            self.phases[report.nodeid] += report.duration
            for name, value in report.user_properties:
                if name == SHARED_PROPERTY:
                    self.reported_shared[report.nodeid] = max(
                        self.reported_shared.get(report.nodeid, 0.0), float(value))
                elif name == ALLOW_PROPERTY:
                    self.reported_allowed[report.nodeid] = str(value)

    def over(self) -> list[tuple[float, str]]:
        spent = {nodeid: max(0.0, total - self.reported_shared.get(nodeid, 0.0))
                 for nodeid, total in self.phases.items()}
        return sorted(((s, nodeid) for nodeid, s in spent.items() if s > self.budget_s),
                      reverse=True)

    def unlisted(self) -> list[str]:
        return [nodeid for _, nodeid in self.over() if nodeid not in self.reported_allowed]

    def pytest_sessionfinish(self, session) -> None:
        if under_ci() and self.unlisted() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        over = self.over()
        if not over:
            return
        tr = terminalreporter
        tr.section(f"over the {self.budget_s:g} s time budget (call + function-scoped setup)")
        for spent, nodeid in over:
            why = self.reported_allowed.get(nodeid)
            tr.line(f"{spent:8.1f} s  {nodeid}  "
                    + (f"allow_slow: {why}" if why else "NOT ALLOWED (no allow_slow reason)"))
        unlisted = self.unlisted()
        if unlisted:
            tr.line(f"{len(unlisted)} test(s) over budget without @pytest.mark.allow_slow("
                    "reason=...): " + ("the session fails (CI=true)" if under_ci()
                                      else "this fails under CI"), red=True)
