"""Fixtures of tests/deploy: the deploy-file reader (deploy_files.py) as a module, and for the
container tests a private Docker engine (dockerd.py) with Forage's CPU image built in it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    if os.geteuid() != 0:
        return "the private Docker engine needs root"
    for tool in ("dockerd", "debootstrap"):
        if shutil.which(tool) is None:
            return f"no {tool} (make test installs Debian's docker.io and debootstrap as root)"
    return None


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    """A private dockerd (own data root, socket and networks; pulls fail at once), stopped and
    cleaned at the end of the session, also on failure."""
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    dockerd = _load_helper("forage_dockerd", "dockerd.py")
    root = tmp_path_factory.mktemp("dockerd")
    try:  # overlay2 where the kernel and filesystem allow it: ~3x faster than vfs here
        started = dockerd.Dockerd(root / "overlay", storage_driver="overlay2").start()
    except dockerd.DockerdError:
        started = dockerd.Dockerd(root / "vfs", storage_driver="vfs").start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def forage_cpu_image(docker_engine):
    """`forage:cpu` built from deploy/Dockerfile by deploy/build-offline.sh, on local stand-ins
    for the base images the Dockerfile and docker-compose.yml name (deploy/local-base-images.sh);
    returns the engine."""
    env = dict(os.environ, **docker_engine.env)
    bases = subprocess.run(["bash", str(REPO / "deploy" / "local-base-images.sh")], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=1800)
    assert bases.returncode == 0, bases.stdout[-3000:] + bases.stderr[-5000:]
    build = subprocess.run(["bash", str(REPO / "deploy" / "build-offline.sh"), "forage:cpu"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    return docker_engine


@pytest.fixture(scope="session")
def rendered(deploy):
    """The objects `kubectl apply -k .` creates (kubectl kustomize, else the Python renderer)."""
    return deploy.render(deploy.K8S_ROOT)


@pytest.fixture(scope="session")
def steps(deploy):
    """What each Kubernetes step of docs/deploy.md creates (deploy.K8S_STEPS), by step."""
    return {step: deploy.render(directory) for step, directory in deploy.K8S_STEPS.items()}
