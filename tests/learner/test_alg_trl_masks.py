"""Parity with trl 1.16.0's `off_policy_mask_threshold`, `top_entropy_quantile` and
`use_bias_correction_kl` (trl/trainer/grpo_trainer.py: `get_off_policy_mask`,
`get_high_entropy_mask`, `_compute_loss`; grpo_config.py; read from the PyPI wheel).

Each reference below is TRL's formula written out here as TRL writes it (one process, one
accumulation step, no vLLM IS ratio), and Forage's functions are compared against it: the masks
alone, then the whole policy loss + KL term with both masks and the corrected KL, values and
gradients, for several loss types and both importance-sampling levels.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.learner.algorithms import (
    AlgorithmSettings,
    LossSettings,
    agg_loss,
    bias_corrected_kl,
    compute_policy_loss,
    entropy_threshold,
    high_entropy_mask,
    kl_importance_weight,
    kl_penalty,
    linear_quantile,
    off_policy_sequence_mask,
)

F64 = torch.float64
B, T = 5, 7


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = (old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    # the sampler drifted from the trainer by row-dependent amounts (rows 1 and 3 far off)
    drift = torch.tensor([[0.05], [0.9], [0.02], [0.7], [0.3]], dtype=F64)
    sampling = old + drift + 0.05 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.tensor([[1.1], [-0.8], [0.3], [0.6], [-1.6]], dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 5:] = 0
    mask[1, 1:3] = 0  # tool-output tokens inside the completion (TRL's tool_mask)
    mask[3, 6:] = 0
    entropies = torch.rand(B, T, generator=g, dtype=torch.float32) * 3
    entropies[2, 1] = entropies[4, 4] = entropies[0, 2]  # ties
    return logp, old, ref, sampling, adv, mask, entropies


# ------------------------------------------------------------------ TRL, written out


def trl_get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                            off_policy_threshold):
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    kl_div = torch.nan_to_num(kl_div, nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def trl_get_high_entropy_mask(entropies, mask, threshold):
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    masked_entropies = entropies * mask.float()
    entropy_mask = masked_entropies >= entropy_threshold
    return entropy_mask & mask.bool()


def trl_compute_loss(per_token_logps, old, ref, sampling, advantages, mask, entropies, *,
                     loss_type="grpo", level="token", beta=0.0, bias_correction=True,
                     off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                     epsilon_low=0.2, epsilon_high=0.2, max_completion_length=None):
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = trl_get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)
    if off_policy_mask_threshold is not None:
        off_policy_mask = trl_get_off_policy_mask(advantages, per_token_logps, sampling, mask,
                                                  off_policy_mask_threshold)
    log_ratio = per_token_logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
                                  ).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if bias_correction:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, torch.tensor(1.0, dtype=F64),
                                   torch.tensor(1.05, dtype=F64))
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("dapo", "cispo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    raise AssertionError(loss_type)


# ------------------------------------------------------------------ Forage, as the trainer does


MODES = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "dapo": "token-mean",
         "cispo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def forage_loss(x, old, ref, sampling, adv, mask, entropies, *, loss_type, level, beta,
                threshold, quantile):
    """rl_loss's path: AlgorithmSettings -> token_keep -> compute_policy_loss, + KL term."""
    settings = AlgorithmSettings(
        policy_loss={"cispo": "cispo", "sapo": "sapo"}.get(loss_type, "vanilla"),
        loss_agg_mode=MODES[loss_type], ratio_kind=level, clip_ratio_c=None,
        log_ratio_clamp=None, cispo_eps_max=0.2 if loss_type == "cispo" else None,
        max_response_len=T, off_policy_mask_threshold=threshold,
        top_entropy_quantile=quantile, use_kl_loss=beta != 0.0, kl_loss_coef=beta,
        kl_loss_type="k3", kl_clamp=False, use_bias_correction_kl=beta != 0.0)
    adv_t = adv.expand(B, T)
    keep = None
    if settings.off_policy_mask_threshold is not None:
        keep = off_policy_sequence_mask(adv_t, x, sampling, mask, threshold)
    if settings.uses_entropy_mask:
        high = high_entropy_mask(entropies, mask, quantile).to(F64)
        keep = high if keep is None else keep * high
    s = settings.loss_settings().with_keep(keep)
    loss = compute_policy_loss(settings.effective_policy_loss, x, old, adv_t, mask, s)[0]
    if settings.use_kl_loss:
        kl = bias_corrected_kl(kl_penalty(x, ref, "k3", clamp=False), x, old, mask,
                               settings.importance_sampling_level, settings.log_ratio_clamp)
        loss = loss + beta * agg_loss(kl, mask, MODES[loss_type], max_response_len=T)
    return loss


def value_and_grad(fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    value = fn(x)
    value.backward()
    return float(value.detach()), x.grad


# ------------------------------------------------------------------ the masks alone


@pytest.mark.parametrize("threshold", [0.01, 0.1, 0.5, 2.0])
def test_off_policy_mask_is_trls(threshold):
    logp, _, _, sampling, adv, mask, _ = batch()
    ours = off_policy_sequence_mask(adv, logp, sampling, mask, threshold)
    ref = trl_get_off_policy_mask(adv, logp, sampling, mask, threshold)
    assert ours.shape == (B, 1) and torch.equal(ours, ref)
    # per-token advantages (Forage's rows): TRL's broadcast, token by token
    adv_t = adv.expand(B, T).clone()
    adv_t[0, 2] = -0.3
    assert torch.equal(off_policy_sequence_mask(adv_t, logp, sampling, mask, threshold),
                       trl_get_off_policy_mask(adv_t, logp, sampling, mask, threshold))


def test_off_policy_mask_drops_only_far_negative_sequences_and_ignores_nan():
    logp, old, _, sampling, adv, mask, _ = batch()
    keep = off_policy_sequence_mask(adv, logp, sampling, mask, 0.5)
    # row 1: A < 0, drift ~0.9 -> dropped; row 3: drift 0.7 but A > 0 -> kept; row 4: A < 0,
    # drift 0.3 -> kept
    assert keep.squeeze(-1).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    nan_sampling = sampling.clone()
    nan_sampling[4, 0] = float("nan")  # an unscorable token is no evidence of drift
    assert torch.equal(off_policy_sequence_mask(adv, logp, nan_sampling, mask, 0.5),
                       trl_get_off_policy_mask(adv, logp, nan_sampling, mask, 0.5))
    # on-policy (behaviour = current): KL 0, nothing dropped
    assert bool(off_policy_sequence_mask(adv, logp, logp, mask, 1e-6).all())
    # an empty row: mean KL 0 (TRL's max(n, 1) divisor)
    empty = mask.clone()
    empty[1] = 0
    assert torch.equal(off_policy_sequence_mask(adv, logp, sampling, empty, 0.5),
                       trl_get_off_policy_mask(adv, logp, sampling, empty, 0.5))


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.35, 0.5, 0.9, 1.0])
def test_high_entropy_mask_is_trls(rho):
    *_, mask, entropies = batch()
    ours = high_entropy_mask(entropies, mask, rho)
    assert ours.dtype == torch.bool
    assert torch.equal(ours, trl_get_high_entropy_mask(entropies, mask, 1 - rho))
    # a threshold computed elsewhere (the trainer's mini-batch pool) gives the same mask
    thr = entropy_threshold(entropies[mask.bool()], rho)
    assert torch.equal(high_entropy_mask(entropies, mask, rho, thr), ours)


def test_high_entropy_mask_choices():
    *_, mask, entropies = batch()
    n = int(mask.sum())
    # 1.0 keeps every masked token, never a padded one
    assert torch.equal(high_entropy_mask(entropies, mask, 1.0), mask.bool())
    # 0.0 keeps only the maximum (all of them when tied)
    tied = entropies.clone()
    tied[1, 0] = tied[3, 3] = float(entropies[mask.bool()].max()) + 1.0
    top = high_entropy_mask(tied, mask, 0.0)
    assert int(top.sum()) == 2 and bool(top[1, 0]) and bool(top[3, 3])
    # ties at the threshold are all kept (>=): more than rho * n tokens may survive
    flat = torch.full((B, T), 1.0)
    assert int(high_entropy_mask(flat, mask, 0.2).sum()) == n
    # the quantile is over masked tokens only: a huge entropy on padding changes nothing
    padded = entropies.clone()
    padded[0, 6] = 1e6
    assert torch.equal(high_entropy_mask(padded, mask, 0.2), high_entropy_mask(entropies, mask,
                                                                               0.2))
    # no masked token: nothing kept (TRL returns all False)
    assert not bool(high_entropy_mask(entropies, torch.zeros(B, T), 0.2).any())
    assert entropy_threshold(torch.zeros(0), 0.2) is None


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.8, 0.999, 1.0])
@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_linear_quantile_is_torch_quantile(q, n):
    g = torch.Generator().manual_seed(n)
    values = torch.rand(n, generator=g) * 5
    if n > 3:
        values[:n // 3] = values[0]  # ties
    assert float(linear_quantile(values, q)) == float(torch.quantile(values, q))


# ------------------------------------------------------------------ the bias-corrected KL


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_is_trls(level):
    logp, old, ref, _, _, mask, _ = batch()

    def trl(x):
        per_token_kl = torch.exp(ref - x) - (ref - x) - 1
        log_ratio = x - old
        if level == "token":
            coef_1 = torch.exp(log_ratio)
        else:
            coef_1 = torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
                               .unsqueeze(-1))
        return ((per_token_kl * coef_1 * mask).sum(-1) / mask.sum(-1)).mean()

    def ours(x):
        kl = bias_corrected_kl(kl_penalty(x, ref, "k3", clamp=False), x, old, mask, level)
        return agg_loss(kl, mask, "seq-mean-token-mean")

    v_ours, g_ours = value_and_grad(ours, logp)
    v_ref, g_ref = value_and_grad(trl, logp)
    # verl's seq-mean divides by n + 1e-8, TRL's by n: a relative 1e-8 / n
    assert v_ours == pytest.approx(v_ref, rel=1e-8)
    assert torch.allclose(g_ours, g_ref, rtol=1e-8, atol=1e-14)
    # on-policy the value is the plain KL, but the gradient is not (the ratio is differentiable)
    kl_on = lambda x: agg_loss(kl_penalty(x, ref, "k3", clamp=False), mask, "token-mean")  # noqa: E731
    corr_on = lambda x: agg_loss(bias_corrected_kl(kl_penalty(x, ref, "k3", clamp=False), x,  # noqa: E731
                                                   x.detach(), mask, level), mask, "token-mean")
    (v1, g1), (v2, g2) = value_and_grad(kl_on, logp), value_and_grad(corr_on, logp)
    assert v1 == pytest.approx(v2, rel=1e-12) and not torch.allclose(g1, g2)


def test_kl_importance_weight_clamp():
    logp, old, _, _, _, mask, _ = batch()
    far = old + 30.0
    assert torch.allclose(kl_importance_weight(far, old, mask, "token", 20.0),
                          torch.full_like(old, torch.exp(torch.tensor(20.0, dtype=F64)).item()))
    assert torch.allclose(kl_importance_weight(logp, old, mask, "token", 20.0),
                          torch.exp(logp - old))
    with pytest.raises(ValueError, match="token' or 'sequence"):
        kl_importance_weight(logp, old, mask, "row")


# ------------------------------------------------------------------ the whole loss


CASES = [("grpo", "token"), ("grpo", "sequence"), ("dapo", "token"), ("dr_grpo", "token"),
         ("cispo", "token"), ("sapo", "token"), ("sapo", "sequence")]


@pytest.mark.parametrize("loss_type, level", CASES)
@pytest.mark.parametrize("threshold, quantile, beta", [
    (0.5, 1.0, 0.0), (None, 0.3, 0.0), (None, 1.0, 0.04), (0.5, 0.3, 0.04), (0.05, 0.0, 0.1)])
def test_loss_with_masks_and_corrected_kl_is_trls(loss_type, level, threshold, quantile, beta):
    logp, old, ref, sampling, adv, mask, entropies = batch(seed=1)
    kwargs = {"loss_type": loss_type, "level": level, "beta": beta}
    ours, g_ours = value_and_grad(
        lambda x: forage_loss(x, old, ref, sampling, adv, mask, entropies, threshold=threshold,
                              quantile=quantile, **kwargs), logp)
    ref_v, g_ref = value_and_grad(
        lambda x: trl_compute_loss(x, old, ref, sampling, adv, mask, entropies,
                                   off_policy_mask_threshold=threshold,
                                   top_entropy_quantile=quantile, max_completion_length=T,
                                   epsilon_high=0.2, **kwargs), logp)
    # verl's seq-mean divides by n + 1e-8, TRL's by max(n, 1): a relative 1e-8 / n
    assert ours == pytest.approx(ref_v, rel=1e-8, abs=1e-12)
    assert torch.allclose(g_ours, g_ref, rtol=1e-8, atol=1e-12)


def test_masks_change_the_loss_but_not_its_normaliser():
    """A dropped token still counts in the token-mean divisor (TRL multiplies the per-token
    loss, not the mask): masking half the tokens halves a uniform loss, it does not keep it."""
    mask = torch.ones(2, 4, dtype=F64)
    logp = torch.full((2, 4), -1.0, dtype=F64)
    adv = torch.ones(2, 4, dtype=F64)
    keep = torch.tensor([[1.0], [0.0]], dtype=F64)
    full = compute_policy_loss("vanilla", logp, logp, adv, mask, LossSettings())[0]
    half = compute_policy_loss("vanilla", logp, logp, adv, mask,
                               LossSettings().with_keep(keep))[0]
    assert float(half) == pytest.approx(0.5 * float(full))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "luspo", "sapo", "cispo", "vespo", "gpg",
                                  "dppo_tv", "clip_cov", "kl_cov", "bypass_mode"])
def test_every_loss_applies_the_keep_multiplier(name):
    """All-ones keep changes nothing; all-zeros keep leaves no policy loss."""
    logp, old, _, _, adv, mask, _ = batch()
    adv_t = adv.expand(B, T)
    s = LossSettings(dro_beta=0.1)
    torch.manual_seed(0)
    plain = compute_policy_loss(name, logp, old, adv_t, mask, s)[0]
    torch.manual_seed(0)
    ones = compute_policy_loss(name, logp, old, adv_t, mask, s.with_keep(torch.ones(B, 1)))[0]
    zeros = compute_policy_loss(name, logp, old, adv_t, mask, s.with_keep(torch.zeros(B, T)))[0]
    assert float(ones) == pytest.approx(float(plain), rel=1e-12)
    assert float(zeros) == 0.0


def test_micro_batch_shares_add_up_with_masks():
    """The masks are decided per row / against a given threshold, so the global-count shares of
    two halves add up to the whole batch's loss."""
    logp, old, _, sampling, adv, mask, entropies = batch(seed=2)
    adv_t = adv.expand(B, T)
    thr = entropy_threshold(entropies[mask.bool()], 0.4)
    for mode in ("token-mean", "seq-mean-token-mean"):
        s = LossSettings(loss_agg_mode=mode).with_counts(float(mask.sum()), float(B), T)

        def part(rows, s=s):
            keep = off_policy_sequence_mask(adv_t[rows], logp[rows], sampling[rows], mask[rows],
                                            0.3)
            keep = keep * high_entropy_mask(entropies[rows], mask[rows], 0.4, thr).to(F64)
            return compute_policy_loss("vanilla", logp[rows], old[rows], adv_t[rows],
                                       mask[rows], s.with_keep(keep))[0]

        whole = part(slice(0, B))
        assert float(part(slice(0, 2)) + part(slice(2, B))) == pytest.approx(float(whole))


# ------------------------------------------------------------------ config


def test_defaults_change_nothing():
    s = AlgorithmSettings()
    assert s.off_policy_mask_threshold is None and s.top_entropy_quantile == 1.0
    assert not s.use_bias_correction_kl and not s.uses_token_keep
    assert s.loss_settings().token_keep is None


@pytest.mark.parametrize("bad, key", [
    ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold"),
    ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
    ({"top_entropy_quantile": 1.2}, "top_entropy_quantile"),
    ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
    ({"use_bias_correction_kl": True}, "use_bias_correction_kl"),
    ({"policy_loss": "geo_mean", "top_entropy_quantile": 0.2}, "top_entropy_quantile"),
    ({"policy_loss": "geo_mean", "off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
])
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(ValidationError, match=key):
        AlgorithmSettings(**bad)


def test_importance_sampling_level_of_the_kl_ratio():
    assert AlgorithmSettings().importance_sampling_level == "token"
    assert AlgorithmSettings(ratio_kind="sequence").importance_sampling_level == "sequence"
    assert AlgorithmSettings(policy_loss="gspo").importance_sampling_level == "sequence"
    assert AlgorithmSettings(policy_loss="luspo").importance_sampling_level == "sequence"
    assert AlgorithmSettings(ratio_kind="sequence",
                             bypass_mode=True).importance_sampling_level == "token"
    ok = AlgorithmSettings(use_kl_loss=True, use_bias_correction_kl=True)
    assert ok.use_bias_correction_kl
