"""The suite's own rules (tests/suite_rules.py), on tiny inner test runs in subprocesses:
under CI a skip for a missing package or tool fails while a GPU skip stays a skip; a test
over the time budget fails a CI session unless it is marked allow_slow; and .ci/durations.py's
time by area."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0

# The same wiring as tests/conftest.py.
CONFTEST = """
from tests.suite_rules import (  # noqa: F401
    import_or_skip,
    pytest_addoption,
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)
"""
INI = """
[pytest]
test_budget_s = 1.0
markers =
    gpu: needs a CUDA device
    allow_slow(reason): may exceed test_budget_s
"""
SKIPS = """
import pytest

from tests.suite_rules import MISSING_TOOL, import_or_skip, missing_tool, require_tool


def test_tool():
    require_tool("forage-no-such-tool", "an apt package make test installs")


@pytest.mark.skipif(True, reason=f"{MISSING_TOOL} the skipif form")
def test_tool_marker():
    pass


@pytest.fixture()
def tool_fixture():
    missing_tool("a fixture's tool")


def test_tool_in_fixture(tool_fixture):
    pass


def test_package():
    import_or_skip("forage_no_such_module", "an extra make install installs")


@pytest.mark.gpu
def test_gpu():
    pytest.skip("gpu: needs a CUDA device")


def test_other_skip():
    pytest.skip("nothing to run here")


@pytest.mark.xfail(reason="a known failure")
def test_xfail():
    assert False
"""
MODULE_SKIP = """
from tests.suite_rules import import_or_skip

import_or_skip("forage_no_such_module", "an extra, at import")


def test_never_collected():
    pass
"""
BUDGET = """
import time

import pytest

SLOW = 1.5  # over the inner budget of 1.0 s


@pytest.fixture(scope="module")
def shared():
    time.sleep(SLOW)


@pytest.fixture()
def own():
    time.sleep(SLOW)


def test_over():
    time.sleep(SLOW)


@pytest.mark.allow_slow(reason="measured and accepted")
def test_allowed():
    time.sleep(SLOW)


def test_shared_fixture_is_not_counted(shared):
    pass


def test_own_fixture_is_counted(own):
    pass


def test_fast():
    pass
"""


@pytest.fixture()
def inner(pytester, monkeypatch, tmp_path):
    """Runs pytest on the inner files: `run(ci, apt_get, *args)`."""
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\nexit 0\n")
    (fake / "apt-get").chmod(0o755)
    empty = tmp_path / "empty-bin"
    empty.mkdir()

    def run(ci: bool, apt_get: bool, *args: str):
        monkeypatch.setenv("CI", "true" if ci else "")
        monkeypatch.setenv("PATH", str(fake if apt_get else empty))  # no other tool either
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # a faster start
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-ra", *args)

    return pytester, run


def test_under_ci_a_missing_package_or_tool_fails_and_a_gpu_skip_stays(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_skips=SKIPS)
    result = run(True, True)
    tools = 0 if ROOT else 3  # as root with apt-get the three tool skips fail; else they skip
    # test_tool and test_package fail in their call; the marker and the fixture fail in setup
    result.assert_outcomes(failed=1 + (1 if ROOT else 0), errors=2 if ROOT else 0,
                           skipped=2 + tools, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "missing package: forage_no_such_module cannot be imported" in out
    assert "CI=true: the install provides this" in out
    assert "SKIPPED" in out and "gpu: needs a CUDA device" in out  # -ra: still a skip, with why
    assert "nothing to run here" in out
    if ROOT:
        assert "missing tool: no forage-no-such-tool on PATH" in out


def test_under_ci_without_apt_get_a_missing_tool_still_skips(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_skips=SKIPS)
    result = run(True, False)
    result.assert_outcomes(failed=1, skipped=5, xfailed=1)  # only the package fails


def test_outside_ci_every_skip_stays_a_skip_with_its_reason(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_skips=SKIPS, test_module_skip=MODULE_SKIP)
    result = run(False, True)
    result.assert_outcomes(skipped=7, xfailed=1)  # the module's skip counts once
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str()
    for reason in ("missing tool: no forage-no-such-tool on PATH", "missing tool: the skipif form",
                   "missing tool: a fixture's tool", "missing package: forage_no_such_module",
                   "gpu: needs a CUDA device", "nothing to run here"):
        assert reason in out, reason


def test_under_ci_a_package_missing_at_import_is_a_collection_error(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_module_skip=MODULE_SKIP)
    result = run(True, False)
    result.assert_outcomes(errors=1)
    assert result.ret != pytest.ExitCode.OK
    assert "missing package: forage_no_such_module" in result.stdout.str()


@pytest.mark.parametrize("workers", [[], ["-p", "xdist.plugin", "-n", "2"]],
                         ids=["serial", "two-workers"])
def test_over_budget_fails_a_ci_session_unless_allowed(inner, workers) -> None:
    """Also in a parallel run, where the controller that judges sees only the workers' reports
    (the shared fixture's time and the allow_slow reason travel on them)."""
    pytester, run = inner
    pytester.makepyfile(test_budget=BUDGET)
    result = run(True, False, *workers)
    result.assert_outcomes(passed=5)  # every test passes; the session fails
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "over the 1 s time budget (call + function-scoped setup)" in out
    flagged = [line for line in out.splitlines() if "NOT ALLOWED" in line]
    assert len(flagged) == 2, out
    assert any("test_over" in line for line in flagged)
    assert any("test_own_fixture_is_counted" in line for line in flagged)
    assert "allow_slow: measured and accepted" in out
    assert "test_shared_fixture_is_not_counted" not in out.split("time budget")[1]
    assert "2 test(s) over budget without @pytest.mark.allow_slow" in out


def test_an_allowed_slow_test_passes_a_ci_session(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_budget=BUDGET)
    result = run(True, False, "-k", "allowed or shared or fast")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK
    assert "allow_slow: measured and accepted" in result.stdout.str()


def test_over_budget_outside_ci_is_listed_but_passes(inner) -> None:
    pytester, run = inner
    pytester.makepyfile(test_budget=BUDGET)
    result = run(False, False, "-k", "over")
    assert result.ret == pytest.ExitCode.OK
    assert "this fails under CI" in result.stdout.str()


# ------------------------------------------------------------------ .ci/durations.py

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.learner.test_trainer" name="test_a" time="10.5"/>
<testcase classname="tests.learner.test_trainer.TestX" name="test_b" time="2.0">
  <failure message="boom">boom</failure></testcase>
<testcase classname="tests.test_docs_run" name="test_docs_run[README.md]" time="30.0"/>
<testcase classname="tests.deploy.test_compose_up" name="test_up" time="0.1">
  <skipped message="missing tool"/></testcase>
<testcase classname="" name="tests.rollout.test_x" time="0.0"><error message="x"/></testcase>
</testsuite></testsuites>
"""


def _durations():
    spec = importlib.util.spec_from_file_location("ci_durations", REPO / ".ci" / "durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_durations_sums_seconds_by_top_level_folder(tmp_path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    rows, totals = _durations().summarize(report)
    assert {name: row["seconds"] for name, row in rows.items()} == {
        "learner": 12.5, "(tests/*.py)": 30.0, "deploy": 0.1, "(collection)": 0.0}
    assert rows["learner"]["failed"] == 1 and rows["deploy"]["skipped"] == 1
    assert totals == {"passed": 2, "failed": 2, "skipped": 1}
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "durations.py"), str(report)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[2].split()[:2] == ["(tests/*.py)", "30.0"]  # the largest area first
    assert lines[-1] == "junit: 2 passed, 2 failed, 1 skipped"


def test_durations_never_fails_the_run(tmp_path) -> None:
    for content in (None, "not xml"):
        report = tmp_path / "junit.xml"
        if content is not None:
            report.write_text(content)
        done = subprocess.run([sys.executable, str(REPO / ".ci" / "durations.py"), str(report)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "no time by area" in done.stdout, done.stdout
