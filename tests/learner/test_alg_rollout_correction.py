"""Rollout correction against verl 0.9.1's rollout_corr_helper definitions (read from the PyPI
wheel): importance weights (token / sequence, TIS / IcePop, batch normalisation), rejection
criteria, off-policy metrics, the config keys and the learner's per-batch application."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.learner.algorithms import AlgorithmSettings, rollout_correction
from services.learner.algorithms.rollout_correction import (
    is_weights,
    parse_is_threshold,
    parse_rs,
    rejection_mask,
)
from services.learner.packing import Sample
from services.learner.rl_batch import apply_rollout_correction

F64 = torch.float64


def batch(seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 6, generator=g, dtype=F64) * 2 - 0.05
    train = rollout + spread * torch.randn(4, 6, generator=g, dtype=F64)
    mask = torch.ones(4, 6, dtype=F64)
    mask[0, 4:] = 0
    mask[1, 1:3] = 0  # observation gap
    mask[3, 2:] = 0
    return train, rollout, mask


def masked_mean(x, m):
    return float((x * m).sum() / (m.sum() + 1e-8))


def test_token_tis_weights_and_metrics():
    train, rollout, mask = batch()
    w, metrics = is_weights(train - rollout, mask, "token", 1.5)
    ratio = torch.exp(train - rollout)
    expected = ratio.clamp(max=1.5) * mask
    assert torch.allclose(w, expected)
    assert metrics["rollout_is_mean"] == pytest.approx(masked_mean(expected, mask))
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(
        masked_mean((ratio > 1.5).to(F64), mask))
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(
        masked_mean((ratio < 1 / 1.5).to(F64), mask))
    # effective sample size (fraction of tokens): 1 / mean((w / mean w)^2)
    mean_w = masked_mean(expected, mask)
    ess = 1 / masked_mean((expected / (mean_w + 1e-8)) ** 2, mask)
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert 0 < ess < 1
    assert metrics["rollout_is_max"] == pytest.approx(float(expected[mask > 0].max()))


def test_sequence_is_is_the_product_of_ratios_on_every_token():
    train, rollout, mask = batch(spread=0.1)
    w, metrics = is_weights(train - rollout, mask, "sequence", 3.0)
    for i in range(4):
        seq = math.exp(min(max(float(((train - rollout)[i] * mask[i]).sum()), -20), 20))
        assert torch.allclose(w[i], torch.full((6,), min(seq, 3.0), dtype=F64) * mask[i])
    logs = ((train - rollout) * mask).sum(-1)
    assert metrics["rollout_is_max"] == pytest.approx(math.exp(float(logs.max())))
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(
        float((logs > math.log(3.0)).double().mean()))


def test_icepop_zeroes_outside_the_band_and_batch_normalisation():
    train, rollout, mask = batch(spread=0.6)
    w, metrics = is_weights(train - rollout, mask, "token", "0.5_2.0")
    ratio = torch.exp(train - rollout)
    inside = ((ratio >= 0.5) & (ratio <= 2.0)).to(F64)
    assert torch.allclose(w, ratio * inside * mask)
    assert metrics["rollout_is_oob_ratio"] == pytest.approx(masked_mean(1 - inside, mask))
    normed, m = is_weights(train - rollout, mask, "token", 2.0, batch_normalize=True)
    assert masked_mean(normed, mask) == pytest.approx(1.0, abs=1e-6)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(
        masked_mean(ratio.clamp(max=2.0) * mask, mask))
    seq, _ = is_weights(train - rollout, mask, "sequence", 2.0, batch_normalize=True)
    per_seq = (seq * mask).sum(-1) / mask.sum(-1)
    assert float(per_seq.mean()) == pytest.approx(1.0)  # sequence weights: mean over sequences


def ref_keep(train, rollout, mask, option, low, high):
    """verl: k1 = -log(pi_train / pi_rollout) with [log low, log high]; k2 / k3 <= high."""
    lr = (train - rollout).clamp(-20, 20)
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1 - lr}[option[-2:]]
    level = option[: -3]
    keep = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        valid = mask[i] > 0
        if level == "token":
            stats = k[i]
        elif level == "seq_sum":
            stats = torch.full_like(k[i], float((k[i] * mask[i]).sum()))
        elif level == "seq_mean":
            stats = torch.full_like(k[i], float((k[i] * mask[i]).sum() / (mask[i].sum() + 1e-8)))
        else:
            top = float(k[i][valid].max()) if valid.any() else 0.0
            stats = torch.full_like(k[i], top)
        if option.endswith("k1"):
            ok = (stats >= math.log(low)) & (stats <= math.log(high))
        else:
            ok = stats <= high
        keep[i] = ok.to(F64)
    return keep * mask


@pytest.mark.parametrize("option, spec, low, high", [
    ("token_k1", "0.7_1.4", 0.7, 1.4),
    ("token_k1", 1.4, 1 / 1.4, 1.4),  # one value u: the band [1/u, u]
    ("token_k2", 0.05, None, 0.05),
    ("token_k3", 0.05, None, 0.05),
    ("seq_sum_k1", "0.8_1.25", 0.8, 1.25),
    ("seq_sum_k2", 0.2, None, 0.2),
    ("seq_sum_k3", 0.2, None, 0.2),
    ("seq_mean_k1", "0.9_1.1", 0.9, 1.1),
    ("seq_mean_k2", 0.05, None, 0.05),
    ("seq_mean_k3", 0.05, None, 0.05),
    ("seq_max_k2", 0.1, None, 0.1),
    ("seq_max_k3", 0.1, None, 0.1),
])
def test_rejection_criteria(option, spec, low, high):
    train, rollout, mask = batch(spread=0.4)
    kept, metrics = rejection_mask(train - rollout, mask, option, spec)
    expected = ref_keep(train, rollout, mask, option, low, high)
    assert torch.equal(kept, expected)
    assert 0 < kept.sum() < mask.sum()  # the case rejects some tokens and keeps others
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(
        masked_mean(mask - expected, mask))
    seq_hit = ((mask - expected).sum(-1) > 0).double()
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(float(seq_hit.mean()))
    assert f"rollout_rs_{option}_mean" in metrics


def test_several_criteria_must_all_pass():
    train, rollout, mask = batch(spread=0.4)
    both, _ = rejection_mask(train - rollout, mask, "token_k1,seq_mean_k3", "0.7_1.4,0.05")
    a = ref_keep(train, rollout, mask, "token_k1", 0.7, 1.4)
    b = ref_keep(train, rollout, mask, "seq_mean_k3", None, 0.05)
    assert torch.equal(both, a * b)


def test_offpolicy_metrics():
    train, rollout, mask = batch()
    _, kept, metrics = rollout_correction(train, rollout, mask)
    assert torch.equal(kept, mask)
    lr = train - rollout
    assert metrics["rollout_corr/kl"] == pytest.approx(masked_mean(rollout - train, mask))
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(masked_mean(torch.exp(lr) - lr - 1,
                                                                      mask))
    mean_train = (train * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    mean_rollout = (rollout * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    assert metrics["rollout_corr/training_ppl"] == pytest.approx(
        float(torch.exp(-mean_train).mean()))
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(
        float((mean_rollout - mean_train).mean()))
    assert metrics["rollout_corr/chi2_token"] == pytest.approx(
        masked_mean(torch.exp(lr) ** 2, mask) - 1)
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx(
        float(torch.exp(2 * (lr * mask).sum(-1)).mean() - 1))


def test_bad_thresholds_are_one_line_errors_naming_the_key():
    with pytest.raises(ValueError, match="lower bound above upper"):
        parse_is_threshold("3_2")
    with pytest.raises(ValueError, match="unknown criterion 'seq_max_k1'"):
        parse_rs("seq_max_k1", 1.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rs("token_k2", None)
    with pytest.raises(ValueError, match="one positive bound"):
        parse_rs("token_k2", "0.1_0.2")
    with pytest.raises(ValueError, match="2 entries for 3 criteria"):
        parse_rs("token_k1,token_k2,token_k3", "1.5,0.1")
    with pytest.raises(ValidationError, match="rollout_is_threshold"):
        AlgorithmSettings(rollout_is="token", rollout_is_threshold="abc")
    with pytest.raises(ValidationError, match="rollout_rs"):
        AlgorithmSettings(rollout_rs="token_k9", rollout_rs_threshold=1.0)
    with pytest.raises(ValidationError, match="rollout_is"):
        AlgorithmSettings(rollout_is="tokens")
    with pytest.raises(ValidationError, match="tis_cap"):
        AlgorithmSettings(tis_cap=2.0, rollout_is="sequence")


def sample(length=10, prompt=3, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones(length)
    mask[:prompt] = 0
    mask[6:8] = 0  # an observation
    s = Sample(rng.integers(5, 50, length), mask, prompt_len=prompt, uid="g")
    s.set_field("rollout_logprobs", -rng.random(length).astype(np.float32))
    s.set_field("old_logprobs", s.fields["rollout_logprobs"] + rng.normal(0, 0.5, length)
                .astype(np.float32))
    return s


def test_apply_rollout_correction_writes_weights_and_rejects_tokens():
    samples = [sample(seed=i) for i in range(3)]
    before = [s.loss_mask.copy() for s in samples]
    options = AlgorithmSettings(rollout_is="token", rollout_is_threshold=2.0,
                                rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    assert options.uses_rollout_correction
    metrics = apply_rollout_correction(samples, options)
    assert "rollout_corr/rollout_is_eff_sample_size" in metrics
    for s, mask in zip(samples, before, strict=True):
        ratio = np.exp(s.fields["old_logprobs"] - s.fields["rollout_logprobs"])
        # verl's k1 is -log(ratio): the band bounds pi_rollout / pi_train, i.e. 1 / ratio
        keep = (1 / ratio >= 0.6) & (1 / ratio <= 1.6)
        np.testing.assert_array_equal(s.loss_mask, mask * keep)
        np.testing.assert_allclose(s.fields["rollout_is_weights"][mask > 0],
                                   np.minimum(ratio, 2.0)[mask > 0], rtol=1e-6)
    # the legacy tis_cap key is token-level TIS at that threshold
    legacy = [sample(seed=i) for i in range(3)]
    apply_rollout_correction(legacy, AlgorithmSettings(tis_cap=1.2))
    fresh = [sample(seed=i) for i in range(3)]
    apply_rollout_correction(fresh, AlgorithmSettings(rollout_is="token",
                                                      rollout_is_threshold=1.2))
    for a, b in zip(legacy, fresh, strict=True):
        np.testing.assert_array_equal(a.fields["rollout_is_weights"], b.fields["rollout_is_weights"])
    # off: nothing happens; bypass mode: the loss does it instead
    untouched = [sample()]
    assert apply_rollout_correction(untouched, AlgorithmSettings()) == {}
    assert apply_rollout_correction(untouched, AlgorithmSettings(bypass_mode=True,
                                                                 rollout_is="token")) == {}
    assert "rollout_is_weights" not in untouched[0].fields
    bare = sample()
    del bare.fields["old_logprobs"]
    with pytest.raises(ValueError, match="needs rollout and old log-probs"):
        apply_rollout_correction([bare], options)
