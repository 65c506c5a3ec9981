"""What makes the suite safe and fast under pytest-xdist (`make test` runs `-n 2 --dist
loadfile`): a test file's tests share one worker, so a module-scoped fixture (a vLLM engine, the
docs' working copy) is built once; session fixtures that cost seconds are built once for all
workers (`built_once`); the heaviest files start first so that no long file is left for the end
(`heaviest_first`, kept by xdist's scheduler: `keep_file_order`); and the container tests' image
is built by the controller (`Controller`), which outlives every worker.

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


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


# The fixture of the container tests (tests/deploy/conftest.py): they wait for an image that the
# controller builds during the run.
IMAGE_FIXTURE = "forage_cpu_image"


def needs_image(item: pytest.Item) -> bool:
    return IMAGE_FIXTURE in getattr(item, "fixturenames", ())


# Where the container tests go: after this share of the other files' measured seconds. The
# image they wait for was ready 450-460 s into 28-30-minute runs on 2 cores (the controller's
# summary line says when), well before 70%, which leaves room on a slower machine; `docker
# compose up` mostly waits on containers, so it should overlap the other worker's work, not end
# the run alone.
LATE_SHARE = 0.7


def heaviest_first(items: list[pytest.Item], seconds: dict[str, float],
                   late: frozenset[str] | set[str] = frozenset(),
                   late_share: float = LATE_SHARE) -> None:
    """Reorder `items` in place so that files run longest-first (items of a file keep their
    order; files with no figure keep their relative order after the measured ones).

    Files in `late` (the container tests, whose image is built during the run) go late but not
    last: once `late_share` of the other files' seconds come before them. Last, the 150-s
    compose test ran alone while the other worker had finished: two minutes of a core idle."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(file_of(item), len(order))
    files = sorted(order, key=lambda name: (-seconds.get(name, 0.0), order[name]))
    held = [name for name in files if name in late]
    rest = [name for name in files if name not in late]
    before = late_share * sum(seconds.get(name, 0.0) for name in rest)
    cut, done = 0, 0.0
    while cut < len(rest) and done < before:
        done += seconds.get(rest[cut], 0.0)
        cut += 1
    rank = {name: i for i, name in enumerate(rest[:cut] + held + rest[cut:])}
    items.sort(key=lambda item: rank[file_of(item)])


def keep_file_order(config: pytest.Config) -> None:
    """Tell xdist's loadfile scheduler to hand out files in collection order. Since 3.6 it
    reorders them by their number of tests, most first, unless told otherwise
    (`--no-loadscope-reorder`), which discarded `heaviest_first`: single-test files of minutes
    (`docker compose up`, the rehearsals, the GPU check's dry run) went last. Replayed from a
    run's own timings, that order ended 97 s after the suite's order would have (1,848 s of
    wall against 1,751 on 3,502 s of tests); the run itself ended at 1,842 s with a core
    mostly idle for its last two minutes."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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
        self.build_summary = ""

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

    def pytest_terminal_summary(self, terminalreporter) -> None:
        # after pytest_sessionfinish (the terminal reporter prints its summary last)
        if self.build_summary:
            terminalreporter.write_line(self.build_summary)

    def pytest_sessionfinish(self, session) -> None:
        if self.build is not None:
            self.build_summary = self.build.summary()
            self.build.stop()
            self.build = None
