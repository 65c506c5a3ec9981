"""services/eval uses the services' code (as services/launch does); no service imports it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_service_imports_services_eval() -> None:
    spec = importlib.util.spec_from_file_location(
        "service_boundaries", ROOT / "tests" / "test_service_boundaries.py")
    assert spec is not None and spec.loader is not None
    boundaries = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boundaries)
    bad = [line for service in (*boundaries.SERVICES, "common", "tasks")
           for line in boundaries.crossings(service, ("eval",))]
    assert not bad, "\n".join(bad)
