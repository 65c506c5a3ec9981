"""The container tests' place in a parallel run: tests/deploy's hook moves them last (a serial
run keeps that), then the root conftest's order places them after most of the other work. The
root hook once ran first instead, so the container tests stayed last and `docker compose up`
ended every run alone while the other worker idled."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_suites_order_comes_after_tests_deploys_hook(pytestconfig) -> None:
    hook = pytestconfig.pluginmanager.hook.pytest_collection_modifyitems
    called = [Path(getattr(impl.plugin, "__file__", "") or "") for impl in
              reversed(hook.get_hookimpls())]  # pluggy calls the last one registered first
    root, deploy = TESTS / "conftest.py", TESTS / "deploy" / "conftest.py"
    assert root in called and deploy in called
    assert called.index(deploy) < called.index(root)
