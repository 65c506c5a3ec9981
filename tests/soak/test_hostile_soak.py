"""Hostile soak (issue 14): the stream services and weight sync under attack at once, bounded.

Real processes on loopback — `forage rollout serve` (the session's tiny policy, pulling weights
from a real WeightSyncServer) feeding `forage scorer serve` through the rollouts stream — while
this test:

- puts a poison record of every kind, plus seeded fuzz (flipped, cut and padded bytes; fields
  dropped or set to hostile values), between good records on both streams;
- keeps raw gRPC clients that open Fetch and never read attached to the weight server (they
  reconnect every few seconds);
- publishes new weight versions, one of them a publish that fails.

Target: 0 crashes (both services exit 0 on SIGTERM), every good record processed and none of
them dead-lettered, every curated poison dead-lettered with a reason naming the problem, every
fuzzed record either processed or dead-lettered with a reason, nothing left pending, stalled
streams cancelled, and the replica on the newest version despite the stalled readers.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis
import torch
import yaml

from services.common.codec import decode_as, encode
from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.streams import RedisStreams
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory
from services.common.weight_sync import wire
from services.common.weight_sync.server import FETCHES, WeightSyncServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "forage_poison_records", ROOT / "tests" / "common" / "poison_records.py")
P = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(P)

QA_GT = {"target": ["Paris"]}
GOOD_GROUPS = 8
FUZZ = 30


def _start(args: list[str], log: Path) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class StalledReaders:
    """`count` raw gRPC clients that open Fetch and never read; every 3 s they reconnect."""

    def __init__(self, address: str, count: int) -> None:
        self.address = address
        self.calls: list[tuple[grpc.Channel, object]] = [self._open() for _ in range(count)]
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> tuple[grpc.Channel, object]:
        channel = grpc.insecure_channel(self.address)
        fetch = channel.unary_stream(wire.FETCH_METHOD,
                                     request_serializer=pb.FetchRequest.SerializeToString)
        return channel, fetch(pb.FetchRequest(), timeout=300)

    def _run(self) -> None:
        while not self._stop.wait(3.0):  # an attacker that comes back after being cut off
            for index, (channel, call) in enumerate(self.calls):
                call.cancel()
                channel.close()
                self.calls[index] = self._open()
                self.reopened += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for channel, call in self.calls:
            call.cancel()
            channel.close()


def _wait(condition, procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout: float,
          what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} crashed ({proc.returncode}):\n"
                                     f"{logs[name].read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s:\n" + "\n".join(
                f"--- {n}\n{log.read_text()[-2000:]}" for n, log in logs.items()))
        time.sleep(0.1)


def test_services_survive_poison_fuzz_and_stalled_weight_readers(tmp_path, redis_url, namespace,
                                                                 tiny_policy_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    rng = random.Random(14)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    server = WeightSyncServer(port=0, max_workers=6, max_fetches_per_peer=4,
                              stall_timeout_s=2.0).start()
    server.publish(weights, 1)
    stalled_before = FETCHES.labels("stalled")._value.get()
    readers = StalledReaders(server.address, 3)

    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    for kind in ("prompts", "rollouts", "scored"):
        streams.ensure_group(kind)
    client = streams.client

    # ---- the prompts stream: good groups, curated poison, fuzz
    good_groups = [PromptGroup(f"good-{i}", "nq", f"Who founded city {i}?", QA_GT, n=2,
                               sampling={"temperature": 1.0}) for i in range(GOOD_GROUPS)]
    curated = P.prompt_group_poisons(good_groups[0])
    curated.append(("future-version",
                    {b"payload": encode(PromptGroup("future", "nq", "q?", QA_GT, n=1,
                                                    policy_version_min=10**6))},
                    ("policy_version_min", "ahead of the version")))
    fuzz = P.fuzz_prompt_groups(good_groups[0], rng, FUZZ)
    # decodes, but the engine may fail on it (a temperature that overflows the logits)
    fuzz.append({b"payload": encode(PromptGroup("tiny-t", "nq", "q?", QA_GT, n=1,
                                                sampling={"temperature": 1e-300}))})
    prompt_ids = _mix(client, streams.key("prompts"), good_groups, curated, fuzz, rng)

    # ---- the rollouts stream: good trajectories beside the rollout's own, poison, fuzz
    ids = tokenizer.encode("<answer> Paris </answer>", add_special_tokens=False)
    good_trajectories = [Trajectory(f"direct-{i}", f"direct-{i}:0:0", "nq", 1, [3, 4], ids,
                                    [1] * len(ids), [0.0] * len(ids), ground_truth=QA_GT)
                         for i in range(6)]
    traj_curated = P.trajectory_poisons(good_trajectories[0], vocab_size=len(tokenizer) + 100)
    traj_fuzz = P.fuzz_trajectories(good_trajectories[0], rng, FUZZ)
    rollout_ids = _mix(client, streams.key("rollouts"), good_trajectories, traj_curated,
                       traj_fuzz, rng)

    name = f"soak-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": 5.0},
        "model": {"path": str(tiny_policy_dir)},
        "learner": {"weight_sync_host": "127.0.0.1", "weight_sync_port": server.port},
        "rollout": {"max_batch_size": 8, "use_search": False, "max_turns": 0,
                    "stop_strings": [], "weight_sync": True, "weight_poll_s": 0.5,
                    "weight_wait_s": 60, "heartbeat_s": 0.3, "name": name,
                    "max_tokens_per_turn": 6, "max_response_length": 6, "groups_per_batch": 6},
        "scorer": {"num_workers": 1, "http": False, "batch_size": 8, "block_ms": 200,
                   "tokenizer_path": str(tiny_policy_dir)},
        "data": {"n_samples": 2},
    }))
    logs = {"rollout": tmp_path / "rollout.log", "scorer": tmp_path / "scorer.log"}
    procs = {"rollout": _start(["rollout", "serve", "--config", str(config)], logs["rollout"]),
             "scorer": _start(["scorer", "serve", "--config", str(config)], logs["scorer"])}
    beat_key = f"{namespace}:heartbeat:rollout:{name}"

    def replica_version() -> int:
        raw = client.get(beat_key)
        return int(yaml.safe_load(raw)["policy_version"]) if raw else 0

    def drained(kind: str) -> bool:
        return streams.pending(kind) == 0 and streams.lag(kind) == 0

    try:
        _wait(lambda: drained("prompts") and drained("rollouts"), procs, logs, 150,
              "drained streams")
        # new weights while the stalled readers hold their streams; one publish fails
        server.publish({k: v + 0.001 for k, v in weights.items()}, 2)
        with pytest.raises(ValueError, match="cannot carry dtype"):
            server.publish({**weights, "bad": torch.zeros(2, dtype=torch.complex64)}, 3)
        server.publish({k: v + 0.002 for k, v in weights.items()}, 3)
        _wait(lambda: replica_version() == 3, procs, logs, 60, "replica on version 3")
        late = [PromptGroup(f"late-{i}", "nq", f"Where is {i}?", QA_GT, n=2,
                            policy_version_min=3) for i in range(2)]
        streams.publish_many("prompts", [encode(g) for g in late])
        good_groups += late
        want_scored = {f"{g.uid}:{g.attempt}:{k}" for g in good_groups for k in range(g.n)}
        want_scored |= {t.sample_id for t in good_trajectories}

        def scored_ids() -> set[str]:
            return {decode_as(f[b"payload"], ScoredTrajectory).trajectory.sample_id
                    for _, f in client.xrange(streams.key("scored"))}

        _wait(lambda: want_scored <= scored_ids() and drained("prompts")
              and drained("rollouts"), procs, logs, 90, "every good record scored")
        assert all(proc.poll() is None for proc in procs.values())
        codes = {n: _stop(proc) for n, proc in procs.items()}
        assert codes == {"rollout": 0, "scorer": 0}, {n: logs[n].read_text()[-3000:]
                                                      for n in logs}
    finally:
        for proc in procs.values():
            _stop(proc)
        readers.close()
        server.stop(0)

    dead = {d["id"]: d for d in streams.dead_letters(count=10_000)}
    for ids_, kind in ((prompt_ids, "prompts"), (rollout_ids, "rollouts")):
        for stream_id in ids_["good"]:
            assert stream_id not in dead, (kind, dead.get(stream_id))
        for stream_id, (poison_name, _fields, words) in ids_["curated"].items():
            assert stream_id in dead, (kind, poison_name)
            reason = dead[stream_id]["reason"]
            assert all(w.lower() in reason.lower() for w in words), (poison_name, reason)
        for stream_id in ids_["fuzz"]:
            if stream_id in dead:
                assert dead[stream_id]["reason"].strip(), (kind, stream_id)
    late_trajectories = [decode_as(f[b"payload"], Trajectory)
                         for _, f in client.xrange(streams.key("rollouts"))
                         if b"late-" in f.get(b"payload", b"")]
    assert late_trajectories and all(t.policy_version == 3 for t in late_trajectories
                                     if t.uid.startswith("late-"))
    assert FETCHES.labels("stalled")._value.get() > stalled_before  # the watchdog cut some
    assert time.monotonic() - started < 110, "the soak must stay well under 2 minutes"
    streams.close()


def _mix(client: redis.Redis, key: str, good: list, curated: list, fuzz: list,
         rng: random.Random) -> dict:
    """XADD good, curated poison and fuzz in a shuffled order (several of each per batch)."""
    entries = ([("good", {b"payload": encode(g)}, None) for g in good]
               + [("curated", fields, (name, fields, words)) for name, fields, words in curated]
               + [("fuzz", fields, None) for fields in fuzz])
    rng.shuffle(entries)
    out: dict = {"good": [], "curated": {}, "fuzz": []}
    for kind, fields, info in entries:
        stream_id = client.xadd(key, fields).decode()
        if kind == "curated":
            out["curated"][stream_id] = info
        else:
            out[kind].append(stream_id)
    return out
