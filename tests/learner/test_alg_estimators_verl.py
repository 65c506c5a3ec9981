"""Parity of the added advantage estimators with verl 0.9.1's definitions (core_algos.py and the
trainer's compute_advantage, read from the PyPI wheel; reference/algorithms.md section 1):
grpo_passk, gpg, gdpo, optimal_token_baseline, tir_optimal_token_baseline and the vectorised
aliases. References are written out row by row; batches have singleton groups and masks with
observation gaps."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from services.learner.algorithms import ADVANTAGE_ESTIMATORS, AlgorithmSettings, compute_advantage

F64 = torch.float64

# groups: "a" has 3 rows (one with a gap), "b" is a singleton, "c" has 2 rows with equal reward.
REWARDS = [1.0, 0.0, 0.5, 2.0, 0.25, 0.25]
UIDS = ["a", "a", "a", "b", "c", "c"]
MASKS = [
    [1, 1, 0, 0, 1, 1, 0],
    [1, 1, 1, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1],
    [1, 1, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 1, 1, 0, 0],
]


def outcome(rewards=REWARDS, masks=MASKS):
    mask = torch.tensor(masks, dtype=F64)
    tlr = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        tlr[i, int(torch.nonzero(mask[i]).max())] = r
    return tlr, mask


def groups(uids):
    out: dict[str, list[int]] = {}
    for i, u in enumerate(uids):
        out.setdefault(u, []).append(i)
    return out


def row_values(adv, mask):
    values = []
    for row, m in zip(adv, mask, strict=True):
        assert torch.all(row[m == 0] == 0)
        picked = row[m > 0]
        assert torch.allclose(picked, picked[0].expand_as(picked))
        values.append(float(picked[0]))
    return values


# ---------------------------------------------------------------------------- grpo_passk


def ref_passk(rewards, uids, norm=True, eps=1e-6):
    out = [0.0] * len(rewards)
    for rows in groups(uids).values():
        values = [rewards[i] for i in rows]
        ranked = sorted(values, reverse=True)
        gap = ranked[0] - ranked[1]
        if norm:
            gap /= statistics.stdev(values) + eps
        out[rows[values.index(ranked[0])]] = gap
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_credits_only_the_best(norm):
    uids = ["a", "a", "a", "c", "c", "c"]
    tlr, mask = outcome()
    adv, ret = ADVANTAGE_ESTIMATORS["grpo_passk"](tlr, mask, uids, norm_adv_by_std=norm)
    assert row_values(adv, mask) == pytest.approx(ref_passk(REWARDS, uids, norm))
    assert torch.equal(adv, ret)
    # ties at the top: no credit at all
    tie, _ = ADVANTAGE_ESTIMATORS["grpo_passk"](*outcome([1, 1, 0, 0.5, 0.5, 0.5]), uids)
    assert not tie.any()
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        ADVANTAGE_ESTIMATORS["grpo_passk"](tlr, mask, UIDS)  # "b" is a singleton


# ----------------------------------------------------------------------------------- gpg


def test_gpg_rescales_by_the_share_of_nonzero_rewards():
    rewards = [1.0, 0.0, 0.0, 2.0, 0.0, 0.0]
    tlr, mask = outcome(rewards)
    alpha = 6 / 2  # two nonzero rewards in six rows
    means = {"a": 1 / 3, "b": 0.0, "c": 0.0}  # a singleton's mean is 0 (verl)
    expected = [alpha * (r - means[u]) / 2.0 for r, u in zip(rewards, UIDS, strict=True)]
    adv, _ = ADVANTAGE_ESTIMATORS["gpg"](tlr, mask, UIDS, f_norm=2.0)
    assert row_values(adv, mask) == pytest.approx(expected)
    zeros, _ = ADVANTAGE_ESTIMATORS["gpg"](*outcome([0.0] * 6), UIDS)  # alpha: B / max(0, 1)
    assert not zeros.any()


# ---------------------------------------------------------------------------------- gdpo


def verl_grpo_rows(scores, uids, eps=1e-6, norm=True):
    out = []
    by = groups(uids)
    for i, u in enumerate(uids):
        rows = by[u]
        if len(rows) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = statistics.fmean(scores[j] for j in rows)
            std = statistics.stdev(scores[j] for j in rows)
        out.append((scores[i] - mean) / (std + eps) if norm else scores[i] - mean)
    return out


def whiten_rows(values, masks):
    tokens = [v for v, m in zip(values, masks, strict=True) for x in m if x]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_gdpo_normalises_each_reward_component_then_whitens():
    fmt = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    acc = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    weights = [0.5, 2.0]
    tlr, mask = outcome([f + a for f, a in zip(fmt, acc, strict=True)])
    adv, ret = ADVANTAGE_ESTIMATORS["gdpo"](tlr, mask, UIDS, component_scores=[fmt, acc],
                                            weights=weights)
    summed = [weights[0] * x + weights[1] * y for x, y in
              zip(verl_grpo_rows(fmt, UIDS), verl_grpo_rows(acc, UIDS), strict=True)]
    assert row_values(adv, mask) == pytest.approx(whiten_rows(summed, MASKS))
    assert torch.equal(adv, ret)
    # without components: the row reward is the one component (verl's fallback)
    single, _ = ADVANTAGE_ESTIMATORS["gdpo"](tlr, mask, UIDS)
    expected = whiten_rows(verl_grpo_rows([f + a for f, a in zip(fmt, acc, strict=True)], UIDS),
                           MASKS)
    assert row_values(single, mask) == pytest.approx(expected)
    with pytest.raises(ValueError, match="2 weights for 1"):
        ADVANTAGE_ESTIMATORS["gdpo"](tlr, mask, UIDS, weights=weights)
    with pytest.raises(ValueError, match="gdpo_reward_weights"):
        AlgorithmSettings(gdpo_reward_keys=["a"], gdpo_reward_weights=[1.0, 2.0])
    assert AlgorithmSettings(gdpo_reward_keys=["a"]).estimator_options("gdpo")["weights"] is None


# --------------------------------------------------------------- optimal token baselines


def policy_stats(mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g, dtype=F64) * 2
    spi = torch.rand(mask.shape, generator=g, dtype=F64) * 0.5 + 0.1
    return old, spi


def token_rewards(mask, seed=1):
    """Rewards on several tokens (process rewards) and an outcome on the last one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(mask.shape, generator=g, dtype=F64) * mask * 0.3


def ref_otb(tlr, mask, uids, old, spi, isw=None, zero_tail=True, eps=1e-8, tir=False):
    n_rows, width = mask.shape
    rtg = [[sum(float(tlr[i, k] * mask[i, k]) for k in range(t, width)) for t in range(width)]
           for i in range(n_rows)]
    w_cum = []
    for i in range(n_rows):
        total, row = 0.0, []
        for t in range(width):
            w = 1 - 2 * math.exp(float(old[i, t])) + float(spi[i, t])
            if isw is not None:
                w *= float(isw[i, t]) ** 2
            total += w * float(mask[i, t])
            row.append(total)
        w_cum.append(row)
    adv = [[0.0] * width for _ in range(n_rows)]
    for rows in groups(uids).values():
        # positions to compare: columns (otb) or the k-th policy token of each row (tir)
        if tir:
            rows = [i for i in rows if mask[i].sum() > 0]
            pos = {i: [t for t in range(width) if mask[i, t] > 0] for i in rows}
        else:
            pos = {i: list(range(width)) for i in rows}
        lengths = {i: int(mask[i].sum()) for i in rows}
        base = {i: [0.0] * len(pos[i]) for i in rows}
        if len(rows) > 1:
            for k in range(max(len(p) for p in pos.values())):
                num = den = 0.0
                for j in rows:
                    if k < len(pos[j]):
                        t = pos[j][k]
                        m = 1.0 if tir else float(mask[j, t])
                        num += rtg[j][t] * w_cum[j][t] * m
                        den += w_cum[j][t] * m
                for i in rows:
                    if k < len(pos[i]):
                        base[i][k] = num / (den + eps)
            ordered = sorted(lengths.values())
            longest = [i for i in rows if lengths[i] == ordered[-1]]
            if zero_tail and len(longest) == 1 and ordered[-1] > ordered[-2]:
                base[longest[0]][ordered[-2]:] = [0.0] * len(base[longest[0]][ordered[-2]:])
        for i in rows:
            for k, t in enumerate(pos[i]):
                adv[i][t] = (rtg[i][t] - base[i][k]) * float(mask[i, t])
    return torch.tensor(adv, dtype=F64), torch.tensor(rtg, dtype=F64)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baselines(name, zero_tail, with_is):
    _, mask = outcome()
    tlr = token_rewards(mask)
    old, spi = policy_stats(mask)
    isw = (0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(4),
                            dtype=F64)) if with_is else None
    adv, ret = ADVANTAGE_ESTIMATORS[name](tlr, mask, UIDS, old_log_probs=old, sum_pi_squared=spi,
                                          rollout_is_weights=isw, handle_zero_tail=zero_tail)
    ref_adv, ref_ret = ref_otb(tlr, mask, UIDS, old, spi, isw, zero_tail,
                               tir=name.startswith("tir"))
    assert torch.allclose(adv, ref_adv, atol=1e-12)
    assert torch.allclose(ret, ref_ret, atol=1e-12)
    single = [i for i, u in enumerate(UIDS) if UIDS.count(u) == 1]
    assert torch.allclose(adv[single], (ref_ret * mask)[single])  # a singleton keeps A = G


def test_tir_and_column_baselines_differ_only_with_gaps():
    gapless = [[1] * 4 + [0] * 3, [1] * 7, [1] * 2 + [0] * 5, [1] * 5 + [0] * 2]
    _, mask = outcome([1, 0, 1, 0], gapless)
    tlr = token_rewards(mask)
    old, spi = policy_stats(mask)
    uids = ["a", "a", "b", "b"]
    kw = {"old_log_probs": old, "sum_pi_squared": spi}
    a, _ = ADVANTAGE_ESTIMATORS["optimal_token_baseline"](tlr, mask, uids, **kw)
    b, _ = ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"](tlr, mask, uids, **kw)
    assert torch.allclose(a, b, atol=1e-12)
    _, gapped = outcome()
    old, spi = policy_stats(gapped)
    kw = {"old_log_probs": old, "sum_pi_squared": spi}
    tlr = token_rewards(gapped)
    a, _ = ADVANTAGE_ESTIMATORS["optimal_token_baseline"](tlr, gapped, UIDS, **kw)
    b, _ = ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"](tlr, gapped, UIDS, **kw)
    assert not torch.allclose(a, b)


# -------------------------------------------------------------------- vectorised aliases


def test_vectorised_aliases():
    tlr, mask = outcome()
    rloo_v, _ = ADVANTAGE_ESTIMATORS["rloo_vectorized"](tlr, mask, UIDS)
    assert row_values(rloo_v, mask)[3] == 0.0  # singleton: 0, not its reward
    rloo, _ = ADVANTAGE_ESTIMATORS["rloo"](tlr, mask, UIDS)
    assert row_values(rloo, mask)[3] == 2.0
    grpo_v, _ = ADVANTAGE_ESTIMATORS["grpo_vectorized"](tlr, mask, UIDS)
    assert row_values(grpo_v, mask) == pytest.approx(verl_grpo_rows(REWARDS, UIDS))
    settings = AlgorithmSettings(norm_adv_by_std=False)
    dr, _ = compute_advantage(tlr, mask, UIDS, **settings.advantage_options("grpo_vectorized"))
    assert row_values(dr, mask) == pytest.approx(verl_grpo_rows(REWARDS, UIDS, norm=False))


def test_every_estimator_has_options_and_row_inputs_are_refused_stepwise():
    settings = AlgorithmSettings(gdpo_reward_keys=["x"])
    for name in ADVANTAGE_ESTIMATORS:
        settings.estimator_options(name)
    tlr, mask = outcome()
    old, spi = policy_stats(mask)
    for name in ("gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ValueError, match="per-row inputs"):
            compute_advantage(tlr, mask, UIDS, estimator=name, mode="per_step",
                              turn_spans=[[(0, 7)]] * 6)
