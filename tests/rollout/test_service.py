"""`forage rollout serve` as real processes on a real Redis (and a real WeightSync server)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from services.common.codec import decode_as, encode
from services.common.ports import free_port as _free_port
from services.common.trajectory import PromptGroup, Trajectory

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path, redis_url, namespace, model_dir, name, **rollout) -> Path:
    settings = {"max_batch_size": 8, "use_search": False, "max_turns": 0, "stop_strings": [],
                "weight_sync": False, "heartbeat_s": 0.2, "heartbeat_ttl_s": 5, "name": name,
                "max_tokens_per_turn": 24, "max_response_length": 24, "weight_poll_s": 0.2}
    settings.update(rollout)
    config = {
        "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": 2.0},
        "model": {"path": str(model_dir)},
        "rollout": settings,
        "data": {"n_samples": 4},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "services.cli", "rollout", "serve", "--config", str(config)]
    for override in overrides:
        args += ["--set", override]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def wait_heartbeat(client, namespace, name, proc, log, timeout=90.0, busy=False) -> dict:
    key = f"{namespace}:heartbeat:rollout:{name}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        raw = client.get(key)
        if raw is not None:
            body = json.loads(raw)
            if not busy or body["busy"] > 0:
                return body
        time.sleep(0.02)
    raise AssertionError(f"no heartbeat at {key}:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def collect(streams, want: int, timeout: float) -> list[Trajectory]:
    out: list[Trajectory] = []
    deadline = time.time() + timeout
    while len(out) < want and time.time() < deadline:
        messages = streams.consume("rollouts", consumer="test", count=50, block_ms=200)
        for message in messages:
            out.append(decode_as(message.payload, Trajectory))
        if messages:
            streams.ack("rollouts", [m.id for m in messages])
    return out


def make_streams(redis_url, namespace):
    from services.common.config import load_config

    RedisStreams = importlib.import_module("services.common.streams").RedisStreams  # noqa: N806
    cfg = load_config(overrides=[f"redis.url={redis_url}", f"redis.namespace={namespace}"])
    streams = RedisStreams.from_config(cfg.redis)
    streams.ensure_group("prompts")
    streams.ensure_group("rollouts")
    return streams


def groups(count: int, n: int, prefix: str = "g", **kw) -> list[PromptGroup]:
    return [PromptGroup(uid=f"{prefix}{i}", data_source="math", prompt=f"Tom has {i} apples",
                        ground_truth=str(i), n=n, **kw) for i in range(count)]


def test_serve_publishes_heartbeats_metrics_and_stops_on_sigterm(
        tmp_path, redis_url, namespace, tiny_policy_dir):
    port = _free_port()
    config = write_config(tmp_path, redis_url, namespace, tiny_policy_dir, "r1",
                          metrics_port=port)
    client = redis.Redis.from_url(redis_url)
    streams = make_streams(redis_url, namespace)
    proc = start(config, tmp_path / "r1.log")
    try:
        wait_heartbeat(client, namespace, "r1", proc, tmp_path / "r1.log")
        assert 0 < client.ttl(f"{namespace}:heartbeat:rollout:r1") <= 5
        streams.publish_many("prompts", [encode(g) for g in groups(3, 4)])
        trajs = collect(streams, 12, 60)
        assert len(trajs) == 12
        assert sorted({t.uid for t in trajs}) == ["g0", "g1", "g2"]
        assert len({t.sample_id for t in trajs}) == 12
        assert all(len(t.response_ids) == len(t.loss_mask) == len(t.rollout_logprobs) > 0
                   for t in trajs)
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'forage_rollout_trajectories_total{finish_reason=' in body
        assert "forage_rollout_generated_tokens_total" in body
        assert stop(proc) == 0
        assert client.get(f"{namespace}:heartbeat:rollout:r1") is None
    finally:
        stop(proc)


def test_killed_replica_group_is_served_by_another_exactly_n(
        tmp_path, redis_url, namespace, tiny_policy_dir):
    client = redis.Redis.from_url(redis_url)
    streams = make_streams(redis_url, namespace)
    slow = {"max_tokens_per_turn": 3000, "max_response_length": 3000, "max_batch_size": 4}
    config_a = write_config(tmp_path, redis_url, namespace, tiny_policy_dir, "a", **slow)
    config_b = write_config(tmp_path, redis_url, namespace, tiny_policy_dir, "b",
                            max_tokens_per_turn=16, max_response_length=16)
    a = start(config_a, tmp_path / "a.log")
    b = None
    try:
        wait_heartbeat(client, namespace, "a", a, tmp_path / "a.log")
        streams.publish_many("prompts", [encode(g) for g in groups(1, 4, prefix="kill")])
        wait_heartbeat(client, namespace, "a", a, tmp_path / "a.log", busy=True, timeout=30)
        a.kill()  # mid-group: nothing of it is published, the group stays pending on "a"
        a.wait()
        assert collect(streams, 1, 0.5) == []
        b = start(config_b, tmp_path / "b.log")
        trajs = collect(streams, 4, 90)
        time.sleep(1.0)
        trajs += collect(streams, 1, 1.0)  # nothing more may arrive
        assert len(trajs) == 4, [t.sample_id for t in trajs]
        assert {t.uid for t in trajs} == {"kill0"}
        assert len({t.sample_id for t in trajs}) == 4
        assert all(len(t.response_ids) <= 16 for t in trajs)  # served by b
    finally:
        if a.poll() is None:
            a.kill()
        if b is not None:
            stop(b)


def test_weights_from_the_learner_change_outputs_and_version_tags(
        tmp_path, redis_url, namespace, tiny_policy_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.weight_sync.server import WeightSyncServer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    server = WeightSyncServer(port=0).start()
    server.publish(weights, version=1)
    client = redis.Redis.from_url(redis_url)
    streams = make_streams(redis_url, namespace)
    config = write_config(tmp_path, redis_url, namespace, tiny_policy_dir, "w", weight_sync=True)
    proc = start(config, tmp_path / "w.log", "learner.weight_sync_host=127.0.0.1",
                 f"learner.weight_sync_port={server.port}")
    try:
        beat = wait_heartbeat(client, namespace, "w", proc, tmp_path / "w.log")
        assert beat["policy_version"] == 1  # fetched before taking work
        eval_group = groups(1, 2, prefix="v1-", kind="eval")
        streams.publish_many("prompts", [encode(g) for g in eval_group])
        first = collect(streams, 2, 60)
        torch.manual_seed(3)
        server.publish({k: v + 0.3 * torch.randn_like(v) for k, v in weights.items()}, version=2)
        later = groups(1, 2, prefix="v2-", kind="eval", policy_version_min=2)
        streams.publish_many("prompts", [encode(g) for g in later])
        second = collect(streams, 2, 60)
        assert [t.policy_version for t in first] == [1, 1]
        assert [t.policy_version for t in second] == [2, 2]
        assert all(turn.policy_version == 2 for t in second for turn in t.turns)
        # greedy (eval) outputs of the same prompt differ under the new weights
        assert first[0].prompt_ids.tolist() == second[0].prompt_ids.tolist()
        assert first[0].response_ids.tolist() != second[0].response_ids.tolist()
    finally:
        stop(proc)
        server.stop()
