"""The container tests' image: a private dockerd (tests/deploy/dockerd.py) with `forage:cpu`
built in it, in a background thread, so that the build (mostly downloads, unpacking and copying)
overlaps the rest of the suite.

One process owns the build and the engine: the pytest process in a serial run, the xdist
controller in a parallel one (a worker's session can end while another worker still runs the
container tests, so no worker may own the engine). The owner writes the build's state to a JSON
file (`state_path`); a worker that needs the image waits for that file and attaches to the engine
by its root folder (the Docker CLI only needs the socket and config paths under it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from tests.deploy import dockerd as dockerd_module
from tests.suite_rules import MISSING_TOOL

REPO = Path(__file__).resolve().parents[2]
STATE_FILE = "forage-image-build.json"
WANTED_FILE = "forage-image-wanted"
BUILD_TIMEOUT_S = 4200.0


def engine_missing() -> str | None:
    """Why the private engine cannot run here: a skip; under CI as root with apt-get, a missing
    tool fails (tests/suite_rules.py: `make test` installs it there)."""
    if os.geteuid() != 0:
        return "the private Docker engine needs root"
    for tool in ("dockerd", "debootstrap"):
        if shutil.which(tool) is None:
            return (f"{MISSING_TOOL} no {tool} (make test installs Debian's docker.io and "
                    "debootstrap as root)")
    return None


def state_path(shared_dir: Path) -> Path:
    return Path(shared_dir) / STATE_FILE


def _write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # readers never see half a file


class ImageBuild:
    """The engine and the build, in a daemon thread; stopped and cleaned at the end of the
    session, also on failure or interruption."""

    def __init__(self, root: Path, state_file: Path | None = None) -> None:
        self.root = root
        self.state_file = state_file
        self.engine: Any = None
        self.engine_error: str | None = None
        self.build_error: str | None = None
        self._cancelled = threading.Event()
        self._child: subprocess.Popen | None = None
        # seconds per build step and when the image was ready, after start() (the run's summary
        # prints them: where the suite places the container tests depends on them)
        self.timings: dict[str, float] = {}
        self._started = 0.0
        self._thread = threading.Thread(target=self._run, name="forage-image-build",
                                        daemon=True)

    def start(self) -> ImageBuild:
        self._started = time.monotonic()
        if self.state_file is not None:
            _write_state(self.state_file, {"status": "building"})
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._build()
        finally:
            self.timings["done_after_s"] = time.monotonic() - self._started
            if self.state_file is not None:
                _write_state(self.state_file, self._state())

    def _state(self) -> dict[str, Any]:
        if self.engine is None:
            return {"status": "failed", "error": f"the private dockerd did not start: "
                    f"{self.engine_error}"}
        if self.build_error:
            return {"status": "failed", "error": self.build_error}
        return {"status": "ready", "root": str(self.engine.root),
                "storage_driver": self.engine.storage_driver}

    def _build(self) -> None:
        try:  # overlay2 where the kernel and filesystem allow it: ~3x faster than vfs here
            self.engine = dockerd_module.Dockerd(self.root / "overlay",
                                                 storage_driver="overlay2").start()
        except dockerd_module.DockerdError:
            try:
                self.engine = dockerd_module.Dockerd(self.root / "vfs",
                                                     storage_driver="vfs").start()
            except Exception as error:  # noqa: BLE001 - reported by the test that needs it
                self.engine_error = f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001
            self.engine_error = f"{type(error).__name__}: {error}"
        self.timings["engine_s"] = time.monotonic() - self._started
        if self.engine is None:
            return
        env = dict(os.environ, **self.engine.env)
        try:
            for name, argv, timeout in (
                ("base_images_s", ["bash", str(REPO / "deploy" / "local-base-images.sh")], 1800),
                ("image_s", ["bash", str(REPO / "deploy" / "build-offline.sh"), "forage:cpu"],
                 2400),
            ):
                began = time.monotonic()
                error = self._step(argv, env, timeout)
                self.timings[name] = time.monotonic() - began
                if error:
                    self.build_error = error
                    return
        except Exception:  # noqa: BLE001
            self.build_error = traceback.format_exc()

    def _step(self, argv: list[str], env: dict[str, str], timeout: float) -> str | None:
        if self._cancelled.is_set():
            return "cancelled: the test session ended first"
        self._child = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        try:
            out, err = self._child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._child.kill()
            out, err = self._child.communicate()
            return f"{argv[1]} ran past {timeout:.0f} s\n" + out[-3000:] + err[-5000:]
        if self._child.returncode != 0:
            return (f"{argv[1]} failed ({self._child.returncode})\n" + out[-3000:]
                    + err[-5000:])
        return None

    def summary(self) -> str:
        """One line for the run's summary: how long the build took and when it was ready."""
        if "done_after_s" not in self.timings:
            return "forage:cpu image: the build had not finished when the run ended"
        state = self._state()
        parts = ", ".join(f"{label} {self.timings[key]:.0f} s" for key, label in (
            ("engine_s", "engine"), ("base_images_s", "base images"), ("image_s", "image"))
            if key in self.timings)
        return (f"forage:cpu image: {state['status']} {self.timings['done_after_s']:.0f} s "
                f"after its build started ({parts})")

    def wait(self, timeout: float = BUILD_TIMEOUT_S) -> tuple[Any, str | None]:
        """(engine, None) once `forage:cpu` is built, else (None, why not)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None, f"the image build did not finish within {timeout:.0f} s"
        state = self._state()
        if state["status"] != "ready":
            return None, state["error"]
        return self.engine, None

    def stop(self) -> None:
        self._cancelled.set()
        child = self._child
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._thread.join(120)
        if self.engine is not None:
            self.engine.stop()


def attach(shared_dir: Path, timeout: float = BUILD_TIMEOUT_S,
           start_grace_s: float = 120.0) -> tuple[Any, str | None]:
    """In an xdist worker: wait for the controller's build (its state file) and return a
    Dockerd bound to that engine, never started or stopped by this process."""
    path = state_path(shared_dir)
    started = time.monotonic()
    while True:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = None
        if state is None and time.monotonic() - started > start_grace_s:
            return None, (f"no image build was started for this parallel run ({path} is "
                          "missing): the controller starts it when a worker collects a test "
                          "that needs the image (tests/conftest.py)")
        if state is not None and state["status"] == "ready":
            return dockerd_module.Dockerd(state["root"],
                                          storage_driver=state["storage_driver"]), None
        if state is not None and state["status"] == "failed":
            return None, state["error"]
        if time.monotonic() - started > timeout:
            return None, f"the image build did not finish within {timeout:.0f} s"
        time.sleep(2.0)
