"""BNPO, the group filter, probe shaping and the learner.algorithm.* settings."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from services.learner.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AlgorithmSettings,
    BNPOState,
    apply_overconfidence_penalty,
    compute_advantage,
    filter_groups,
    overconfidence_penalty_metrics,
    policy_loss,
)
from services.learner.algorithms.bnpo import beta_moments

F64 = torch.float64


def binary_batch(groups: dict[str, list[float]]):
    uids = [u for u, rs in groups.items() for _ in rs]
    rewards = torch.tensor([r for rs in groups.values() for r in rs], dtype=F64)
    tlr = torch.zeros(len(uids), 3, dtype=F64)
    tlr[:, -1] = rewards
    return tlr, torch.ones_like(tlr), uids


def beta15_pdf(p: float) -> float:
    """Beta(1.5, 1.5) density: sqrt(p (1 - p)) / B(1.5, 1.5), B = pi / 8."""
    return math.sqrt(p * (1 - p)) * 8 / math.pi


def test_bnpo_paper_fit_on_one_batch():
    # group success rates 0.25, 0.5, 0.75: mean 0.5, unbiased var 0.0625 -> a = b = 1.5,
    # alpha = beta = 1 + 1.5 / 3 = 1.5
    groups = {"a": [1, 0, 0, 0], "b": [1, 1, 0, 0], "c": [1, 1, 1, 0], "s": [1]}
    assert beta_moments([0.25, 0.5, 0.75]) == pytest.approx((1.5, 1.5))
    tlr, mask, uids = binary_batch(groups)
    adv, ret = ADVANTAGE_ESTIMATORS["bnpo"](tlr, mask, uids)
    rows = adv[:, 0].tolist()
    assert rows[0] == pytest.approx(0.75 / beta15_pdf(0.25))
    assert rows[1] == pytest.approx(-0.25 / beta15_pdf(0.25))
    assert rows[4] == pytest.approx(0.5 / beta15_pdf(0.5))  # = 0.5 * pi / 4
    assert rows[8] == pytest.approx(0.25 / beta15_pdf(0.75))
    assert rows[12] == 1.0  # singleton: raw reward, weight 1
    assert torch.equal(adv, ret)


def test_bnpo_online_state_window_and_checkpoint():
    state = BNPOState(window=4)
    tlr, mask, uids = binary_batch({"a": [1, 0, 0, 0], "b": [1, 1, 0, 0], "c": [1, 1, 1, 0]})
    ADVANTAGE_ESTIMATORS["bnpo"](tlr, mask, uids, state=state)
    assert state.parameters() == pytest.approx((1.5, 1.5))
    tlr2, mask2, uids2 = binary_batch({"d": [1, 0]})
    adv, _ = ADVANTAGE_ESTIMATORS["bnpo"](tlr2, mask2, uids2, state=state)
    # window [0.25, 0.5, 0.75, 0.5]: var 0.125/3 -> a = b = 0.5 * (0.25 / var - 1) = 2.5
    alpha = 1 + 2.5 / 3
    assert state.parameters() == pytest.approx((alpha, alpha))
    pdf = 0.25 ** (alpha - 1) / math.exp(2 * math.lgamma(alpha) - math.lgamma(2 * alpha))
    assert adv[0, 0] == pytest.approx(0.5 / pdf)
    # the window forgets: one more group pushes 0.25 out
    state.update([0.9])
    assert list(state.rates) == [0.5, 0.75, 0.5, 0.9]
    restored = BNPOState(window=2)
    restored.load_state_dict(state.state_dict())
    assert restored.parameters() == state.parameters()


def test_bnpo_degenerate_fit_and_reward_range():
    tlr, mask, uids = binary_batch({"a": [1, 0]})  # one rate: alpha = beta = 1, A = r - p
    adv, _ = ADVANTAGE_ESTIMATORS["bnpo"](tlr, mask, uids)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5])
    tlr, mask, uids = binary_batch({"a": [2.0, -2.0]})
    adv, _ = ADVANTAGE_ESTIMATORS["bnpo"](tlr, mask, uids, min_value=-2, max_value=2)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5])
    with pytest.raises(ValueError, match="outside"):
        ADVANTAGE_ESTIMATORS["bnpo"](tlr, mask, uids)


def test_filter_groups_drops_all_equal():
    rewards = {"mixed": [1.0, 0.0], "same": [1.0, 1.0], "zeros": [0, 0, 0], "one": [0.5], "e": []}
    assert filter_groups(rewards) == ["mixed", "one"]  # verl DAPO keeps singletons
    assert filter_groups(rewards, keep_singletons=False) == ["mixed"]  # rllm
    assert filter_groups({"near": [1.0, 1.0 + 1e-9]}, atol=1e-6) == []


def test_overconfidence_penalty_on_probed_masked_tokens():
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=F64)
    shaped = apply_overconfidence_penalty(adv, mask, [0.5, None], 0.2)
    assert shaped.flatten().tolist() == pytest.approx([0.9, 1.0, -0.1, 2.0, 2.0, 2.0])
    same = apply_overconfidence_penalty(adv, mask, torch.tensor([0.5, float("nan")]), 0.2)
    assert torch.equal(shaped, same)
    assert torch.equal(apply_overconfidence_penalty(adv, mask, [0.5, 0.1], 0.0), adv)
    metrics = overconfidence_penalty_metrics([-0.5, None, 0.25], 0.2)
    assert metrics["probe_all/overconf_penalty_mean"] == pytest.approx(-0.025)
    assert metrics["probe_all/overconf_penalty_abs_mean"] == pytest.approx(0.075)
    with pytest.raises(ValueError, match="rows"):
        apply_overconfidence_penalty(adv, mask, [0.5], 0.2)


def test_settings_validate_and_feed_the_functions():
    with pytest.raises(ValidationError, match="clip_ratio_hgh"):
        AlgorithmSettings.model_validate({"clip_ratio_hgh": 0.28})
    with pytest.raises(ValidationError, match="loss_agg_mode"):
        AlgorithmSettings.model_validate({"loss_agg_mode": "mean"})
    with pytest.raises(ValidationError, match="kl_penalty"):
        AlgorithmSettings.model_validate({"kl_penalty": "k4"})
    settings = AlgorithmSettings.model_validate(
        {"norm_adv_by_std": False, "clip_ratio_high": 0.28, "kl_loss_type": "k3+"}
    )
    tlr, mask, uids = binary_batch({"a": [1, 0, 0]})
    adv, _ = compute_advantage(tlr, mask, uids, **settings.advantage_options("grpo"))
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])  # Dr. GRPO
    logp = torch.zeros_like(tlr)
    loss, _ = policy_loss(logp, logp, adv, mask, **settings.policy_loss_options())
    assert float(loss) == pytest.approx(0.0)
    for name in ADVANTAGE_ESTIMATORS:
        settings.estimator_options(name)  # every estimator has a mapping
    assert settings.make_kl_controller().value == 0.001
    assert settings.make_bnpo_state().window == 512
    assert AlgorithmSettings(bnpo_window=0).make_bnpo_state() is None
