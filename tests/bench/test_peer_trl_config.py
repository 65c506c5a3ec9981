"""bench/peer_trl.py: the shipped config and the settings it hands TRL describe the same run as
Forage's (a mismatch would make the side-by-side figures compare different work), and both tools
see the same prompt tokens."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("peer_trl", REPO / "bench" / "peer_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_trl"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_trl_settings_match_forage_config(tmp_path: Path) -> None:
    from services.common.config import load_config

    bench = _bench()
    cfg = load_config(bench.CONFIG, [])
    task = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    grpo = bench.trl_settings(tmp_path / "p", task, tmp_path, steps=7, save_every=3,
                              per_device=16)["grpo"]
    assert grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"] == \
        cfg.learner.train_batch_size * cfg.data.n_samples == 32
    assert grpo["num_generations"] == cfg.data.n_samples
    assert grpo["max_completion_length"] == cfg.rollout.max_tokens_per_turn \
        == cfg.rollout.max_response_length
    assert grpo["learning_rate"] == cfg.learner.lr
    assert (grpo["epsilon"], grpo["epsilon_high"]) == (0.2, 0.28)
    assert grpo["loss_type"] == "dapo" and grpo["beta"] == 0.0
    assert grpo["num_iterations"] == cfg.learner.ppo_epochs == 1
    assert grpo["gradient_checkpointing"] is False and grpo["bf16"] is False
    assert grpo["shuffle_dataset"] is False and cfg.data.shuffle is False
    assert (grpo["max_steps"], grpo["save_steps"], grpo["seed"]) == (7, 3, cfg.learner.seed)
    assert not cfg.rollout.use_search and not cfg.learner.eval_before
    reseeded = bench.trl_settings(tmp_path / "p", task, tmp_path, steps=7, save_every=3,
                                  per_device=16, seed=3)["grpo"]
    assert reseeded["seed"] == 3 and reseeded["shuffle_dataset"] is False  # same prompt order
    # `--set` reaches TRL's settings as it reaches Forage's config (long responses, a smaller step)
    longer = bench.trl_settings(tmp_path / "p", task, tmp_path, steps=7, save_every=3,
                                per_device=4, overrides=[
                                    "rollout.max_tokens_per_turn=256", "rollout.stop_strings=[]",
                                    "learner.train_batch_size=2"])
    assert longer["grpo"]["max_completion_length"] == 256 and longer["stop_strings"] == []
    assert longer["grpo"]["per_device_train_batch_size"] * longer["grpo"][
        "gradient_accumulation_steps"] == 2 * cfg.data.n_samples


def test_micro_batch_must_divide_the_step(tmp_path: Path) -> None:
    bench = _bench()
    with pytest.raises(bench.BenchError, match="must divide 32"):
        bench.trl_settings(tmp_path, {"train": tmp_path, "test": tmp_path}, tmp_path, 2, 1, 12)


def test_grpo_config_accepts_the_settings(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="trl is the bench extra (pip install -e '.[bench]'), for "
                        "bench/peer_trl.py only: make install leaves it out")
    from trl import GRPOConfig

    bench = _bench()
    grpo = bench.trl_settings(tmp_path, {"train": tmp_path, "test": tmp_path}, tmp_path, 5, 5,
                              8)["grpo"]
    # bench/peer_trl.py runs as a plain process. In a test worker an in-process trainer leaves
    # LOCAL_RANK set (tests/conftest.py), which accelerate reads as a CPU launch of several
    # processes: it then writes RANK, LOCAL_WORLD_SIZE... and wants a rendezvous address.
    with mock.patch.dict(os.environ):
        os.environ.pop("LOCAL_RANK", None)
        config = GRPOConfig(**grpo)
    # one generation batch = one optimizer step's 8 groups x 4 completions, as Forage's step
    assert config.generation_batch_size == 32
    assert config.steps_per_generation == config.gradient_accumulation_steps == 4


def test_prompt_tokens_and_stop_ids_are_the_same_for_both(tiny_policy_dir: Path) -> None:
    from transformers import AutoTokenizer

    bench = _bench()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    segments = [{"text": "<think> I need to find Ann. </think>\n<search> Ann </search>",
                 "trainable": True},
                {"text": "\n\n<information>Doc 1: Ann was born in Rome.</information>\n\n",
                 "trainable": False},
                {"text": "<think> Rome. </think>\n<answer> Rome </answer>", "trainable": True}]
    prompt = bench.render_prompt(tokenizer, "Where was Ann born?", segments)
    assert prompt.endswith("</information>\n\n") and "<answer> Rome" not in prompt
    assert "Question: Where was Ann born?" in prompt
    # Forage's agent loop encodes a text prompt without special tokens; TRL calls the tokenizer
    forage_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer(text=[prompt])["input_ids"][0] == forage_ids
    stops = bench.stop_token_ids(tokenizer, ["</search>", "</answer>"])
    assert stops[0] == tokenizer.eos_token_id and len(stops) == 3
    with pytest.raises(bench.BenchError, match="tokens in this vocabulary"):
        bench.stop_token_ids(tokenizer, ["no such stop string"])


def test_rates_and_checkpoint_choice() -> None:
    bench = _bench()
    run = bench.RunResult("x", steps=[1, 2, 3], times=[10.0, 12.0, 14.0],
                          tokens=[100.0, 64.0, 64.0], trajectories_per_step=32, wall_s=20.0,
                          checkpoints={2: (12.0, "a"), 3: (14.0, "b")})
    rates = run.rates()
    assert math.isclose(rates["steps_per_min"], 30.0) and math.isclose(rates["s_per_step"], 2.0)
    assert math.isclose(rates["gen_tokens_per_s"], 32.0)  # step 1's tokens are before the span
    assert math.isclose(rates["trajectories_per_s"], 16.0)
    assert bench.checkpoint_at(run, step=3) == (3, "b")
    assert bench.checkpoint_at(run, seconds=13.0) == (2, "a")
    assert bench.checkpoint_at(run, seconds=5.0) is None


def test_paired_sign_test_counts_only_the_disagreements() -> None:
    paired_sign_test = _bench().paired_sign_test

    assert paired_sign_test([1, 1, 1, 0, 1], [0, 0, 0, 0, 1]) == (3, 0, 0.25)
    assert paired_sign_test([1, 0, 1], [1, 0, 1]) == (0, 0, 1.0)
    only_a, only_b, p = paired_sign_test([1.0] * 10 + [0.0] * 5, [0.0] * 10 + [0.0] * 5)
    assert (only_a, only_b) == (10, 0) and p == pytest.approx(2 / 1024)
    assert paired_sign_test([1, 0], [0, 1])[2] == 1.0
    with pytest.raises(ValueError):
        paired_sign_test([1], [1, 0])
