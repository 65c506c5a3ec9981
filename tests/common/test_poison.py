"""Poison records on the streams, fed to real consumer processes (issue 14, item 3).

`forage scorer serve` and `forage rollout serve` (the session's tiny policy) read a stream in
which a poison record of every kind sits between good ones, several per batch: 0 crashes,
every good record processed (none dead-lettered with its bad neighbours), every bad one in
`{ns}:dead` with a reason that names the problem.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import yaml

from services.common.codec import decode_as, encode
from services.common.streams import RedisStreams
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "forage_poison_records", Path(__file__).with_name("poison_records.py"))
P = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(P)

QA_GT = {"target": ["Paris"]}

# Reward functions that fail in the two ways a user's reward can (a test module on PYTHONPATH).
HOSTILE_REWARDS = """
def infinite(data_source, solution_str, ground_truth, extra_info=None):
    return float("inf")


def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the reward blew up")
"""


def _env(*extra_paths: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), *map(str, extra_paths),
                                       os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def _start(args: list[str], log: Path, *paths: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                            env=_env(*paths), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _interleave(client: redis.Redis, key: str, good: list[bytes], poison: list) -> dict:
    """XADD good and poison alternately; returns {stream id: poison} for the poison."""
    ids = {}
    for index in range(max(len(good), len(poison))):
        if index < len(good):
            client.xadd(key, {b"payload": good[index]})
        if index < len(poison):
            ids[client.xadd(key, poison[index][1]).decode()] = poison[index]
    return ids


def _wait(proc, log: Path, done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"consumer exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"consumer did not finish in {timeout}s:\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(0.1)


def _check_dead(streams: RedisStreams, poison_ids: dict) -> None:
    dead = {d["id"]: d for d in streams.dead_letters(count=1000)}
    assert set(dead) == set(poison_ids), (
        f"dead-lettered {sorted(dead)} but poison was {sorted(poison_ids)}")
    for stream_id, (name, _fields, words) in poison_ids.items():
        reason = dead[stream_id]["reason"]
        assert all(w.lower() in reason.lower() for w in words), (name, reason)
        assert len(reason) < 2000, (name, len(reason))


def _trajectory(tokenizer, response: str, uid: str) -> Trajectory:
    ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Trajectory(uid=uid, sample_id=f"{uid}:0:0", data_source="nq", policy_version=1,
                      prompt_ids=[3, 4, 5], response_ids=ids, loss_mask=[1] * len(ids),
                      rollout_logprobs=[0.0] * len(ids), ground_truth=QA_GT)


@pytest.mark.slow
def test_scorer_process_survives_a_poison_record_of_every_kind(tmp_path, redis_url, namespace,
                                                               tiny_policy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    good = [_trajectory(tokenizer, f"<answer> Paris {i} </answer>", f"good{i}")
            for i in range(12)]
    poison = P.trajectory_poisons(good[0], vocab_size=100_000)
    # Records that decode but whose reward fails: dead-lettered alone, with the reason.
    for source, words in (("infinite_task", ("reward", "inf")),
                          ("raising_task", ("reward failed", "the reward blew up"))):
        bad = _trajectory(tokenizer, "<answer> x </answer>", source)
        bad.data_source = source
        poison.append((source, {b"payload": encode(bad)}, words))
    (tmp_path / "hostile_rewards.py").write_text(HOSTILE_REWARDS)
    config = tmp_path / "scorer.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": 30.0},
        "scorer": {"num_workers": 1, "http": False, "batch_size": 8, "block_ms": 200,
                   "tokenizer_path": str(tiny_policy_dir),
                   "rewards": {"infinite_task": [{"function": "hostile_rewards:infinite"}],
                               "raising_task": [{"function": "hostile_rewards:boom"}]}},
    }))
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("rollouts")
    poison_ids = _interleave(streams.client, streams.key("rollouts"),
                             [encode(t) for t in good], poison)
    log = tmp_path / "scorer.log"
    proc = _start(["scorer", "serve", "--config", str(config)], log, tmp_path)
    try:
        _wait(proc, log, lambda: streams.client.xlen(streams.key("scored")) >= len(good)
              and streams.client.xlen(streams.key("dead")) >= len(poison)
              and streams.pending("rollouts") == 0 and streams.lag("rollouts") == 0, 120)
        assert proc.poll() is None
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        _stop(proc)
    scored = [decode_as(f[b"payload"], ScoredTrajectory)
              for _, f in streams.client.xrange(streams.key("scored"))]
    assert sorted(s.trajectory.sample_id for s in scored) == sorted(t.sample_id for t in good)
    assert all(s.reward == 0.0 for s in scored)  # "Paris 3" is not "Paris": scored, not lost
    _check_dead(streams, poison_ids)
    streams.close()


def _rollout_config(tmp_path: Path, redis_url: str, namespace: str, model_dir: Path) -> Path:
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": 30.0},
        "model": {"path": str(model_dir)},
        "rollout": {"max_batch_size": 8, "use_search": False, "max_turns": 0,
                    "stop_strings": [], "weight_sync": False, "heartbeat_s": 0.5,
                    "name": f"r-{uuid.uuid4().hex[:6]}", "max_tokens_per_turn": 8,
                    "max_response_length": 8, "groups_per_batch": 6},
        "data": {"n_samples": 2},
    }))
    return config


@pytest.mark.slow
def test_rollout_process_survives_a_poison_record_of_every_kind(tmp_path, redis_url, namespace,
                                                                tiny_policy_dir):
    good = [PromptGroup(uid=f"good{i}", data_source="nq", prompt=f"Who founded city {i}?",
                        ground_truth=QA_GT, n=2, sampling={"temperature": 1.0, "top_k": 5})
            for i in range(10)]
    poison = P.prompt_group_poisons(good[0])
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("prompts")
    streams.ensure_group("rollouts")
    poison_ids = _interleave(streams.client, streams.key("prompts"),
                             [encode(g) for g in good], poison)
    log = tmp_path / "rollout.log"
    config = _rollout_config(tmp_path, redis_url, namespace, tiny_policy_dir)
    proc = _start(["rollout", "serve", "--config", str(config)], log)
    try:
        _wait(proc, log, lambda: streams.client.xlen(streams.key("rollouts")) >= 2 * len(good)
              and streams.client.xlen(streams.key("dead")) >= len(poison)
              and streams.pending("prompts") == 0 and streams.lag("prompts") == 0, 180)
        assert proc.poll() is None
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        _stop(proc)
    trajectories = [decode_as(f[b"payload"], Trajectory)
                    for _, f in streams.client.xrange(streams.key("rollouts"))]
    assert sorted(t.uid for t in trajectories) == sorted(g.uid for g in good for _ in range(2))
    assert all(t.finish_reason != "error" for t in trajectories)
    _check_dead(streams, poison_ids)
    streams.close()


def test_a_group_the_engine_fails_on_is_dead_lettered_alone(redis_url, namespace,
                                                            tiny_policy_dir):
    """A record that decodes but makes the engine raise (here its test hook, for one prompt):
    the batch is replayed group by group, the good groups are published, only the failing one
    is dead-lettered with the exception. Real engine (tiny policy), real Redis; the worker's
    batch handling without its process wrapper."""
    import torch

    from services.common.config import load_config
    from services.rollout.transformers_engine import TransformersEngine
    from services.rollout.worker import RolloutWorker

    torch.set_num_threads(1)
    config = load_config(None, [
        f"redis.url={redis_url}", f"redis.namespace={namespace}", f"model.path={tiny_policy_dir}",
        "rollout.use_search=false", "rollout.max_turns=0", "rollout.weight_sync=false",
        "rollout.max_tokens_per_turn=6", "rollout.max_response_length=6",
        "rollout.stop_strings=[]", "rollout.max_batch_size=8"])
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=8, seed=0)
    tokenizer = engine.tokenizer

    def hook(request):
        if "POISON" in tokenizer.decode(request.prompt_ids):
            raise RuntimeError("engine fault for this prompt")
        return None

    engine.forced_tokens = hook
    worker = RolloutWorker(config, engine=engine)
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("prompts")
    streams.ensure_group("rollouts")
    worker._streams = streams
    groups = [PromptGroup(f"g{i}", "nq", "POISON here" if i == 2 else f"question {i}", QA_GT,
                          n=2) for i in range(4)]
    ids = streams.publish_many("prompts", [encode(g) for g in groups])
    try:
        worker._play(streams.consume("prompts", worker.name, count=8, block_ms=100))
        out = [decode_as(f[b"payload"], Trajectory)
               for _, f in streams.client.xrange(streams.key("rollouts"))]
        assert sorted(t.uid for t in out) == ["g0", "g0", "g1", "g1", "g3", "g3"]
        [dead] = streams.dead_letters()
        assert dead["id"] == ids[2]
        assert dead["reason"] == ("playing the group failed: RuntimeError: engine fault for "
                                  "this prompt")
        assert streams.pending("prompts") == 0 and not engine.has_unfinished()
        engine.forced_tokens = None  # the engine is clean for the next batch
        streams.publish("prompts", encode(PromptGroup("after", "nq", "again", QA_GT, n=2)))
        worker._play(streams.consume("prompts", worker.name, count=8, block_ms=100))
        assert streams.client.xlen(streams.key("rollouts")) == 8
    finally:
        worker.loop.close()
        streams.close()
