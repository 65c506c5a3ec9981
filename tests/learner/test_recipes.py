"""Search-R1's two recipes ship as configs: every value checked against train_grpo.sh /
train_ppo.sh / ppo_trainer.yaml, each line naming its source, the learner's validation run on
them; and the knobs they needed (verl's ratio warm-up, per RL step) take effect in training."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import ConfigError, load_config
from services.common.config.learner import LearnerSection
from services.learner.algorithms import AlgorithmSettings
from services.learner.engine import ratio_warmup_lambda, rl_updates_per_step, warmup_lambda
from services.learner.rl_batch import check_estimator

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "configs" / "search_r1_nq_hotpotqa.yaml"
PPO = ROOT / "configs" / "search_r1_nq_hotpotqa_ppo.yaml"

# Both scripts (PeterGriffinJin/Search-R1 train_grpo.sh, train_ppo.sh) and the yaml defaults
# they leave alone: dotted Forage key -> value.
SHARED = {
    "retriever.topk": 3,                          # sh retriever.topk=3
    "rollout.max_turns": 2,                       # sh max_turns=2
    "rollout.max_tokens_per_turn": 500,           # sh data.max_response_length=500
    "rollout.max_obs_length": 500,                # sh data.max_obs_length=500
    "rollout.max_prompt_length": 2048,            # sh data.max_start_length=2048
    "rollout.max_response_length": 4096,          # sh data.max_prompt_length=4096
    "rollout.temperature": 1.0,                   # sh rollout.temperature=1
    "rollout.top_p": 0.95,                        # yaml rollout.top_p
    "rollout.top_k": 0,                           # yaml rollout.top_k -1
    "rollout.engine": "vllm",                     # sh rollout.name=vllm
    "learner.lr": 1e-6,                           # sh actor.optim.lr
    "learner.warmup_ratio": 0.285,                # sh actor.optim.lr_warmup_steps_ratio
    "learner.weight_decay": 0.01,                 # code fsdp_workers AdamW default
    "learner.grad_clip": 1.0,                     # yaml actor.grad_clip
    "learner.train_batch_size": 512,              # sh data.train_batch_size
    "learner.mini_batch_size": 256,               # sh actor.ppo_mini_batch_size
    "learner.ppo_epochs": 1,                      # yaml actor.ppo_epochs
    "learner.temperature": 1.0,
    "learner.total_steps": 1005,                  # sh trainer.total_training_steps
    "learner.max_staleness": 0,                   # synchronous
    "learner.eval_before": True,                  # sh +trainer.val_before_train=true
    "learner.eval_every": 50,                     # sh trainer.test_freq=50
    "learner.save_every": 100,                    # sh trainer.save_freq=100
    "learner.algorithm.entropy_coeff": 0.001,     # yaml actor.entropy_coeff
    "learner.algorithm.clip_ratio_low": 0.2,      # yaml actor.clip_ratio
    "learner.algorithm.clip_ratio_high": 0.2,
    "learner.algorithm.clip_ratio_c": None,       # no dual clip in the fork
    "learner.algorithm.log_ratio_clamp": None,
    "learner.algorithm.loss_agg_mode": "token-mean",
    "data.shuffle": True,                         # sh data.shuffle_train_dataloader=True
    "model.gradient_checkpointing": True,         # sh model.enable_gradient_checkpointing
}
EXPECTED = {
    GRPO: {
        **SHARED,
        "learner.adv_estimator": "grpo",          # sh algorithm.adv_estimator=grpo
        "data.n_samples": 5,                      # sh rollout.n_agent=5
        "learner.algorithm.use_kl_loss": True,    # sh actor.use_kl_loss=true
        "learner.algorithm.kl_loss_coef": 0.001,  # sh actor.kl_loss_coef=0.001
        "learner.algorithm.kl_loss_type": "low_var_kl",
        "learner.algorithm.use_kl_in_reward": False,
        "learner.algorithm.norm_adv_by_std": True,
        "learner.algorithm.epsilon": 1e-6,
    },
    PPO: {
        **SHARED,
        "learner.adv_estimator": "gae",           # sh algorithm.adv_estimator=gae
        "data.n_samples": 1,                      # sh rollout.n_agent=1
        "learner.critic_lr": 1e-5,                # sh critic.optim.lr=1e-5
        "learner.critic_warmup_ratio": 0.015,     # sh critic.optim.lr_warmup_steps_ratio=0.015
        "learner.algorithm.gamma": 1.0,           # yaml algorithm.gamma
        "learner.algorithm.lam": 1.0,             # yaml algorithm.lam
        "learner.algorithm.cliprange_value": 0.5,  # yaml critic.cliprange_value
        "learner.algorithm.use_kl_in_reward": True,
        "learner.algorithm.kl_penalty": "kl",     # yaml algorithm.kl_penalty
        "learner.algorithm.kl_ctrl": "fixed",
        "learner.algorithm.kl_coef": 0.001,       # sh algorithm.kl_ctrl.kl_coef=0.001
        "learner.algorithm.use_kl_loss": False,
    },
}
SOURCE_TAG = re.compile(r"#\s*(sh|yaml|code|deploy):|#\s*Forage only")


def value_at(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


@pytest.mark.parametrize("path", [GRPO, PPO], ids=["grpo", "ppo"])
def test_recipe_values_match_search_r1(path):
    cfg = load_config(path)
    for dotted, expected in EXPECTED[path].items():
        got = value_at(cfg, dotted)
        if isinstance(expected, float):
            assert got == pytest.approx(expected), dotted
        else:
            assert got == expected, dotted


@pytest.mark.parametrize("path", [GRPO, PPO], ids=["grpo", "ppo"])
def test_every_recipe_value_names_its_source(path):
    lines = path.read_text().splitlines()
    for dotted in EXPECTED[path]:
        key = dotted.split(".")[-1]
        matches = [line for line in lines if re.match(rf"\s*{re.escape(key)}:", line)]
        assert matches, f"{path.name}: no line for {dotted}"
        assert any(SOURCE_TAG.search(line) for line in matches), f"{path.name}: {dotted}"
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert "Not matched, and why" in header and "train_" in header


@pytest.mark.parametrize("path", [GRPO, PPO], ids=["grpo", "ppo"])
def test_recipes_size_rollout_and_evaluation_for_a_gpu_run(path):
    """The fork's vLLM concurrency (max_num_seqs 1024), not the CPU engine's 32, and an
    evaluation that fits its time limit: a capped question set (~51k in the test file), paced
    so training groups are not queued behind all of it."""
    cfg = load_config(path)
    assert cfg.rollout.engine == "vllm" and cfg.rollout.max_batch_size == 1024
    assert 0 < cfg.learner.eval_max_questions <= 5000
    assert cfg.learner.eval_max_in_flight >= 2 * cfg.rollout.max_batch_size


@pytest.mark.parametrize("path", [GRPO, PPO], ids=["grpo", "ppo"])
def test_the_learner_accepts_the_recipes(path):
    cfg = load_config(path)
    check_estimator(cfg.learner.adv_estimator)
    options = AlgorithmSettings.model_validate(dict(cfg.learner.algorithm))
    # Search-R1's mini-batches: 2560 trajectories / 256 (GRPO), 512 / 256 (PPO).
    updates = rl_updates_per_step(cfg.learner, cfg.data.n_samples)
    assert updates == {GRPO: 10, PPO: 2}[path]
    factor = ratio_warmup_lambda(cfg.learner.warmup_ratio, cfg.learner.total_steps, updates,
                                 cfg.learner.lr_schedule)
    # verl: num_warmup_steps = int(0.285 x 1005) = 286 training steps, LR x t / 286.
    assert factor(0) == 0.0 and factor(updates - 1) == 0.0
    assert factor(updates) == pytest.approx(1 / 286)
    assert factor(285 * updates) == pytest.approx(285 / 286) and factor(286 * updates) == 1.0
    if path == PPO:
        assert options.use_kl_in_reward and cfg.learner.critic_lr == 1e-5
        assert int(cfg.learner.critic_warmup_ratio * cfg.learner.total_steps) == 15
    else:
        assert options.use_kl_loss and not options.use_kl_in_reward


def test_warmup_keys_are_validated():
    with pytest.raises(ConfigError, match="warmup_steps or learner.warmup_ratio, not both"):
        load_config(GRPO, ["learner.warmup_steps=10"])
    with pytest.raises(ConfigError, match="warmup_ratio"):
        load_config(None, ["learner.warmup_ratio=1.5"])
    # Without a ratio, warm-up stays counted in optimizer steps.
    assert warmup_lambda(3, 10, "constant")(0) == pytest.approx(0.25)


def test_updates_per_step_counts_epochs_and_mini_batches():
    cfg = LearnerSection(train_batch_size=3, mini_batch_size=4, ppo_epochs=2)
    assert rl_updates_per_step(cfg, 5) == 2 * 4  # 15 sequences in mini-batches of 4
    assert rl_updates_per_step(LearnerSection(train_batch_size=3), 5) == 1  # 0: one mini-batch


def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.policy.module.parameters()])


@pytest.mark.slow
def test_ratio_warmup_takes_effect_per_rl_step(tiny_policy, samples_factory):
    """4 sequences in mini-batches of 2 = 2 updates per RL step; ratio 0.5 of 4 steps = W 2:
    step 0 at LR 0 (the weights do not move), step 1 at LR/2, then LR; the critic follows its
    own ratio."""
    from services.learner.trainer import PolicyTrainer

    cfg = LearnerSection(lr=1e-3, critic_lr=1e-2, micro_batch_tokens=160, total_steps=4,
                         mini_batch_size=2, warmup_ratio=0.5, critic_warmup_ratio=0.25,
                         algorithm={"entropy_coeff": 0.0})
    updates = 2
    trainer = PolicyTrainer(str(tiny_policy), cfg, use_critic=True, updates_per_step=updates)
    samples = samples_factory(4, with_rl=True)
    trainer.compute_values(samples)
    for sample in samples:
        sample.set_field("returns", sample.loss_mask * 1.0)
    assert trainer.policy.current_lr() == 0.0
    before = _params(trainer)
    first = trainer.rl_step(samples)
    assert torch.equal(before, _params(trainer))  # LR 0 for both updates of step 0
    assert trainer.policy.current_lr() == pytest.approx(0.5e-3)  # the LR of RL step 1
    assert trainer.critic.current_lr() == pytest.approx(1e-2)  # W = int(0.25 x 4) = 1
    trainer.rl_step(samples)
    assert trainer.policy.current_lr() == pytest.approx(1e-3)
    assert not torch.equal(before, _params(trainer))
    # Without updates_per_step (SFT, direct use) the ratio does not apply: warmup_steps does.
    plain = PolicyTrainer(str(tiny_policy), cfg.model_copy(update={"warmup_ratio": None}))
    assert plain.policy.current_lr() == pytest.approx(1e-3)
    assert np.isfinite(first["loss"])


@pytest.mark.slow
def test_the_grpo_recipes_kl_loss_and_entropy_enter_the_loss(tiny_policy, samples_factory):
    """loss = pg_loss + kl_loss_coef x KL(low_var_kl) - entropy_coeff x entropy, with the
    recipe's own algorithm keys."""
    from services.learner.packing import pack
    from services.learner.trainer import PolicyTrainer

    recipe = load_config(GRPO).learner.algorithm
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=400, total_steps=2, algorithm=recipe)
    trainer = PolicyTrainer(str(tiny_policy), cfg, use_ref=True)
    samples = samples_factory(3, with_rl=True)
    trainer.compute_log_probs(samples, "ref")
    for sample in samples:  # a reference the policy has drifted from
        sample.set_field("ref_logprobs", sample.fields["ref_logprobs"] - 0.5)
    tokens, seqs = trainer._counts(samples, [0, 1, 2])
    mb = pack(samples, [0, 1, 2])
    with torch.no_grad():
        loss, metrics = trainer.rl_loss(mb, trainer._policy_out(mb), tokens, seqs)
    assert metrics["kl_loss"] > 0.1 and metrics["entropy"] > 0.1
    expected = metrics["pg_loss"] + 0.001 * metrics["kl_loss"] - 0.001 * metrics["entropy"]
    assert float(loss) == pytest.approx(expected, rel=1e-6, abs=1e-7)
