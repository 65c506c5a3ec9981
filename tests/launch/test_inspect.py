"""`forage inspect RUN_DIR` reads samples.jsonl as the learner writes it; `forage streams dead`
decodes what a real Redis holds in the dead-letter stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.codec import encode
from services.common.streams import RedisStreams
from services.common.trajectory import (
    Probe,
    PromptGroup,
    ScoredTrajectory,
    Trajectory,
    Turn,
)

ROOT = Path(__file__).resolve().parents[2]


def forage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def scored(tokenizer, uid: str, index: int, truth: str, answer: str, kind: str = "train"
           ) -> ScoredTrajectory:
    search = tokenizer.encode(f"<search> where is {truth} </search>", add_special_tokens=False)
    obs = tokenizer.encode(f'\n\n<information>Doc 1(Title: "{truth} Vel") lives in Pigir.'
                           "</information>\n\n", add_special_tokens=False)
    final = tokenizer.encode(f"<answer> {answer} </answer>", add_special_tokens=False)
    response = search + obs + final
    a, b = len(search), len(search) + len(obs)
    traj = Trajectory(
        uid=uid, sample_id=f"{uid}:0:{index}", data_source="synth_multihop", policy_version=6,
        prompt_ids=[1, 2], response_ids=response,
        loss_mask=[1] * a + [0] * len(obs) + [1] * len(final),
        rollout_logprobs=[-1.0] * len(response),
        turns=[Turn(0, a, "search", f"where is {truth}", 6,
                    docs=[{"id": "154", "title": f"{truth} Vel"}]),
               Turn(b, len(response), "answer", answer, 6)],
        num_searches=1, ground_truth={"target": [truth]}, kind=kind,
        extra={"question": f"Where does {truth} live?"},
        probe=Probe([0.0, 1.0], [["x"], ["y"]]),
    )
    reward = float(answer == truth)
    return ScoredTrajectory(traj, reward, {"em": reward}, probe_scores=[0.0, reward])


@pytest.fixture()
def run_dir(tmp_path: Path, tiny_policy_dir: Path) -> Path:
    """samples.jsonl written by the learner's own SampleLog: eval at 0, train at 2 and 4."""
    from transformers import AutoTokenizer

    from services.learner.samples import SampleLog

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    log = SampleLog(tmp_path, tokenizer, n=4)
    log.write([scored(tokenizer, "e1", 0, "zikax", "zikax", "eval")], 0, "eval")
    for step in (2, 4):
        log.write([scored(tokenizer, f"g{step}", 0, "zikax", "zikax"),
                   scored(tokenizer, f"g{step}", 1, "zikax", "mora")], step, "train")
    with (tmp_path / "samples.jsonl").open("a") as handle:
        handle.write('{"step": 5, "kind": "tr')  # the learner is mid-write
    return tmp_path


def test_inspect_shows_the_newest_step_readably(run_dir):
    out = forage("inspect", str(run_dir))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "5 samples" in text and "train at steps 2, 4; eval at steps 0" in text
    assert "1 unreadable line(s) skipped" in text
    assert text.count("=== step 4 train") == 2 and "=== step 2" not in text
    assert "Q:      Where does zikax live?" in text and "truth:  zikax" in text
    assert '[1] search "where is zikax"' in text and 'retrieved: 154 "zikax Vel"' in text
    assert "answer: 'mora'" in text and "reward 0.00 (wrong; em 0.00)" in text
    assert "probe:  0.00->0.00  1.00->1.00" in text
    assert "<information>" not in text  # passages only with --observations
    assert "lives in Pigir" in forage("inspect", str(run_dir), "--observations").stdout


def test_inspect_filters_step_wrong_kind_and_limit(run_dir):
    wrong = forage("inspect", str(run_dir), "--step", "2", "--wrong").stdout
    assert wrong.count("=== step 2 train") == 1 and "(wrong" in wrong and "(correct" not in wrong
    evals = forage("inspect", str(run_dir), "--kind", "eval").stdout
    assert evals.count("=== step 0 eval") == 1
    assert forage("inspect", str(run_dir), "--limit", "1").stdout.count("=== step") == 1
    none_wrong = forage("inspect", str(run_dir), "--kind", "eval", "--wrong")
    assert none_wrong.returncode == 0 and "no wrong samples to show at step 0" in none_wrong.stdout


def test_inspect_errors_are_one_line(run_dir, tmp_path):
    missing_step = forage("inspect", str(run_dir), "--step", "3")
    assert missing_step.returncode == 2
    assert missing_step.stderr.strip() == ("forage inspect: error: no samples at step 3; "
                                           "logged: train at steps 2, 4; eval at steps 0")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = forage("inspect", str(empty))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "samples.jsonl does not exist" in out.stderr


def test_streams_dead_decodes_real_dead_letters(tmp_path, redis_url, namespace,
                                                tiny_policy_dir):
    from transformers import AutoTokenizer

    from services.common.config.redis import RedisSection

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    streams = RedisStreams.from_config(RedisSection(url=redis_url, namespace=namespace))
    for kind in ("prompts", "scored"):
        streams.ensure_group(kind)
    group = PromptGroup(uid="grp-7", data_source="nq", prompt="Who wrote it?",
                        ground_truth={"target": ["x"]}, n=4)
    streams.publish("prompts", encode(group))
    streams.publish("scored", b"\x93not msgpack at all")
    streams.publish("scored", encode(scored(tokenizer, "grp-9", 1, "zikax", "mora")))
    prompts = streams.consume("prompts", "c1", count=5, block_ms=100)
    bad, good = streams.consume("scored", "c1", count=5, block_ms=100)
    streams.dead_letter("prompts", prompts[0], "rollout: prompt longer than max_prompt_length")
    streams.dead_letter("scored", bad, "undecodable: not a msgpack payload")
    streams.dead_letter("scored", good, "reward function raised ValueError")
    streams.close()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"redis": {"url": redis_url, "namespace": namespace}}))

    out = forage("streams", "dead", "--config", str(config))
    assert out.returncode == 0, out.stderr
    reasons = [line for line in out.stdout.splitlines() if line.startswith("  reason:")]
    assert reasons == ["  reason:  reward function raised ValueError",  # newest first
                       "  reason:  undecodable: not a msgpack payload",
                       "  reason:  rollout: prompt longer than max_prompt_length"]
    text = out.stdout
    assert "payload: scored_trajectory: uid='grp-9'" in text and "reward=0.0" in text
    assert "payload: undecodable (19 bytes, starts 936e6f74" in text
    assert "payload: prompt_group: uid='grp-7'" in text and "prompt='Who wrote it?'" in text
    assert f"from {namespace}:prompts (group" in text and "1 deliveries" in text

    only = forage("streams", "dead", "--config", str(config), "--stream", "prompts", "--json")
    [line] = only.stdout.strip().splitlines()
    entry = json.loads(line)
    assert entry["kind"] == "prompts" and entry["payload"]["uid"] == "grp-7"
    assert entry["payload"]["n"] == 4
    limited = forage("streams", "dead", "--config", str(config), "--limit", "1")
    assert limited.stdout.count("  reason:") == 1 and "raised ValueError" in limited.stdout

    empty = tmp_path / "other.yaml"
    empty.write_text(yaml.safe_dump({"redis": {"url": redis_url,
                                               "namespace": f"{namespace}-none"}}))
    none = forage("streams", "dead", "--config", str(empty))
    assert none.returncode == 0 and "no dead-lettered messages" in none.stdout


def test_streams_dead_without_redis_is_one_line(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"redis": {"url": f"redis://127.0.0.1:{port}/0"}}))
    out = forage("streams", "dead", "--config", str(config), env={"REDIS_URL": ""})
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert f"no Redis answers at redis://127.0.0.1:{port}/0" in out.stderr
