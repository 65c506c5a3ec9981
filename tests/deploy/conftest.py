"""Fixtures of tests/deploy: the deploy-file reader (deploy_files.py) as a module, and for the
container tests a private Docker engine (dockerd.py) with Forage's CPU image built in it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.suite_rules import MISSING_TOOL

REPO = Path(__file__).resolve().parents[2]


def _load_helper(name: str, file: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def deploy():
    """tests/deploy/deploy_files.py (importlib mode cannot import it by name)."""
    return _load_helper("forage_deploy_files", "deploy_files.py")


@pytest.fixture(scope="session")
def keda_rule():
    """tests/deploy/keda_rule.py: the rollout ScaledObject's rule as KEDA and its HPA apply it."""
    return _load_helper("forage_keda_rule", "keda_rule.py")


def _engine_missing() -> str | None:
    """Why the private engine cannot run here: a skip; under CI as root with apt-get, a missing
    tool fails (tests/suite_rules.py: `make test` installs it there)."""
    if os.geteuid() != 0:
        return "the private Docker engine needs root"
    for tool in ("dockerd", "debootstrap"):
        if shutil.which(tool) is None:
            return (f"{MISSING_TOOL} no {tool} (make test installs Debian's docker.io and "
                    "debootstrap as root)")
    return None


class ImageBuild:
    """The private dockerd (own data root, socket and networks; pulls fail at once) with
    `forage:cpu` built in it, all in a background thread started once tests are collected: the
    build (local stand-ins for the base images by deploy/local-base-images.sh, then
    deploy/build-offline.sh) is mostly downloads, unpacking and copying, so it overlaps the rest
    of the suite, and the tests that need the image run last. Stopped and cleaned at the end of
    the session, also on failure or interruption."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.engine: Any = None
        self.engine_error: str | None = None
        self.build_error: str | None = None
        self._cancelled = threading.Event()
        self._child: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="forage-image-build",
                                        daemon=True)

    def start(self) -> ImageBuild:
        self._thread.start()
        return self

    def _run(self) -> None:
        dockerd = _load_helper("forage_dockerd", "dockerd.py")
        try:  # overlay2 where the kernel and filesystem allow it: ~3x faster than vfs here
            self.engine = dockerd.Dockerd(self.root / "overlay", storage_driver="overlay2").start()
        except dockerd.DockerdError:
            try:
                self.engine = dockerd.Dockerd(self.root / "vfs", storage_driver="vfs").start()
            except Exception as error:  # noqa: BLE001 - reported by the test that needs it
                self.engine_error = f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001
            self.engine_error = f"{type(error).__name__}: {error}"
        if self.engine is None:
            return
        env = dict(os.environ, **self.engine.env)
        try:
            for argv, timeout in (
                (["bash", str(REPO / "deploy" / "local-base-images.sh")], 1800),
                (["bash", str(REPO / "deploy" / "build-offline.sh"), "forage:cpu"], 2400),
            ):
                error = self._step(argv, env, timeout)
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

    def wait(self, timeout: float = 4200.0) -> Any:
        """The engine with `forage:cpu` in it; fails the test that asks when the build did."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"the image build did not finish within {timeout:.0f} s")
        if self.engine is None:
            pytest.fail(f"the private dockerd did not start: {self.engine_error}")
        if self.build_error:
            pytest.fail(self.build_error)
        return self.engine

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


_BUILD: ImageBuild | None = None


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that need `forage:cpu` go last, and its build starts now, in the background."""
    global _BUILD
    needs = [item for item in items if "forage_cpu_image" in getattr(item, "fixturenames", ())]
    if not needs:
        return
    chosen = set(needs)
    items[:] = [item for item in items if item not in chosen] + needs
    if _BUILD is None and not config.option.collectonly and _engine_missing() is None:
        root = config._tmp_path_factory.mktemp("dockerd")
        _BUILD = ImageBuild(root).start()


def pytest_sessionfinish(session, exitstatus) -> None:
    global _BUILD
    if _BUILD is not None:
        _BUILD.stop()
        _BUILD = None


@pytest.fixture(scope="session")
def forage_cpu_image():
    """`forage:cpu` built from deploy/Dockerfile by deploy/build-offline.sh, on local stand-ins
    for the base images the Dockerfile and docker-compose.yml name (deploy/local-base-images.sh),
    in a private engine (ImageBuild); returns the engine."""
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    if _BUILD is None:
        pytest.fail("the image build was not started at collection")
    return _BUILD.wait()


@pytest.fixture(scope="session")
def rendered(deploy):
    """The objects `kubectl apply -k .` creates (kubectl kustomize, else the Python renderer)."""
    return deploy.render(deploy.K8S_ROOT)


@pytest.fixture(scope="session")
def steps(deploy):
    """What each Kubernetes step of docs/deploy.md creates (deploy.K8S_STEPS), by step."""
    return {step: deploy.render(directory) for step, directory in deploy.K8S_STEPS.items()}
