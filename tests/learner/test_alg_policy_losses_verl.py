"""Parity of the registered policy losses with verl 0.9.1's definitions (core_algos.py, read from
the PyPI wheel; reference/algorithms.md section 2).

Each reference below is written out independently and straightforwardly from verl's
definition, token by token where that is clearer; values and gradients with respect to the
log-probs are compared on random tensors whose masks have observation gaps and an empty row.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.learner.algorithms import (
    POLICY_LOSSES,
    AlgorithmSettings,
    LossSettings,
    compute_policy_loss,
    get_policy_loss_fn,
)
from services.learner.algorithms.policy_losses import clip_cov

F64 = torch.float64
B, T = 5, 7


def batch(seed: int = 0, spread: float = 0.3):
    """(log_prob leaf, old, advantages, mask): row 1 has an observation gap, row 4 is empty,
    advantages are per row (outcome estimators) with one zero row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv_rows = torch.tensor([1.3, -0.7, 0.0, -1.9, 0.4], dtype=F64)
    adv = adv_rows.unsqueeze(-1).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 5:] = 0
    mask[1, 2:4] = 0  # observation tokens inside the response
    mask[2, 6:] = 0
    mask[4, :] = 0  # a row with no policy token
    return logp.requires_grad_(True), old, adv, mask


def ref_agg(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl agg_loss with dp_size 1 and no global info."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    rows = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    if mode == "seq-mean-token-sum":
        return sum((loss[i] * mask[i]).sum() for i in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum((loss[i] * mask[i]).sum() / (mask[i].sum() + 1e-8) for i in rows) / len(rows)
    raise AssertionError(mode)


def grad_of(fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    value = fn(x)
    value.backward()
    return value.detach(), x.grad


def assert_parity(name, settings, ref_fn, seed=0, mode_checks=("token-mean",), **kw):
    logp, old, adv, mask = batch(seed, **kw)
    for mode in mode_checks:
        s = LossSettings(**{**settings.__dict__, "loss_agg_mode": mode})
        ours, g_ours = grad_of(lambda x, s=s: compute_policy_loss(name, x, old, adv, mask, s)[0],
                               logp)
        ref, g_ref = grad_of(lambda x, mode=mode: ref_fn(x, old, adv, mask, mode), logp)
        assert float(ours) == pytest.approx(float(ref), rel=1e-10, abs=1e-12), (name, mode)
        assert torch.allclose(g_ours, g_ref, atol=1e-12), (name, mode)


def test_registry_has_every_verl_loss_and_trl_extras():
    verl = {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
            "dppo_tv", "dppo_kl", "bypass_mode"}
    assert set(POLICY_LOSSES) == verl | {"luspo", "vespo"}
    with pytest.raises(ValueError, match="unknown policy loss 'ppo3'; known: bypass_mode"):
        get_policy_loss_fn("ppo3")


# ------------------------------------------------------------------------------- sapo


def ref_sapo(x, old, adv, mask, mode, tau_pos=1.0, tau_neg=1.05):
    out = torch.zeros_like(x)
    for i in range(B):
        for t in range(T):
            ratio = torch.exp((x[i, t] - old[i, t]).clamp(-20, 20))
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            out[i, t] = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv[i, t]
    return ref_agg(out, mask, "seq-mean-token-mean")  # sapo always aggregates this way


def test_sapo_matches_verl_and_forces_seq_mean_token_mean():
    assert_parity("sapo", LossSettings(), ref_sapo,
                  mode_checks=("token-mean", "seq-mean-token-sum"))
    s = LossSettings(tau_pos=2.0, tau_neg=3.0)
    assert_parity("sapo", s, lambda *a: ref_sapo(*a, tau_pos=2.0, tau_neg=3.0), seed=3)
    # the gate's gradient at rho = 1 is the plain policy gradient -A
    logp, _, adv, mask = batch()
    _, g = grad_of(lambda x: compute_policy_loss("sapo", x, x.detach(), adv, mask,
                                                 LossSettings())[0], logp)
    _, plain = grad_of(lambda x: ref_agg(-adv * torch.exp(x - x.detach()), mask,
                                         "seq-mean-token-mean"), logp)
    assert torch.allclose(g, plain, atol=1e-12)


# ----------------------------------------------------------------------- cispo / gpg / dro


def ref_cispo(x, old, adv, mask, mode, low=0.2, high=0.2):
    ratio = torch.exp((x - old).clamp(-20, 20)).detach()
    weight = ratio.clamp(1 - low, 1 + high)
    return ref_agg(-weight * adv * x, mask, mode)


def test_cispo_verl_clip_with_stop_gradient():
    assert_parity("cispo", LossSettings(), ref_cispo,
                  mode_checks=("token-mean", "seq-mean-token-mean"))
    s = LossSettings(clip_ratio_low=0.1, clip_ratio_high=0.28)
    assert_parity("cispo", s, lambda *a: ref_cispo(*a, low=0.1, high=0.28), seed=1,
                  spread=0.6)
    logp, old, adv, mask = batch(spread=0.6)
    _, metrics = compute_policy_loss("cispo", logp, old, adv, mask, LossSettings())
    ratio = torch.exp(logp.detach() - old)
    outside = ((ratio < 0.8) | (ratio > 1.2)).to(F64)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(float((outside * mask).sum()
                                                                / mask.sum()))
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    assert float(metrics["ppo_kl"]) == pytest.approx(float(((old - logp.detach()) * mask).sum()
                                                          / mask.sum()))


def test_gpg_is_plain_policy_gradient_without_metrics():
    def ref(x, old, adv, mask, mode):
        return ref_agg(-x * adv, mask, mode)

    assert_parity("gpg", LossSettings(), ref, mode_checks=("token-mean", "seq-mean-token-sum"))
    logp, old, adv, mask = batch()
    assert compute_policy_loss("gpg", logp, old, adv, mask, LossSettings())[1] == {}


def test_dro_quadratic_penalty_and_required_beta():
    def ref(x, old, adv, mask, mode):
        return ref_agg(-(x * adv - 0.5 * 0.3 * (x - old) ** 2), mask, mode)

    assert_parity("dro", LossSettings(dro_beta=0.3), ref)
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="dro_beta"):
        compute_policy_loss("dro", logp, old, adv, mask, LossSettings())
    with pytest.raises(ValueError, match="dro_beta"):
        AlgorithmSettings(policy_loss="dro")


# ---------------------------------------------------------------------------------- dppo


def ref_dppo(x, old, adv, mask, mode, kind, low=0.2, high=0.2, cap=3.0):
    out = torch.zeros_like(x)
    for i in range(B):
        for t in range(T):
            log_ratio = float((x[i, t] - old[i, t]).detach().clamp(-20, 20))
            truncated = min(math.exp(log_ratio), cap)
            p, q = math.exp(float(x[i, t].detach())), math.exp(float(old[i, t]))
            if kind == "tv":
                ok = (p - q) <= high if adv[i, t] > 0 else (p - q) >= -low
            else:
                kl = q * (float(old[i, t]) - float(x[i, t].detach())) + (1 - q) * math.log(
                    (1 - q + 1e-8) / (1 - p + 1e-8))
                ok = (kl <= high or p <= q) if adv[i, t] > 0 else (kl <= low or p >= q)
            out[i, t] = -adv[i, t] * truncated * x[i, t] * float(ok)
    return ref_agg(out, mask, mode)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_binary_trust_region(kind):
    name = f"dppo_{kind}"
    assert_parity(name, LossSettings(), lambda *a: ref_dppo(*a, kind=kind), spread=0.8)
    s = LossSettings(clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=20.0)
    assert_parity(name, s, lambda *a: ref_dppo(*a, kind=kind, low=0.05, high=0.1, cap=20.0),
                  seed=2, spread=0.8)
    logp, old, adv, mask = batch(spread=0.8)
    _, metrics = compute_policy_loss(name, logp, old, adv, mask, LossSettings())
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0  # the trust region is active somewhere


# -------------------------------------------------------------------------- clip_cov/kl_cov


def covariance(x, adv, mask):
    n = mask.sum()
    mean_a = (adv * mask).sum() / (n + 1e-8)
    mean_l = (x.detach() * mask).sum() / (n + 1e-8)
    return (adv - mean_a) * (x.detach() - mean_l)


def test_clip_cov_zeroes_covariance_outliers():
    logp, old, adv, mask = batch(spread=0.5)
    lb, ub = 0.05, 5.0
    s = LossSettings(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)  # every candidate

    def ref(x, old, adv, mask, mode):
        ratio = torch.exp(x - old)  # no log-ratio clamp in verl's clip_cov
        l1, l2 = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
        cov = covariance(x, adv, mask)
        keep = torch.ones_like(x)
        for i in range(B):
            for t in range(T):
                if mask[i, t] > 0 and not l2[i, t] > l1[i, t] and lb < cov[i, t] < ub:
                    keep[i, t] = 0.0
        return ref_agg(torch.maximum(l1, l2) * keep, mask, mode)

    assert_parity("clip_cov", s, ref, spread=0.5, mode_checks=("token-mean",
                                                               "seq-mean-token-mean"))
    _, metrics = compute_policy_loss("clip_cov", logp, old, adv, mask, s)
    assert float(metrics["pg_clipfrac"]) > 0  # the case really zeroes some tokens
    # verl's default ratio: max(int(2e-4 * N), 1) = 1 random token among the candidates,
    # reproducible with a seeded generator.
    picks = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(7)
        _, m = clip_cov(logp, old, adv, mask, LossSettings(clip_cov_lb=lb), generator=gen)
        picks.append(float(m["pg_clipfrac"]))
    assert picks[0] == picks[1] == pytest.approx(1 / float(mask.sum()))


def test_kl_cov_penalises_top_covariance_tokens():
    logp, old, adv, mask = batch(spread=0.5)
    s = LossSettings(kl_cov_ratio=0.15, ppo_kl_coef=0.7)
    n = int(mask.sum())
    k = max(1, int(n * 0.15))

    def ref(x, old, adv, mask, mode):
        cov = covariance(x, adv, mask)
        valid = [(i, t) for i in range(B) for t in range(T) if mask[i, t] > 0]
        top = sorted(valid, key=lambda it: float(cov[it]), reverse=True)[:k]
        out = -adv * torch.exp(x - old)
        extra = torch.zeros_like(x)
        for i, t in top:
            extra[i, t] = 0.7 * (x[i, t] - old[i, t]).abs()
        return ref_agg(out + extra, mask, mode)

    assert_parity("kl_cov", s, ref, spread=0.5)
    _, metrics = compute_policy_loss("kl_cov", logp, old, adv, mask, s)
    assert set(metrics) == {"ppo_kl"}  # verl: the mean |log ratio|
    assert float(metrics["ppo_kl"]) == pytest.approx(
        float(((logp.detach() - old).abs() * mask).sum() / mask.sum()))


# ------------------------------------------------------------------------------- geo_mean


def test_geo_mean_gmpo():
    low, high = 0.2, 0.3

    def ref(x, old, adv, mask, mode):
        per_seq = []
        for i in range(B):
            n = mask[i].sum()
            total = 0.0
            for t in range(T):
                d = x[i, t] - old[i, t]
                sign = float(torch.sign(adv[i, t]))
                clipped = d.clamp(-low, high)
                chosen = sign * torch.minimum(sign * d, sign * clipped)
                total = total + chosen * mask[i, t]
            ratio = torch.exp(total / (n + 1e-8))
            seq_adv = (adv[i] * mask[i]).sum() / (n + 1e-8)
            per_seq.append(-seq_adv * ratio)
        return torch.stack(per_seq).mean()  # verl: torch.mean over rows, loss_agg_mode unused

    s = LossSettings(clip_ratio_low=low, clip_ratio_high=high)
    assert_parity("geo_mean", s, ref, spread=0.4,
                  mode_checks=("token-mean", "seq-mean-token-sum"))
    logp, old, adv, mask = batch(spread=0.4)
    _, m = compute_policy_loss("geo_mean", logp, old, adv, mask, s)
    d = logp.detach() - old
    clipped = ((d < -low) | (d > high)).to(F64)
    assert float(m["pg_clipfrac"]) == pytest.approx(
        float((clipped * (adv > 0) * mask).sum() / mask.sum()))
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(
        float((clipped * (adv < 0) * mask).sum() / mask.sum()))


# ------------------------------------------------------------------------- bypass mode


def test_bypass_reinforce_with_token_is_and_rejection():
    logp, rollout, adv, mask = batch(spread=0.5)
    s = LossSettings(bypass_loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5,
                     rollout_rs="token_k1", rollout_rs_threshold="0.9_2.5")

    def ref(x, rollout, adv, mask, mode):
        ratio = torch.exp(x.detach() - rollout)
        weight = ratio.clamp(max=1.5) * mask
        # verl's token_k1 statistic is -log(ratio): the band is on 1 / ratio
        keep = ((1 / ratio >= 0.9) & (1 / ratio <= 2.5)).to(F64) * mask
        return ref_agg(-adv * x * weight, keep, mode)

    assert_parity("bypass_mode", s, ref, spread=0.5,
                  mode_checks=("token-mean", "seq-mean-token-mean"))
    _, metrics = compute_policy_loss("bypass_mode", logp, rollout, adv, mask, s)
    assert "rollout_corr/rollout_is_eff_sample_size" in metrics
    assert 0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1
    ratio = torch.exp(logp.detach() - rollout)
    keep = ((1 / ratio >= 0.9) & (1 / ratio <= 2.5)).to(F64) * mask
    assert ((ratio >= 0.9) & (ratio <= 2.5)).to(F64).mul(mask).sum() != keep.sum()
    assert float(metrics["ppo_kl"]) == pytest.approx(
        float(((rollout - logp.detach()) * keep).sum() / keep.sum()))


def test_bypass_ppo_clip_is_vanilla_against_the_rollout_policy():
    logp, rollout, adv, mask = batch(spread=0.5)
    s = LossSettings(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)
    ours, _ = compute_policy_loss("bypass_mode", logp, rollout, adv, mask, s)
    ratio = torch.exp(logp.detach() - rollout)
    k3 = ((ratio - 1 - torch.log(ratio)) * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    kept = mask * (k3 <= 0.05).to(F64).unsqueeze(-1)
    assert 0 < kept.sum() < mask.sum()  # some sequences rejected, some kept
    # no IS weights for ppo_clip (the ratio already corrects) ...
    plain, _ = compute_policy_loss("vanilla", logp, rollout, adv, kept, LossSettings())
    assert float(ours.detach()) == pytest.approx(float(plain.detach()))
    # ... and with the trainer's counts (taken before rejection, as verl's global batch info)
    counted = s.with_counts(float(mask.sum()), 4.0, None)
    ours, _ = compute_policy_loss("bypass_mode", logp, rollout, adv, mask, counted)
    plain, _ = compute_policy_loss("vanilla", logp, rollout, adv, kept,
                                   LossSettings().with_counts(float(mask.sum()), 4.0, None))
    assert float(ours.detach()) == pytest.approx(float(plain.detach()))


def test_bypass_mode_setting_replaces_the_loss():
    s = AlgorithmSettings(bypass_mode=True, policy_loss="cispo")
    assert s.effective_policy_loss == "bypass_mode" and s.uses_bypass
    assert not s.uses_rollout_correction  # the loss computes it, per micro-batch


# --------------------------------------------------------- micro-batch shares add up


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES) - {"clip_cov", "kl_cov"}))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_add_up_to_the_batch_loss(name, mode):
    """With the whole mini-batch's counts, each row group's loss is its exact share: the sum
    over any packing equals the one-piece loss, in value and gradient."""
    logp, old, adv, mask = batch(seed=5, spread=0.3)
    extra = {"dro_beta": 0.2} if name == "dro" else {}
    base = LossSettings(loss_agg_mode=mode, max_response_len=11, **extra)
    tokens = float(mask.sum())
    seqs = float((mask.sum(-1) > 0).sum())
    whole, g_whole = grad_of(
        lambda x: compute_policy_loss(name, x, old, adv, mask,
                                      base.with_counts(tokens, seqs, 11))[0], logp)

    def pieces(x):
        total = 0.0
        for rows in ([0, 3], [1], [2, 4]):
            total = total + compute_policy_loss(
                name, x[rows], old[rows], adv[rows], mask[rows],
                base.with_counts(tokens, seqs, 11))[0]
        return total

    split, g_split = grad_of(pieces, logp)
    assert float(split) == pytest.approx(float(whole), rel=1e-10, abs=1e-12)
    assert torch.allclose(g_split, g_whole, atol=1e-12)
