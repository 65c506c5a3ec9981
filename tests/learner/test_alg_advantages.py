"""Advantage estimators against hand-computed values (reference/algorithms.md section 1)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from services.learner.algorithms import ADVANTAGE_ESTIMATORS, get_adv_estimator_fn

F64 = torch.float64


def outcome(rewards, masks):
    """token_level_rewards with each scalar on the row's last mask token (verl convention)."""
    mask = torch.tensor(masks, dtype=F64)
    tlr = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        last = int(torch.nonzero(mask[i]).max())
        tlr[i, last] = r
    return tlr, mask


# Group "a" = [1, 0, 0] (mask with a gap), "b" = [1] (singleton), "c" = [0.5, 0.5] (constant).
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5]
MASKS = [
    [1, 1, 0, 1, 0],
    [1, 0, 0, 0, 0],
    [1, 1, 1, 1, 1],
    [1, 1, 0, 0, 0],
    [0, 1, 1, 0, 0],
    [1, 0, 1, 0, 1],
]
UIDS = ["a", "a", "a", "b", "c", "c"]


def per_row(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The constant value on each row's mask (and check it really is constant and masked)."""
    values = []
    for row, m in zip(adv, mask, strict=True):
        assert torch.all(row[m == 0] == 0)
        picked = row[m > 0]
        assert torch.allclose(picked, picked[0].expand_as(picked))
        values.append(float(picked[0]))
    return values


def test_registry_has_every_estimator():
    # verl 0.9.1's AdvantageEstimator values, plus bnpo.
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "grpo_vectorized",
        "grpo_passk",
        "gpg",
        "gdpo",
        "rloo",
        "rloo_vectorized",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
        "bnpo",
    }
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_adv_estimator_fn("ppo2")


def test_grpo_verl_default_singleton_constant_and_gap():
    tlr, mask = outcome(REWARDS, MASKS)
    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS)
    std_a = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0]
    eps = 1e-6
    expected = [
        (2 / 3) / (std_a + eps),
        (-1 / 3) / (std_a + eps),
        (-1 / 3) / (std_a + eps),
        1.0 / (1.0 + eps),  # singleton: mean 0, std 1
        0.0,
        0.0,  # constant group
    ]
    assert per_row(adv, mask) == pytest.approx(expected, rel=1e-12)
    assert torch.equal(adv, ret)


def test_grpo_group_ids_tensor_or_hashables_agree():
    tlr, mask = outcome(REWARDS, MASKS)
    by_str, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS)
    by_tensor, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, torch.tensor([7, 7, 7, 3, 9, 9]))
    assert torch.equal(by_str, by_tensor)


@pytest.mark.parametrize(
    "options, std_a, eps",
    [
        ({"epsilon": 1e-4}, math.sqrt(1 / 3), 1e-4),  # TRL
        ({"unbiased_std": False}, math.sqrt(2 / 9), 1e-6),  # rllm np.std
    ],
)
def test_grpo_trl_and_rllm_variants(options, std_a, eps):
    tlr, mask = outcome(REWARDS[:3], MASKS[:3])
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS[:3], **options)
    expected = [(2 / 3) / (std_a + eps), (-1 / 3) / (std_a + eps), (-1 / 3) / (std_a + eps)]
    assert per_row(adv, mask) == pytest.approx(expected, rel=1e-12)


def test_grpo_batch_std_scope_is_trl_scale_rewards_batch():
    tlr, mask = outcome(REWARDS, MASKS)
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS, std_scope="batch", epsilon=1e-4)
    sigma = statistics.stdev(REWARDS)
    means = {"a": 1 / 3, "b": 0.0, "c": 0.5}
    expected = [(r - means[u]) / (sigma + 1e-4) for r, u in zip(REWARDS, UIDS, strict=True)]
    assert per_row(adv, mask) == pytest.approx(expected, rel=1e-12)


def test_dr_grpo_and_singleton_zero():
    tlr, mask = outcome(REWARDS, MASKS)
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS, norm_adv_by_std=False)
    assert per_row(adv, mask) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1.0, 0.0, 0.0])
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, UIDS, singleton="zero")
    assert per_row(adv, mask)[3] == 0.0


def test_rloo_leave_one_out_and_singletons():
    tlr, mask = outcome(REWARDS, MASKS)
    adv, ret = ADVANTAGE_ESTIMATORS["rloo"](tlr, mask, UIDS)
    # r_i - mean(others): 1 - 0, 0 - 0.5, 0 - 0.5; singleton raw (verl rloo); constant 0.
    assert per_row(adv, mask) == pytest.approx([1.0, -0.5, -0.5, 1.0, 0.0, 0.0])
    assert torch.equal(adv, ret)
    adv, _ = ADVANTAGE_ESTIMATORS["rloo"](tlr, mask, UIDS, singleton="zero")  # rloo_vectorized
    assert per_row(adv, mask)[3] == 0.0


def test_opo_length_weighted_baseline():
    tlr, mask = outcome([1.0, 0.0, 3.0], [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    adv, _ = ADVANTAGE_ESTIMATORS["opo"](tlr, mask, ["g", "g", "solo"])
    baseline = (2 * 1.0 + 4 * 0.0) / 6
    assert per_row(adv, mask) == pytest.approx([1 - baseline, -baseline, 3.0])


def test_reinforce_plus_plus_baseline_verl_token_whitening():
    rewards = [1.0, 0.0, 2.0]
    masks = [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    tlr, mask = outcome(rewards, masks)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](tlr, mask, ["g", "g", "s"])
    centred = [0.5, -0.5, 2.0]  # singleton keeps its reward (mean 0)
    tokens = [c for c, m in zip(centred, masks, strict=True) for _ in range(sum(m))]
    mu, var = statistics.fmean(tokens), statistics.variance(tokens)  # token-weighted, unbiased
    expected = [(c - mu) / math.sqrt(var + 1e-8) for c in centred]
    # rel 1e-7: verl's masked mean divides by (count + 1e-8), which the hand value leaves out
    assert per_row(adv, mask) == pytest.approx(expected, rel=1e-7)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_baseline_rllm_sequence_std():
    tlr, mask = outcome([1.0, 0.0, 2.0], [[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](
        tlr, mask, ["g", "g", "s"], normalize="seq_std", singleton="zero"
    )
    centred = [0.5, -0.5, 0.0]  # rllm: a singleton is its own mean
    sigma = statistics.pstdev(centred)
    assert per_row(adv, mask) == pytest.approx([c / (sigma + 1e-6) for c in centred])


@pytest.mark.parametrize(
    "gap_mode, expected_returns",
    [
        ("carry", [0.25, 0.0, 0.5, 1.0]),  # verl 0.9.1: the return skips the gap
        ("reset", [0.0, 0.25, 0.5, 1.0]),  # verl 0.8: the gap restarts it
    ],
)
def test_reinforce_plus_plus_gap_variants(gap_mode, expected_returns):
    tlr = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]], dtype=F64)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](
        tlr, mask, None, gamma=0.5, gap_mode=gap_mode
    )
    assert ret[0].tolist() == pytest.approx(expected_returns)
    assert ret[1, :3].tolist() == pytest.approx([0.5, 1.0, 2.0])
    masked = [
        v
        for row, m in zip(ret.tolist(), mask.tolist(), strict=True)
        for v, k in zip(row, m, strict=True)
        if k
    ]
    mu, sd = statistics.fmean(masked), math.sqrt(statistics.variance(masked) + 1e-8)
    expected = (ret - mu) / sd * mask
    assert torch.allclose(adv, expected, atol=1e-7)


def test_remax_greedy_baseline():
    tlr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = ADVANTAGE_ESTIMATORS["remax"](tlr, mask, None, reward_baselines=[0.5, 1.0])
    assert ret.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["remax"](tlr, mask, None)  # the greedy baseline is required


def test_gae_hand_values_and_gap():
    tlr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=F64)
    gae = ADVANTAGE_ESTIMATORS["gae"]
    adv, ret = gae(tlr[:1], mask[:1], None, values=values[:1], gamma=1.0, lam=1.0, whiten=False)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    # gamma 0.9, lam 0.8, a gap at t=1: the value and GAE carry across it.
    adv, ret = gae(tlr[1:], mask[1:], None, values=values[1:], gamma=0.9, lam=0.8, whiten=False)
    assert adv[0].tolist() == pytest.approx([0.13 + 0.72 * 0.3, 0.3, 0.3])
    assert ret[0].tolist() == pytest.approx([0.346 + 0.5, 0.9, 1.0])
    # whitened (default): returns unchanged, advantages whitened over masked tokens, not re-masked
    adv_w, ret_w = gae(tlr, mask, None, values=values, gamma=0.9, lam=0.8)
    raw, _ = gae(tlr, mask, None, values=values, gamma=0.9, lam=0.8, whiten=False)
    masked = raw[mask > 0].tolist()
    mu, sd = statistics.fmean(masked), math.sqrt(statistics.variance(masked) + 1e-8)
    assert torch.allclose(adv_w, (raw - mu) / sd, atol=1e-7)


def test_estimators_reject_bad_shapes_and_options():
    tlr, mask = outcome([1.0, 0.0], [[1, 1], [1, 0]])
    with pytest.raises(ValueError, match="one shape"):
        ADVANTAGE_ESTIMATORS["grpo"](tlr, mask[:, :1], ["a", "a"])
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, ["a"])
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["grpo"](tlr, mask, ["a", "a"], epsilom=1.0)


def test_every_estimator_accepts_float32_and_bool_masks():
    tlr64, mask64 = outcome(REWARDS, MASKS)
    tlr, mask = tlr64.float(), mask64.bool()
    stats = {"old_log_probs": torch.full_like(tlr, -0.5), "sum_pi_squared": torch.full_like(tlr, 0.3)}
    options = {
        "gae": {"values": torch.zeros_like(tlr)},
        "remax": {"reward_baselines": torch.zeros(6)},
        "optimal_token_baseline": stats,
        "tir_optimal_token_baseline": stats,
    }
    uids = {"grpo_passk": ["a", "a", "a", "a", "c", "c"]}  # Pass@k needs groups of 2 or more
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        ids = uids.get(name, UIDS)
        adv, ret = fn(tlr, mask, ids, **options.get(name, {}))
        ref, _ = fn(
            tlr64, mask64, ids, **{k: v.double() for k, v in options.get(name, {}).items()}
        )
        assert adv.dtype == torch.float32 and adv.shape == tlr.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert torch.allclose(adv.double(), ref, atol=1e-5), name
