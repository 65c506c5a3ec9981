"""What makes the suite safe and fast under pytest-xdist (`make test` runs `-n 2 --dist
loadfile`): a test file's tests share one worker, so a module-scoped fixture (a vLLM engine, the
docs' working copy) is built once; session fixtures that cost seconds are built once for all
workers (`built_once`); the heaviest files start first so that no long file is left for the end
(`heaviest_first`); and the container tests' image is built by the controller (`Controller`),
which outlives every worker.

A serial run (`pytest` without -n) behaves as before: every helper here falls back to the plain
per-session behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Seconds per test file from a clean clone's run (`python3 .ci/durations.py --save`): only the
# order of the files comes from it, so a stale figure costs time, never a test.
FILE_SECONDS = REPO / "tests" / "file_seconds.json"


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def shared_dir(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> Path:
    """A folder every process of this run sees: the controller's basetemp in a parallel run
    (each worker's basetemp is a child of it), else the session's own basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if is_worker(config) else base


def built_once(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config, name: str,
               build: Callable[[Path], object]) -> Path:
    """`build(out)` once per run, whatever the number of workers: the first worker builds
    under a file lock and marks the folder done; the others wait and reuse it. A build that
    fails leaves no mark, so the next worker tries again and reports its own error."""
    from filelock import FileLock

    out = shared_dir(tmp_path_factory, config) / name
    done = out.with_name(f"{name}.done")
    with FileLock(str(out.with_name(f"{name}.lock"))):
        if not done.exists():
            build(out)
            done.touch()
    return out


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def heaviest_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Reorder `items` in place so that files run longest-first (items of a file keep their
    order; files with no figure keep their relative order after the measured ones)."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(_file_of(item), len(order))
    items.sort(key=lambda item: (-seconds.get(_file_of(item), 0.0), order[_file_of(item)]))


def load_file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


class Controller:
    """Registered in the xdist controller only: starts the container tests' image build when a
    worker has collected a test that needs it (the worker leaves a mark in the shared folder
    before it reports its collection) and stops the engine when the whole run ends."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.build = None

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        from tests.deploy.image_build import WANTED_FILE, ImageBuild, engine_missing, state_path

        base = self.config._tmp_path_factory.getbasetemp()
        if self.build is not None or not (base / WANTED_FILE).exists():
            return
        if engine_missing() is None:
            root = base / "dockerd"
            root.mkdir(exist_ok=True)
            self.build = ImageBuild(root, state_file=state_path(base)).start()

    def pytest_sessionfinish(self, session) -> None:
        if self.build is not None:
            self.build.stop()
            self.build = None
