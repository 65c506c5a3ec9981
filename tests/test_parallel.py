"""The parallel run's helpers (tests/parallel.py, tests/deploy/image_build.py): file order,
one build for all workers, and a worker attaching to the controller's image build."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from tests import parallel
from tests.deploy import image_build

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_heaviest_files_first_keeping_each_files_order() -> None:
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1",
                   "tests/b.py::t2", "tests/d.py::t1")
    parallel.heaviest_first(items, {"tests/b.py": 90.0, "tests/c.py": 200.0, "tests/a.py": 5.0})
    assert [item.nodeid for item in items] == [
        "tests/c.py::t1", "tests/b.py::t1", "tests/b.py::t2", "tests/a.py::t1",
        "tests/a.py::t2", "tests/d.py::t1"]


def test_late_files_go_after_a_share_of_the_other_work() -> None:
    """The container tests wait for an image built during the run: late, but not last, where
    one worker would run them while the other has nothing left."""
    seconds = {"tests/big.py": 300.0, "tests/compose.py": 150.0, "tests/m1.py": 100.0,
               "tests/m2.py": 80.0, "tests/s1.py": 60.0, "tests/s2.py": 50.0,
               "tests/s3.py": 10.0, "tests/rehearse.py": 20.0}
    items = _items(*(f"{name}::t" for name in seconds), "tests/new.py::t")
    late = {"tests/compose.py", "tests/rehearse.py"}
    parallel.heaviest_first(items, seconds, late, late_share=0.7)
    # others: 600 s; 0.7 of it (420 s) is reached with big + m1 + m2 (480 s)
    assert [item.nodeid.split("::")[0] for item in items] == [
        "tests/big.py", "tests/m1.py", "tests/m2.py", "tests/compose.py", "tests/rehearse.py",
        "tests/s1.py", "tests/s2.py", "tests/s3.py", "tests/new.py"]
    parallel.heaviest_first(items, seconds, late, late_share=1.0)  # after every measured file
    assert [item.nodeid.split("::")[0] for item in items][-4:] == [
        "tests/s3.py", "tests/compose.py", "tests/rehearse.py", "tests/new.py"]


def test_xdist_hands_out_files_in_the_suites_order(pytester, monkeypatch):
    """xdist's loadfile scheduler reorders files by their number of tests unless told not to:
    a one-test file that `heaviest_first` puts first must start first."""
    pytester.makeconftest(
        "from tests import parallel\n\n"
        "def pytest_configure(config):\n"
        "    parallel.keep_file_order(config)\n\n"
        "def pytest_collection_modifyitems(session, config, items):\n"
        "    parallel.heaviest_first(items, {'test_heavy.py': 100.0})\n")
    log = pytester.path / "starts.log"
    body = ("import os, time\n\n"
            "def _start(name):\n"
            f"    with open({str(log)!r}, 'a') as f:\n"
            "        f.write(name + '\\n')\n"
            "    time.sleep(0.2)\n\n")
    pytester.makepyfile(test_heavy=body + "def test_it():\n    _start('heavy')\n")
    for name in ("a", "b", "c"):
        tests = "".join(f"def test_{i}():\n    _start('{name}')\n\n" for i in range(3))
        pytester.makepyfile(**{f"test_many_{name}": body + tests})
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "xdist.plugin", "-n", "2", "--dist", "loadfile",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=10)
    starts = log.read_text().split()
    # without keep_file_order, the one-test file is handed out last, after the other two files
    assert "heavy" in starts[:2], starts


def test_file_seconds_name_files_that_exist() -> None:
    seconds = parallel.load_file_seconds()
    assert seconds, "tests/file_seconds.json is missing or empty"
    missing = [name for name in seconds if not (REPO / name).is_file()]
    assert len(missing) <= len(seconds) // 10, f"stale entries (refresh it): {missing}"


def test_built_once_across_processes(tmp_path: Path) -> None:
    """Two processes ask for the same folder at once: one builds, the other reuses it."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from types import SimpleNamespace
        sys.path.insert(0, {str(REPO)!r})
        from tests import parallel
        base = Path(sys.argv[1])
        factory = SimpleNamespace(getbasetemp=lambda: base)
        config = SimpleNamespace(workerinput={{}})
        def build(out):
            out.mkdir()
            with open(out.parent / "builds.log", "a") as log:
                log.write(sys.argv[2] + "\\n")
            time.sleep(1.0)
            (out / "model").write_text("ok")
        print(parallel.built_once(factory, config, "thing", build))
    """)
    workers = [tmp_path / "gw0", tmp_path / "gw1"]
    for worker in workers:
        worker.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w), w.name],
                              stdout=subprocess.PIPE, text=True) for w in workers]
    outs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert outs == [str(tmp_path / "thing")] * 2
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert (tmp_path / "thing" / "model").read_text() == "ok"


def test_a_worker_attaches_to_the_controllers_engine(tmp_path: Path) -> None:
    path = image_build.state_path(tmp_path)
    engine, error = image_build.attach(tmp_path, timeout=5, start_grace_s=0)
    assert engine is None and "no image build was started" in error

    path.write_text(json.dumps({"status": "failed", "error": "build-offline.sh failed (1)"}))
    assert image_build.attach(tmp_path, timeout=5) == (None, "build-offline.sh failed (1)")

    root = tmp_path / "dockerd" / "overlay"
    path.write_text(json.dumps({"status": "ready", "root": str(root),
                                "storage_driver": "overlay2"}))
    engine, error = image_build.attach(tmp_path, timeout=5)
    assert error is None
    assert engine.env["DOCKER_HOST"] == f"unix://{root / 'docker.sock'}"
    assert engine.proc is None  # attached, never started (or stopped) by this process


def test_the_controller_plugin_is_registered_in_a_parallel_run_only(pytester, monkeypatch):
    """xdist registers its controller in a trylast pytest_configure, after every conftest's:
    ours must look for it later (it once did not, and the image build never started)."""
    pytester.makeconftest(
        "from tests.conftest import pytest_sessionstart  # noqa: F401\n\n"
        "def pytest_terminal_summary(terminalreporter, config):\n"
        "    plugin = config.pluginmanager.get_plugin('forage-xdist-controller')\n"
        "    terminalreporter.write_line(f'controller plugin: {plugin is not None}')\n")
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    parallel_run = pytester.runpytest_subprocess("-p", "xdist.plugin", "-n", "2",
                                                 "-p", "no:cacheprovider")
    parallel_run.stdout.fnmatch_lines(["controller plugin: True"])
    serial_run = pytester.runpytest_subprocess("-p", "xdist.plugin", "-p", "no:cacheprovider")
    serial_run.stdout.fnmatch_lines(["controller plugin: False"])


def test_the_image_builds_summary_says_when_it_was_ready(tmp_path: Path) -> None:
    build = image_build.ImageBuild(tmp_path)
    assert "had not finished" in build.summary()
    build.engine = SimpleNamespace(root=tmp_path, storage_driver="vfs")  # a started engine
    build.timings = {"engine_s": 2.2, "base_images_s": 15.4, "image_s": 400.0,
                     "done_after_s": 417.6}
    assert build.summary() == ("forage:cpu image: ready 418 s after its build started "
                               "(engine 2 s, base images 15 s, image 400 s)")
