"""Fixtures of tests/deploy: the deploy-file reader (deploy_files.py) as a module, and for the
container tests a private Docker engine (dockerd.py) with Forage's CPU image built in it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.deploy.image_build import WANTED_FILE, ImageBuild, attach, engine_missing
from tests.parallel import needs_image

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


_BUILD: ImageBuild | None = None


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _shared_dir(config) -> Path:
    """The parallel run's shared folder: the controller's basetemp, each worker's parent."""
    return config._tmp_path_factory.getbasetemp().parent


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that need `forage:cpu` go last (in a parallel run the root conftest then places
    them for balance), and its build starts now, in the background. In a parallel run (xdist)
    the controller builds it: a worker only says it is wanted."""
    global _BUILD
    needs = [item for item in items if needs_image(item)]
    if not needs:
        return
    chosen = set(needs)
    items[:] = [item for item in items if item not in chosen] + needs
    if config.option.collectonly or engine_missing() is not None:
        return
    if _xdist_worker(config):
        (_shared_dir(config) / WANTED_FILE).touch()
    elif _BUILD is None:
        root = config._tmp_path_factory.mktemp("dockerd")
        _BUILD = ImageBuild(root).start()


_BUILD_SUMMARY = ""


def pytest_sessionfinish(session, exitstatus) -> None:
    global _BUILD, _BUILD_SUMMARY
    if _BUILD is not None:
        _BUILD_SUMMARY = _BUILD.summary()
        _BUILD.stop()
        _BUILD = None


def pytest_terminal_summary(terminalreporter) -> None:
    """A serial run's image build times (a parallel run's controller prints its own)."""
    if _BUILD_SUMMARY:
        terminalreporter.write_line(_BUILD_SUMMARY)


@pytest.fixture(scope="session")
def forage_cpu_image(request):
    """`forage:cpu` built from deploy/Dockerfile by deploy/build-offline.sh, on local stand-ins
    for the base images the Dockerfile and docker-compose.yml name (deploy/local-base-images.sh),
    in a private engine (tests/deploy/image_build.py); returns the engine."""
    reason = engine_missing()
    if reason:
        pytest.skip(reason)
    if _xdist_worker(request.config):
        engine, error = attach(_shared_dir(request.config))
    elif _BUILD is None:
        engine, error = None, "the image build was not started at collection"
    else:
        engine, error = _BUILD.wait()
    if error:
        pytest.fail(error)
    return engine


@pytest.fixture(scope="session")
def rendered(deploy):
    """The objects `kubectl apply -k .` creates (kubectl kustomize, else the Python renderer)."""
    return deploy.render(deploy.K8S_ROOT)


@pytest.fixture(scope="session")
def steps(deploy):
    """What each Kubernetes step of docs/deploy.md creates (deploy.K8S_STEPS), by step."""
    return {step: deploy.render(directory) for step, directory in deploy.K8S_STEPS.items()}
