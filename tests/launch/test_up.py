"""`forage up` refuses a run it cannot start, with the failing service and its log named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_up_stops_on_a_learner_config_error(tmp_path, redis_url, namespace):
    config = tmp_path / "run.yaml"
    # no model.path and no training data: the learner exits 2 at start-up
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"),
                                      "redis": {"url": redis_url, "namespace": namespace}}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(config)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "learner exited with code 2" in text
    assert "model.path is not set" in text  # the learner's own message, from its log
    assert (tmp_path / "run" / "logs" / "learner.log").exists()
    # the resolved config every child read was written, with the Redis URL filled in
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert resolved["redis"]["url"] == redis_url


def test_children_share_counts_only_the_services_that_run() -> None:
    """The cores are split among the processes `forage up` starts: a run without a retriever
    (a single-turn task) has one process fewer to share them with."""
    from services.launch.up import children_share

    assert children_share(1) == 4  # retriever, learner, scorer, one replica
    assert children_share(2, retriever=False) == 4
    assert children_share(1, retriever=False) == 3


def test_one_launch_never_hands_the_same_port_to_two_keys(tmp_path, monkeypatch) -> None:
    """Every port `forage up` fixes is distinct, even when the random draw repeats itself:
    here each candidate comes up twice in a row, which gave two keys one port (and the
    scorer's /healthz poll then read the learner's gRPC listener)."""
    from services.common import ports
    from services.common.config import RunConfig
    from services.launch.up import resolve_config

    pool: list[int] = []
    while len(pool) < 8:
        port = ports.free_port()
        if port not in pool:
            pool.append(port)
    draws = iter([port for port in pool for _ in range(2)] * 4)
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"),
        "retriever": {"index_dir": str(tmp_path / "index"), "port": 0},
        "learner": {"weight_sync_port": 0, "metrics_port": 0},
        "scorer": {"port": 0, "metrics_port": 0},
    })
    resolved, rollout_ports = resolve_config(cfg, "redis://127.0.0.1:6379/0", 3)
    chosen = [resolved.retriever.port, resolved.learner.weight_sync_port,
              resolved.learner.metrics_port, resolved.scorer.port,
              resolved.scorer.metrics_port, *rollout_ports]
    assert len(set(chosen)) == len(chosen), chosen
    assert set(chosen) <= set(pool)  # still the drawn ports below the ephemeral range
