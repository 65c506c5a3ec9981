"""`forage learner train` as a real process on a real Redis, with a scripted rollout + scorer.

The script (this test) plays the replicas: it reads prompt groups from the prompts stream and
answers on the scored stream with hand-made trajectories, misbehaving on purpose — duplicate
deliveries, stale policy versions, a group left unanswered until it times out, a failed
(retriever error) trajectory — and the test checks the learner's accounting for each, then
that `--resume` continues from the checkpoint with the same step count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common.codec import decode_as, encode
from services.common.ports import free_port as _free_port
from services.common.streams import RedisStreams
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory, Turn
from services.common.weight_sync import WeightSyncClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _rows(count: int) -> list[dict]:
    return [{"data_source": "synth_single",
             "prompt": [{"role": "user", "content": f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}},
             "extra_info": {"index": i}} for i in range(count)]


def write_run(tmp_path: Path, redis_url: str, namespace: str, policy: Path, **learner) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(6)), data)
    settings = {"train_batch_size": 2, "total_steps": 4, "max_staleness": 0, "lr": 1e-4,
                "save_every": 2, "group_timeout_s": 3.0, "max_attempts": 3, "poll_ms": 50,
                "weight_sync_port": _free_port(), "micro_batch_tokens": 512,
                "eval_before": False, "eval_at_end": False}
    settings.update(learner)
    config = {"run_dir": str(tmp_path / "run"),
              "redis": {"url": redis_url, "namespace": namespace},
              "model": {"path": str(policy)},
              "data": {"train_files": [str(data)], "n_samples": 2, "seed": 3},
              "learner": settings}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_learner(config: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "services.cli", "learner", "train",
                             "--config", str(config), *extra], cwd=ROOT, env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def start_torchrun(config: Path, log: Path, ranks: int = 2, *extra: str,
                   launch: Sequence[str] = ("--standalone",), env: dict[str, str] | None = None,
                   **popen: Any) -> subprocess.Popen:
    """`forage learner train` (and `extra` arguments, e.g. --resume) under a real torchrun with
    `ranks` CPU ranks. `launch`: torchrun's rendezvous arguments (one standalone node, or one
    node of several: test_multinode.py); `env`: variables added; `popen`: Popen options."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **(env or {}))
    return subprocess.Popen([str(torchrun), *launch, f"--nproc_per_node={ranks}", "-m",
                             "services.cli", "learner", "train", "--config", str(config), *extra],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            **popen)


def trajectory(group: PromptGroup, index: int, version: int, *, error: bool = False) -> Trajectory:
    # Response length and reward differ by sample so GRPO has something to learn from.
    response = [7 + index, 8, 9, 10 + index][: 3 + index % 2]
    return Trajectory(
        uid=group.uid, sample_id=f"{group.uid}:{group.attempt}:{index}",
        data_source=group.data_source, policy_version=version,
        prompt_ids=[1, 2, 3, 4], response_ids=response, loss_mask=[1] * len(response),
        rollout_logprobs=[-1.0] * len(response),
        turns=[Turn(0, len(response), "answer")],
        finish_reason="error" if error else "answer", ground_truth=group.ground_truth,
        error="retriever unreachable" if error else None, kind=group.kind,
    )


class Script:
    """Scripted rollout + scorer: one answer policy per (uid, attempt)."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        from services.common.config.redis import RedisSection

        self.streams = RedisStreams.from_config(RedisSection(url=redis_url, namespace=namespace))
        self.streams.ensure_group("prompts")
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = namespace
        self.seen: list[tuple[str, int]] = []

    def version(self) -> int:
        raw = self.client.get(f"{self.namespace}:weights:version")
        return int(raw) if raw else 0

    def answer(self, group: PromptGroup, behaviour: str) -> None:
        version = self.version()
        items: list[Trajectory] = []
        if behaviour == "ignore":
            return
        if behaviour == "stale":
            items = [trajectory(group, i, version - 1) for i in range(group.n)]
        elif behaviour == "error":
            items = [trajectory(group, 0, version, error=True)]
            items += [trajectory(group, i, version) for i in range(1, group.n)]
        else:
            items = [trajectory(group, i, version) for i in range(group.n)]
            if behaviour == "duplicate":
                items = items + items
        scored = [ScoredTrajectory(t, reward=float(int(t.sample_id[-1]) % 2)) for t in items]
        self.streams.publish_many("scored", [encode(s) for s in scored])

    def serve(self, proc: subprocess.Popen, plan, until: float) -> None:
        while time.time() < until and proc.poll() is None:
            for message in self.streams.consume("prompts", "script", count=8, block_ms=100):
                group = decode_as(message.payload, PromptGroup)
                self.seen.append((group.uid, group.attempt))
                nth = len(dict.fromkeys(uid for uid, _ in self.seen))  # distinct groups so far
                self.answer(group, plan(group, nth))
                self.streams.ack("prompts", [message.id])


def run_to_end(config: Path, log: Path, script: Script, plan, seconds: float = 180,
               start=None) -> None:
    """One learner (`start_learner`, or `start` e.g. start_torchrun) answered by `script`
    until it exits; it must exit 0."""
    proc = (start or start_learner)(config, log)
    try:
        script.serve(proc, plan, until=time.time() + seconds)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loop_accounting_and_resume(tmp_path, redis_url, namespace, tiny_policy):
    config = write_run(tmp_path, redis_url, namespace, tiny_policy)
    log = tmp_path / "learner.log"
    script = Script(redis_url, namespace)

    def plan(group: PromptGroup, nth: int) -> str:
        # 1st group: duplicates; 2nd: stale at first issue; 3rd: ignored until the timeout;
        # 4th: one sample failed (retriever error) at first issue; the rest: normal.
        if group.attempt > 0:
            return "normal"
        return {1: "duplicate", 2: "stale", 3: "ignore", 4: "error"}.get(nth, "normal")

    proc = start_learner(config, log)
    try:
        script.serve(proc, plan, until=time.time() + 240)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = tmp_path / "run"
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["policy_version"] for m in lines] == [2, 3, 4, 5]
    last = lines[-1]
    # The 1st group's two samples came twice; the failed group's good sample came again with
    # its re-issue.
    assert last["groups/duplicates"] == 3
    assert last["groups/dropped_stale"] == 2  # both samples of the 2nd group's first answer
    assert last["groups/reissued_stale"] == 1
    assert last["groups/reissued_timeout"] >= 1
    assert last["groups/errors"] == 1 and last["groups/reissued_error"] == 1
    assert last["groups/trained"] == 8 and last["groups/balanced"] == 1
    assert all(m["staleness/max"] == 0 for m in lines)  # synchronous: nothing stale trained
    assert all(m["throughput/trajectories"] == 4 for m in lines)
    assert all(abs(m["reward/mean"] - 0.5) < 1e-9 for m in lines)
    # Re-issued groups came back with a higher attempt number.
    attempts = {}
    for uid, attempt in script.seen:
        attempts.setdefault(uid, []).append(attempt)
    assert sorted(len(a) for a in attempts.values() if len(a) > 1) == [2, 2, 2]
    # The published weights are the trained ones: a client can fetch version 5.
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_00000002", "step_00000004"]

    # Resume with two more steps: continues at step 5 with a fresh (never re-used) version.
    cfg = yaml.safe_load(config.read_text())
    cfg["learner"]["total_steps"] = 6
    config.write_text(yaml.safe_dump(cfg))
    proc = start_learner(config, log, "--resume")
    try:
        script.serve(proc, lambda g, n: "normal", until=time.time() + 180)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[4]["policy_version"] == 7  # 5 was published before the restart
    assert lines[-1]["groups/balanced"] == 1
    assert "resumed from" in log.read_text()


def test_eval_never_counts_a_failed_search(tmp_path, redis_url, namespace, tiny_policy):
    """An evaluation trajectory whose search failed (retriever not ready) is not a wrong
    answer: the question is issued again, and after learner.max_attempts left out and counted
    in eval/failed."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=1,
                       eval_before=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["test_files"] = cfg["data"]["train_files"]
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "learner.log"
    script = Script(redis_url, namespace)

    def plan(group: PromptGroup, nth: int) -> str:
        if group.kind != "eval":
            return "normal"
        if group.uid.endswith("-2"):
            return "error"  # never recovers
        return "error" if group.attempt == 0 and group.uid.endswith(("-0", "-1")) else "normal"

    run_to_end(config, log, script, plan)
    [evaluation] = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evaluation["eval/n"] == 5 and evaluation["eval/failed"] == 1
    assert evaluation["eval/missing"] == 0
    attempts = [a for uid, a in script.seen if uid.endswith("-2") and uid.startswith("eval")]
    assert attempts == [0, 1, 2]
    assert "left out of this evaluation" in log.read_text()


def test_held_out_plateau_stops_the_run_early(tmp_path, redis_url, namespace, tiny_policy):
    """learner.early_stop_patience: the scripted replica answers every evaluation question
    wrongly, so held-out EM never beats the evaluation before training; from
    early_stop_min_steps on the run stops after that step's evaluation (no evaluation
    repeated), checkpointed, with one line saying why, long before total_steps."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=10,
                       eval_before=True, eval_at_end=True, eval_every=1, save_every=100,
                       early_stop_patience=1, early_stop_min_steps=2)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["test_files"] = cfg["data"]["train_files"]
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "learner.log"
    run_to_end(config, log, Script(redis_url, namespace), lambda group, nth: "normal")
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if m["kind"] == "eval"] == [0, 1, 2]
    assert max(m["step"] for m in metrics if m["kind"] == "train") == 2
    assert "stopping early (learner.early_stop_patience)" in log.read_text()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_gae_with_pf_ppo_trains_on_the_drawn_batch(tmp_path, redis_url, namespace,
                                                    tiny_policy):
    """verl's PF-PPO in the loop: with GAE and use_pf_ppo the update trains on the batch
    resampled by reward. Under `pow` a reward-0 trajectory has (almost) no weight, so every
    drawn sample is a reward-1 one (4 response tokens each in the scripted batch: 16 loss
    tokens, where the batch as answered has 2 x (3 + 4) = 14)."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=2,
                       save_every=100, adv_estimator="gae", algorithm={"use_pf_ppo": True})
    log = tmp_path / "learner.log"
    run_to_end(config, log, Script(redis_url, namespace), lambda g, n: "normal")
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["throughput/trajectories"] == 4 for m in lines)
    assert [m["actor/loss_tokens"] for m in lines] == [16, 16]


def test_bad_estimator_fails_fast(tmp_path, redis_url, namespace, tiny_policy):
    # gdpo without the reward components it normalises cannot run (remax can since issue 18)
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, adv_estimator="gdpo")
    out = subprocess.run([sys.executable, "-m", "services.cli", "learner", "train", "--config",
                          str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2
    assert "gdpo needs learner.algorithm.gdpo_reward_keys" in out.stdout + out.stderr


def test_weight_client_sees_published_versions(tmp_path, redis_url, namespace, tiny_policy):
    """The learner publishes version 1 (its starting weights) before any work is issued."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=1)
    cfg = yaml.safe_load(config.read_text())
    log = tmp_path / "learner.log"
    proc = start_learner(config, log)
    client = WeightSyncClient(f"127.0.0.1:{cfg['learner']['weight_sync_port']}")
    script = Script(redis_url, namespace)
    try:
        deadline = time.time() + 120
        version = 0
        while time.time() < deadline and version == 0 and proc.poll() is None:
            try:
                version, _ = client.get_version()
            except Exception:  # not listening yet
                time.sleep(0.2)
        assert version == 1, log.read_text()[-3000:]
        got, state = client.fetch()
        assert got == 1 and any(name.endswith("embed_tokens.weight") for name in state)
        script.serve(proc, lambda g, n: "normal", until=time.time() + 120)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    assert read_metrics(tmp_path / "run")[-1]["policy_version"] == 2


def test_two_ranks_follow_rank_zero(tmp_path, redis_url, namespace, tiny_policy):
    """Under torchrun with 2 CPU ranks, rank 0 drives the streams and rank 1 follows every
    collective (steps, weight export, checkpoint) to a clean exit."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=2, zero_stage=2)
    run_to_end(config, tmp_path / "learner.log", Script(redis_url, namespace),
               lambda g, n: "normal", seconds=240, start=start_torchrun)
    lines = read_metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["throughput/trajectories"] == 4 for m in lines)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (ckpt / "rng_rank0.json").exists() and (ckpt / "rng_rank1.json").exists()


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_every_rank_then_resumes(
        tmp_path, redis_url, namespace, tiny_policy):
    """`docker stop` / pod deletion: SIGTERM reaches torchrun, which passes it to every rank.
    The ranks stop together at a step boundary with a complete ZeRO-3 checkpoint (every rank's
    part), exit cleanly, and a new run resumes from that step."""
    config = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=50,
                       save_every=100, zero_stage=3)
    log = tmp_path / "learner.log"
    proc = start_torchrun(config, log)
    script = Script(redis_url, namespace)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            script.serve(proc, lambda g, n: "normal", until=time.time() + 1)
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
        assert proc.poll() is None, log.read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        script.serve(proc, lambda g, n: "normal", until=time.time() + 60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    reached = max(m["step"] for m in read_metrics(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{reached:08d}"
    assert (ckpt / "trainer_state.json").is_file(), text[-4000:]
    assert (ckpt / "rng_rank0.json").is_file() and (ckpt / "rng_rank1.json").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == reached
    assert "finishing the current step, checkpointing" in text
    # torchrun prints its own SignalException traceback; no rank may fail in Forage's code
    assert f'File "{ROOT / "services"}' not in text and "internal error" not in text, \
        text[-4000:]

    resumed = write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=reached + 1,
                        save_every=100, zero_stage=3)
    run_to_end(resumed, log, script, lambda g, n: "normal")
    steps = [m["step"] for m in read_metrics(tmp_path / "run")]
    assert steps[-1] == reached + 1 and steps.count(reached + 1) == 1
