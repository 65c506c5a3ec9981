"""Parity with TRL 1.16's GRPOTrainer._compute_loss (read from the PyPI wheel; reference/
algorithms.md section 4): its loss types, delta at the token and the sequence level, CISPO's
one-sided cap, SAPO, LUSPO and VESPO, and mask_truncated_completions.

TRL's advantages are one scalar per completion (B, 1); the references below take them so and
write each formula out as TRL defines it, aggregation included.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.common.trajectory import ScoredTrajectory, Trajectory, Turn
from services.learner.algorithms import (
    AlgorithmSettings,
    LossSettings,
    agg_loss,
    compute_policy_loss,
    policy_loss,
)
from services.learner.rl_batch import assign_advantages, samples_of

F64 = torch.float64
B, T = 4, 6


def batch(seed: int = 0, spread: float = 0.4):
    """No empty row (TRL averages over all rows, Forage over rows with a policy token)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.tensor([[1.1], [-0.8], [0.3], [-1.6]], dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 4:] = 0
    mask[1, 1:3] = 0  # tool-output tokens inside the completion (TRL's tool_mask)
    mask[3, 5:] = 0
    return logp, old, adv, mask


def trl_coef1(x, old, mask, level):
    log_ratio = x - old
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
                     .clamp(min=1.0))


def trl_normalise(per_token, mask, loss_type, max_completion_length=None):
    per_token = per_token.expand_as(mask)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):  # one process, one accumulation step
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    raise AssertionError(loss_type)


def trl_clip_loss(x, old, adv, mask, level, eps_low=0.2, eps_high=0.2, delta=None):
    coef_1 = trl_coef1(x, old, mask, level)
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = coef_1.clamp(max=delta)
    return -torch.minimum(coef_1 * adv, coef_2 * adv)


def value_and_grad(fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    value = fn(x)
    value.backward()
    return float(value.detach()), x.grad


def same(fn_ours, fn_trl, logp):
    """Equal up to the one constant that differs: verl's seq-mean-token-mean divides by
    (n + 1e-8), TRL's grpo by max(n, 1) (a relative 1e-8 / n)."""
    ours, g_ours = value_and_grad(fn_ours, logp)
    ref, g_ref = value_and_grad(fn_trl, logp)
    assert ours == pytest.approx(ref, rel=1e-8, abs=1e-12)
    assert torch.allclose(g_ours, g_ref, rtol=1e-8, atol=1e-12)


TRL_STYLE = {"clip_ratio_c": None, "log_ratio_clamp": None}


@pytest.mark.parametrize("loss_type, mode", [("grpo", "seq-mean-token-mean"),
                                             ("bnpo", "token-mean"), ("dapo", "token-mean"),
                                             ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_loss_types_are_aggregation_modes(loss_type, mode, level):
    logp, old, adv, mask = batch(spread=0.3)
    adv_t = adv.expand(B, T)
    same(lambda x: policy_loss(x, old, adv_t, mask, loss_agg_mode=mode, ratio_kind=level,
                               max_response_len=9, **TRL_STYLE)[0],
         lambda x: trl_normalise(trl_clip_loss(x, old, adv, mask, level), mask, loss_type, 9),
         logp)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_delta_caps_the_ratio_at_token_and_sequence_level(level):
    """TRL's delta clamps coef_1 (the unclipped ratio) at either level. Before issue 18 Forage
    had no `delta`: the documented stand-in (the dual clip c = delta) only acts per token, so at
    the sequence level the cap was silently ignored; the case below has a sequence ratio above
    delta with A < 0, where the capped and uncapped losses differ."""
    logp, old, adv, mask = batch(spread=0.3)
    logp = logp.clone()
    logp[1] = old[1] + 1.5  # row 1 (A < 0): ratio e^1.5 ~ 4.5 at both levels
    adv_t = adv.expand(B, T)
    for mode, loss_type in (("seq-mean-token-mean", "grpo"), ("token-mean", "dapo")):
        same(lambda x, mode=mode: policy_loss(x, old, adv_t, mask, loss_agg_mode=mode,
                                              ratio_kind=level, delta=2.0, **TRL_STYLE)[0],
             lambda x, lt=loss_type: trl_normalise(
                 trl_clip_loss(x, old, adv, mask, level, delta=2.0), mask, lt), logp)
        capped = policy_loss(logp, old, adv_t, mask, loss_agg_mode=mode, ratio_kind=level,
                             delta=2.0, **TRL_STYLE)[0]
        uncapped = policy_loss(logp, old, adv_t, mask, loss_agg_mode=mode, ratio_kind=level,
                               **TRL_STYLE)[0]
        assert float(capped) < float(uncapped) - 0.1
    # the config key reaches the loss
    settings = AlgorithmSettings(delta=2.0, ratio_kind=level, clip_ratio_c=None,
                                 log_ratio_clamp=None)
    via_settings = compute_policy_loss("vanilla", logp, old, adv_t, mask,
                                       settings.loss_settings())[0]
    direct = policy_loss(logp, old, adv_t, mask, ratio_kind=level, delta=2.0, **TRL_STYLE)[0]
    assert float(via_settings) == pytest.approx(float(direct))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_cispo_one_sided_cap(level):
    logp, old, adv, mask = batch(spread=0.9)
    s = LossSettings(cispo_eps_max=1.5, ratio_kind=level, log_ratio_clamp=None)

    def trl(x):
        coef = trl_coef1(x, old, mask, level).clamp(max=1.5).detach()
        return trl_normalise(-coef * adv * x, mask, "cispo")

    same(lambda x: compute_policy_loss("cispo", x, old, adv.expand(B, T), mask, s)[0], trl, logp)
    # verl's two-sided clip differs where rho < 1 - eps_low
    verl_value = compute_policy_loss("cispo", logp, old, adv.expand(B, T), mask,
                                     LossSettings(ratio_kind=level, log_ratio_clamp=None))[0]
    assert float(verl_value) != pytest.approx(value_and_grad(trl, logp)[0])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_sapo_soft_gate(level):
    logp, old, adv, mask = batch(spread=0.5)
    s = LossSettings(ratio_kind=level, log_ratio_clamp=None, tau_pos=1.0, tau_neg=1.05)

    def trl(x):
        coef = trl_coef1(x, old, mask, level)
        temps = torch.where(adv > 0, torch.tensor(1.0, dtype=F64), torch.tensor(1.05, dtype=F64))
        return trl_normalise(-torch.sigmoid(temps * (coef - 1)) * 4 / temps * adv, mask, "sapo")

    same(lambda x: compute_policy_loss("sapo", x, old, adv.expand(B, T), mask, s)[0], trl, logp)


def test_trl_luspo_length_scaled_sequence_loss():
    logp, old, adv, mask = batch(spread=0.3)
    for delta in (None, 1.1):
        s = LossSettings(delta=delta)
        same(lambda x, s=s: compute_policy_loss("luspo", x, old, adv.expand(B, T), mask, s)[0],
             lambda x, d=delta: trl_normalise(
                 trl_clip_loss(x, old, adv, mask, "sequence", delta=d), mask, "luspo"), logp)


def trl_gamma_weights(adv, log_ratio, mask, is_ratio=None, k_pos=2.0, lam_pos=3.0, k_neg=3.0,
                      lam_neg=2.0):
    lower = math.log(1e-8)
    seq_log = (log_ratio.clamp(-20, 20) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq_log = seq_log + torch.log(is_ratio).clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = seq_log.clamp(lower, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.tensor(k_pos, dtype=F64), torch.tensor(k_neg, dtype=F64))
    lam = torch.where(nonneg, torch.tensor(lam_pos, dtype=F64),
                      torch.tensor(lam_neg, dtype=F64)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)


def test_trl_vespo_gamma_weighted_policy_gradient():
    logp, old, adv, mask = batch(spread=0.15)

    def trl(x, is_ratio=None):
        phi = trl_gamma_weights(adv, (x - old).detach(), mask, is_ratio)
        return trl_normalise(-phi * adv * x, mask, "vespo")

    same(lambda x: compute_policy_loss("vespo", x, old, adv.expand(B, T), mask,
                                       LossSettings())[0], trl, logp)
    # phi(1) = 1: on-policy, VESPO is the plain policy gradient
    on = compute_policy_loss("vespo", old, old, adv.expand(B, T), mask, LossSettings())[1]
    assert float(on["vespo_phi_mean"]) == pytest.approx(1.0)
    # token IS weights fold into w (TRL's vLLM IS ratio); masked positions carry weight 1
    g = torch.Generator().manual_seed(3)
    weights = (0.8 + 0.4 * torch.rand(B, T, generator=g, dtype=F64)) * mask + (1 - mask)
    s = LossSettings(rollout_is="token")
    same(lambda x: compute_policy_loss("vespo", x, old, adv.expand(B, T), mask, s, weights)[0],
         lambda x: trl(x, weights), logp)


def test_gspo_keeps_verls_log_ratio_cap_unless_turned_off():
    logp, old, adv, mask = batch()
    logp = old + 12.0  # sequence log ratio 12 > 10
    adv_t = -adv.abs().expand(B, T)  # A < 0: the unclipped branch counts
    capped = policy_loss(logp, old, adv_t, mask, ratio_kind="sequence", clip_ratio_c=None)[0]
    free = policy_loss(logp, old, adv_t, mask, ratio_kind="sequence", **TRL_STYLE)[0]
    assert float(capped) == pytest.approx(float(agg_loss(-adv_t * math.exp(10.0), mask,
                                                         "token-mean")))
    assert float(free) == pytest.approx(float(agg_loss(-adv_t * math.exp(12.0), mask,
                                                       "token-mean")))


# ----------------------------------------------------------- mask_truncated_completions


def scored(uid: str, index: int, reward: float, finish: str = "answer") -> ScoredTrajectory:
    response = [5, 6, 7, 8][: 3 + index % 2]
    traj = Trajectory(uid=uid, sample_id=f"{uid}:0:{index}", data_source="synth", policy_version=1,
                      prompt_ids=[1, 2], response_ids=response, loss_mask=[1] * len(response),
                      rollout_logprobs=[-1.0] * len(response),
                      turns=[Turn(0, len(response), "answer")], finish_reason=finish)
    return ScoredTrajectory(traj, reward=reward)


def test_mask_truncated_completions_keeps_the_reward_in_the_baseline():
    items = [scored("g", 0, 1.0), scored("g", 1, 0.0, "length"), scored("g", 2, 0.0)]
    options = AlgorithmSettings(mask_truncated_completions=True)
    masked = samples_of(items, mask_truncated=options.mask_truncated_completions)
    assert masked[1].num_loss_tokens == 0 and masked[0].num_loss_tokens == 3
    plain = samples_of(items)
    assign_advantages(masked, items, options, "grpo")
    assign_advantages(plain, items, AlgorithmSettings(), "grpo")
    for row in (0, 2):  # the truncated row's 0 still counts in the group mean and std (TRL)
        np.testing.assert_allclose(masked[row].response_field("advantages"),
                                   plain[row].response_field("advantages"))
    assert not masked[1].response_field("advantages").any()  # and it carries no loss
