"""Fixtures of tests/deploy: the deploy-file reader (deploy_files.py) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_helper():
    name = "forage_deploy_files"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("deploy_files.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def deploy():
    """tests/deploy/deploy_files.py (importlib mode cannot import it by name)."""
    return _load_helper()


@pytest.fixture(scope="session")
def rendered(deploy):
    """The objects `kubectl apply -k .` creates (kubectl kustomize, else the Python renderer)."""
    return deploy.render(deploy.K8S_ROOT)
