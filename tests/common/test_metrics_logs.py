"""The metrics endpoint helper and structured log lines."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common.logs import set_log_context, setup_logging
from services.common.metrics import MetricsServer


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_server_serves_registry_and_health() -> None:
    registry = CollectorRegistry()
    counter = Counter("forage_test_items_total", "items seen", registry=registry)
    counter.inc(3)
    ready = {"value": False}
    server = MetricsServer(port=0, registry=registry, healthy=lambda: ready["value"]).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, body = _get(f"{base}/metrics")
        assert status == 200 and "forage_test_items_total 3.0" in body
        assert _get(f"{base}/healthz")[0] == 503
        ready["value"] = True
        assert _get(f"{base}/healthz") == (200, "ok\n")
        assert _get(f"{base}/nope")[0] == 404
    finally:
        server.stop()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_lines_carry_service_run_and_version(fmt, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FORAGE_LOG_FORMAT", fmt)
    logger = setup_logging("scorer", run_id="r42")
    set_log_context(policy_version=7)
    logger.info("scored %d items", 5)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if fmt == "json":
        body = json.loads(line)
        assert body["service"] == "scorer" and body["run_id"] == "r42"
        assert body["policy_version"] == 7 and body["msg"] == "scored 5 items"
    else:
        assert "[scorer run=r42 v=7]" in line and line.endswith("scored 5 items")
    set_log_context(policy_version=0)
    logging.getLogger().handlers.clear()
