"""The policy-loss registry: every verl 0.9.1 `register_policy_loss` name plus TRL's own losses.

`get_policy_loss_fn(name)(log_prob, old_log_prob, advantages, response_mask, settings,
rollout_is_weights=None) -> (loss, metrics)`, selected by `learner.algorithm.policy_loss`.
`LossSettings` carries every knob (the typed `learner.algorithm.*` keys) and the aggregation
counts of the call, so all losses share one calling convention, as verl's share its ActorConfig.

Definitions follow verl 0.9.1's `core_algos.py` (read from the PyPI wheel; reference/
algorithms.md sections 2 and 4) and TRL 1.16's `GRPOTrainer._compute_loss`; each function names
what it follows and where Forage departs from it. Metrics use verl's names (`pg_clipfrac`,
`ppo_kl`, `pg_clipfrac_lower`), reported only where verl reports them. `LossSettings.token_keep`
(TRL's off-policy and top-entropy masks, token_masks.py) multiplies every loss's per-token
loss before aggregation (all but geo_mean, which refuses it).

Micro-batching: with the global counts given (`LossSettings.global_token_count` /
`global_seq_count`), every loss except `clip_cov` and `kl_cov` returns this call's exact share of
the whole mini-batch loss. clip_cov and kl_cov pick tokens by a covariance over the tokens of the
call (verl computes it per micro-batch, too), so their selection depends on the packing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from services.learner.algorithms.aggregation import agg_loss
from services.learner.algorithms.masked import masked_mean
from services.learner.algorithms.policy_loss import importance_ratio, policy_loss
from services.learner.algorithms.rollout_correction import rollout_correction

Metrics = dict[str, torch.Tensor]
PolicyLossFn = Callable[..., tuple[torch.Tensor, Metrics]]


@dataclass(frozen=True)
class LossSettings:
    """Everything a policy loss reads; defaults are verl's (TRL's where verl has no such loss)."""

    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    delta: float | None = None  # TRL's cap on the unclipped ratio
    ratio_kind: str = "token"  # "sequence": GSPO / TRL importance_sampling_level="sequence"
    log_ratio_clamp: float | None = 20.0
    tau_pos: float = 1.0  # SAPO (TRL sapo_temperature_pos)
    tau_neg: float = 1.05  # SAPO (TRL sapo_temperature_neg)
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    cispo_eps_max: float | None = None  # set: TRL's CISPO, weight min(rho, eps_max)
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # Bypass mode (verl rollout_correction with bypass_mode=True).
    bypass_loss_type: str = "ppo_clip"
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    # Aggregation counts of this call (the trainer fills them per micro-batch).
    global_token_count: float | None = None
    global_seq_count: float | None = None
    max_response_len: int | None = None
    # This call's detached 0/1 multiplier of the per-token loss, broadcastable to (B, T): TRL's
    # off-policy sequence mask and top-entropy mask (token_masks.py). It multiplies the loss,
    # not the aggregation mask, so the normalisers still count the dropped tokens (TRL's
    # `per_token_loss * off_policy_mask * entropy_mask`); None = keep all.
    token_keep: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def counts(self) -> dict[str, Any]:
        return {"global_token_count": self.global_token_count,
                "global_seq_count": self.global_seq_count,
                "max_response_len": self.max_response_len}

    def with_counts(self, tokens: float, seqs: float, max_response_len: int | None) -> LossSettings:
        return replace(self, global_token_count=tokens, global_seq_count=seqs,
                       max_response_len=max_response_len)

    def with_keep(self, token_keep: torch.Tensor | None) -> LossSettings:
        return replace(self, token_keep=token_keep)


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"unknown policy loss {name!r}; known: {known}") from None


def _agg(loss_mat: torch.Tensor, mask: torch.Tensor, s: LossSettings,
         mode: str | None = None) -> torch.Tensor:
    if s.token_keep is not None:
        loss_mat = loss_mat * s.token_keep.detach().to(loss_mat.dtype)
    return agg_loss(loss_mat, mask, mode or s.loss_agg_mode, **s.counts())


def _weighted(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


def _sequence_grad(s: LossSettings) -> str:
    """TRL's sequence-ratio gradient under TRL's per-token masks (policy_loss.importance_ratio)."""
    return "token" if s.token_keep is None else "mean"


def _ppo_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(-log_ratio.detach(), mask)


def _zero(ref: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=ref.dtype, device=ref.device)


def _fmask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype)


# --------------------------------------------------------------------------- PPO clip family


@register_policy_loss("vanilla")
def vanilla(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
            rollout_is_weights=None):
    """verl `vanilla`: PPO clip, clip-higher, dual clip; `ratio_kind="sequence"` is GSPO and
    `delta` TRL's ratio cap (see policy_loss.py)."""
    return policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_agg_mode=s.loss_agg_mode,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c, ratio_kind=s.ratio_kind, delta=s.delta,
        rollout_is_weights=rollout_is_weights, log_ratio_clamp=s.log_ratio_clamp,
        token_keep=s.token_keep, **s.counts(),
    )


@register_policy_loss("gspo")
def gspo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
         rollout_is_weights=None):
    """verl `gspo` (arXiv 2507.18071): the clip on the sequence's geometric-mean ratio, log ratio
    capped at 10, no dual clip, the configured aggregation (verl 0.9.1 no longer forces
    seq-mean-token-mean). verl reports pg_clipfrac_lower = 0."""
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_agg_mode=s.loss_agg_mode,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high, clip_ratio_c=None,
        ratio_kind="sequence", delta=s.delta, rollout_is_weights=rollout_is_weights,
        log_ratio_clamp=s.log_ratio_clamp, token_keep=s.token_keep, **s.counts(),
    )
    return loss, metrics


@register_policy_loss("luspo")
def luspo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
          rollout_is_weights=None):
    """TRL `luspo` (arXiv 2602.05261): GSPO's clip on the sequence ratio, each sequence's loss
    scaled by its length: mean over sequences of sum_t (seq-mean-token-sum, forced). As TRL:
    no log-ratio clamp and no dual clip; `delta` applies. TRL documents luspo as requiring
    importance_sampling_level="sequence", so the ratio is always the sequence one here."""
    return policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum",
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high, clip_ratio_c=None,
        ratio_kind="sequence", delta=s.delta, rollout_is_weights=rollout_is_weights,
        log_ratio_clamp=None, token_keep=s.token_keep, **s.counts(),
    )


# --------------------------------------------------------------------- soft / stop-grad ratios


@register_policy_loss("sapo")
def sapo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
         rollout_is_weights=None):
    """verl `sapo` / TRL `sapo` (arXiv 2511.20347): -A * sigmoid(tau (rho - 1)) * 4 / tau, with
    tau = tau_pos where A > 0 else tau_neg; always aggregated seq-mean-token-mean (both verl and
    TRL). `ratio_kind="sequence"` gives TRL's sequence-level variant. pg_clipfrac(_lower) are 0."""
    mask = _fmask(response_mask, log_prob)
    ratio, log_ratio = importance_ratio(log_prob, old_log_prob, mask, s.ratio_kind,
                                        s.log_ratio_clamp, _sequence_grad(s))
    like = {"dtype": log_prob.dtype, "device": log_prob.device}
    tau = torch.where(advantages > 0, torch.tensor(s.tau_pos, **like),
                      torch.tensor(s.tau_neg, **like))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _agg(_weighted(-gate * advantages, rollout_is_weights), mask, s,
                "seq-mean-token-mean")
    zero = _zero(loss)
    return loss, {"pg_clipfrac": zero, "ppo_kl": _ppo_kl(log_ratio, mask),
                  "pg_clipfrac_lower": zero}


@register_policy_loss("cispo")
def cispo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
          rollout_is_weights=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(w) * A * logp, gradients only through logp.

    verl `cispo` (default): w = clip(rho, 1 - eps_low, 1 + eps_high), rho from the log ratio
    clamped to +-20; pg_clipfrac = fraction with w != rho. TRL `cispo` (`cispo_eps_max` set;
    TRL's epsilon_high, ScaleRL recommends 5.0): w = min(rho, eps_max), one-sided; with
    `ratio_kind="sequence"` rho is the sequence ratio (TRL importance_sampling_level)."""
    mask = _fmask(response_mask, log_prob)
    ratio, log_ratio = importance_ratio(log_prob, old_log_prob, mask, s.ratio_kind,
                                        s.log_ratio_clamp)
    ratio = ratio.detach()
    if s.cispo_eps_max is None:
        weight = ratio.clamp(min=1.0 - s.clip_ratio_low, max=1.0 + s.clip_ratio_high)
    else:
        weight = ratio.clamp(max=s.cispo_eps_max)
    loss = _agg(_weighted(-weight * advantages * log_prob, rollout_is_weights), mask, s)
    return loss, {"pg_clipfrac": masked_mean((ratio != weight).to(mask.dtype), mask),
                  "ppo_kl": _ppo_kl(log_ratio, mask), "pg_clipfrac_lower": _zero(loss)}


@register_policy_loss("vespo")
def vespo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
          rollout_is_weights=None):
    """TRL `vespo` (arXiv 2602.10693): -sg(phi(w)) * A * logp with the sequence ratio
    w = exp(sum_t clamp(log rho_t, +-20)) clamped to [1e-8, e^20] and the Gamma weight
    phi(w) = exp(lam + k log w - lam w) (phi(1) = 1); (k, lam) = (k_pos, lam_pos) where A >= 0
    else (k_neg, lam_neg). Rollout IS weights are folded into w (their logs added, clamped to
    [log 1e-8, 20]) rather than multiplied, as TRL does with its vLLM IS ratio. TRL aggregates
    as "dapo" (= token-mean, the default here); the configured mode is used."""
    mask = _fmask(response_mask, log_prob)
    lower = math.log(1e-8)
    log_ratio = (log_prob - old_log_prob).detach()
    with torch.no_grad():
        seq_log = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
        if rollout_is_weights is not None:
            log_is = torch.log(rollout_is_weights.detach()).clamp(lower, 20.0)
            if s.rollout_is == "sequence":  # one weight repeated on every token of the row
                first = (mask > 0).float().argmax(dim=-1, keepdim=True)
                seq_log = seq_log + log_is.gather(-1, first) * (mask.sum(-1, keepdim=True) > 0)
            else:
                seq_log = seq_log + (log_is * mask).sum(dim=-1, keepdim=True)
        log_w = seq_log.clamp(lower, 20.0)
        nonneg = advantages >= 0
        def pick(pos: float, neg: float) -> torch.Tensor:
            like = {"dtype": log_prob.dtype, "device": log_prob.device}
            return torch.where(nonneg, torch.tensor(pos, **like), torch.tensor(neg, **like))

        k = pick(s.vespo_k_pos, s.vespo_k_neg)
        lam = pick(s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = _agg(-phi * advantages * log_prob, mask, s)
    return loss, {"ppo_kl": _ppo_kl(log_ratio, mask),
                  "vespo_phi_mean": masked_mean(phi.expand_as(mask), mask)}


# ----------------------------------------------------------------------- plain policy gradient


@register_policy_loss("gpg")
def gpg(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
        rollout_is_weights=None):
    """verl `gpg` (arXiv 2504.02546): -logp * A, no ratio; verl reports no metrics."""
    mask = _fmask(response_mask, log_prob)
    return _agg(_weighted(-log_prob * advantages, rollout_is_weights), mask, s), {}


@register_policy_loss("dro")
def dro(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
        rollout_is_weights=None):
    """verl `dro`: -(logp A - beta/2 (logp - old)^2); `dro_beta` > 0 is required (no default)."""
    if s.dro_beta is None or s.dro_beta <= 0:
        raise ValueError("policy_loss=dro needs learner.algorithm.dro_beta > 0")
    mask = _fmask(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    loss_mat = -(log_prob * advantages - 0.5 * s.dro_beta * log_ratio.square())
    loss = _agg(_weighted(loss_mat, rollout_is_weights), mask, s)
    return loss, {"ppo_kl": _ppo_kl(log_ratio, mask)}


def reinforce(log_prob, rollout_log_prob, advantages, response_mask, s: LossSettings,
              rollout_is_weights=None):
    """verl `compute_policy_loss_reinforce` (bypass mode): -sg(w) * logp * A, with the IS
    weights w when given; ppo_kl is KL to the rollout policy."""
    mask = _fmask(response_mask, log_prob)
    loss = _agg(_weighted(-advantages * log_prob, rollout_is_weights), mask, s)
    return loss, {"ppo_kl": _ppo_kl(log_prob - rollout_log_prob, mask)}


@register_policy_loss("bypass_mode")
def bypass_mode(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
                rollout_is_weights=None):
    """verl `bypass_mode` (verl 0.9.1 `verl/trainer/ppo/core_algos.py`,
    `compute_policy_loss_bypass_mode`): `old_log_prob` IS the rollout log-prob (no old-log-prob
    pass). IS weights (current / rollout, detached), the rejection mask and every
    `rollout_corr/*` metric (IS, rejection and the off-policy gap: kl, k3_kl, perplexities,
    chi-square) come from `rollout_correction` on the current log-probs, as verl calls
    `compute_rollout_correction_and_rejection_mask` there; then `bypass_loss_type` picks the
    loss: "reinforce" (IS-weighted REINFORCE) or "ppo_clip" (vanilla on the rejection-masked
    tokens; the ratio pi/pi_rollout already corrects, so no IS weights). The aggregation counts
    are the caller's (verl counts the tokens before rejection here, too)."""
    mask = _fmask(response_mask, log_prob)
    weights, effective, corr_metrics = rollout_correction(
        log_prob.detach(), old_log_prob.detach(), mask,
        rollout_is=s.rollout_is, rollout_is_threshold=s.rollout_is_threshold,
        rollout_is_batch_normalize=s.rollout_is_batch_normalize,
        rollout_rs=s.rollout_rs, rollout_rs_threshold=s.rollout_rs_threshold)
    if s.bypass_loss_type == "reinforce":
        loss, out = reinforce(log_prob, old_log_prob, advantages, effective, s, weights)
    elif s.bypass_loss_type == "ppo_clip":
        loss, out = vanilla(log_prob, old_log_prob, advantages, effective,
                            replace(s, ratio_kind="token"), None)
    else:
        raise ValueError(f"bypass_loss_type must be 'reinforce' or 'ppo_clip', "
                         f"got {s.bypass_loss_type!r}")
    for key, value in corr_metrics.items():  # already `rollout_corr/`-prefixed
        out[key] = torch.tensor(value, dtype=log_prob.dtype)
    return loss, out


# --------------------------------------------------------------------- divergence-based masks


def _dppo(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
          rollout_is_weights, valid_of: Callable[..., torch.Tensor]):
    mask = _fmask(response_mask, log_prob)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    cap = s.clip_ratio_c if s.clip_ratio_c is not None else math.inf
    truncated = ratio.clamp(max=cap).detach()
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        valid = valid_of(prob, old_prob, log_prob, old_log_prob).to(log_prob.dtype)
    loss_mat = -advantages * truncated * log_prob * valid
    loss = _agg(_weighted(loss_mat, rollout_is_weights), mask, s)
    return loss, {"pg_clipfrac": masked_mean(1.0 - valid, mask),
                  "ppo_kl": _ppo_kl(log_ratio, mask),
                  "pg_clipfrac_lower": masked_mean((ratio.detach() > cap).to(mask.dtype) * valid,
                                                   mask)}


@register_policy_loss("dppo_tv")
def dppo_tv(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
            rollout_is_weights=None):
    """verl `dppo_tv` (DPPO-Binary-TV, arXiv 2602.04879): -A * sg(min(rho, c)) * logp on tokens
    whose probability moved by at most eps_high up (A > 0) or eps_low down (A <= 0); the clip
    ratios are the TV thresholds and c = clip_ratio_c (verl's ActorConfig default 3.0; the paper
    recommends a large cap, e.g. 20)."""
    def valid(prob, old_prob, _lp, _olp):
        up = (prob - old_prob) <= s.clip_ratio_high
        down = (prob - old_prob) >= -s.clip_ratio_low
        return torch.where(advantages > 0, up, down)

    return _dppo(log_prob, old_log_prob, advantages, response_mask, s, rollout_is_weights, valid)


@register_policy_loss("dppo_kl")
def dppo_kl(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
            rollout_is_weights=None):
    """verl `dppo_kl` (DPPO-Binary-KL): as dppo_tv with the binary KL
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) <= eps as the
    trust region, enforced only in the direction the advantage pushes."""
    def valid(prob, old_prob, lp, olp):
        kl = old_prob * (olp - lp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        up = (kl <= s.clip_ratio_high) | (prob <= old_prob)
        down = (kl <= s.clip_ratio_low) | (prob >= old_prob)
        return torch.where(advantages > 0, up, down)

    return _dppo(log_prob, old_log_prob, advantages, response_mask, s, rollout_is_weights, valid)


# -------------------------------------------------------------------- covariance-based (entropy)


def _centred_cov(advantages, log_prob, mask):
    """(A - mean A)(logp - mean logp) with this call's masked means (verl's Cov)."""
    return (advantages - masked_mean(advantages, mask)) * (
        log_prob.detach() - masked_mean(log_prob.detach(), mask))


@register_policy_loss("clip_cov")
def clip_cov(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
             rollout_is_weights=None, generator: torch.Generator | None = None):
    """verl `clip_cov` (Entropy Mechanism, arXiv 2505.22617): PPO clip (no log-ratio clamp, no
    dual clip), then the loss of a random max(int(ratio * N), 1) tokens among those not already
    clipped whose covariance lies in (lb, ub) is zeroed (N = masked tokens of this call).
    pg_clipfrac = fraction zeroed. Randomness: torch's global RNG unless `generator` is given."""
    mask = _fmask(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    with torch.no_grad():
        clipped = (loss2 > loss1) & (mask > 0)
        cov = _centred_cov(advantages, log_prob, mask)
        cov = cov.masked_fill((mask == 0) | clipped, -math.inf)
        count = max(int(s.clip_cov_ratio * float(mask.sum())), 1)
        candidates = torch.nonzero((cov > s.clip_cov_lb) & (cov < s.clip_cov_ub) & (mask > 0))
        corr = torch.ones_like(advantages)
        if len(candidates):
            order = torch.randperm(len(candidates), generator=generator)
            chosen = candidates[order[: min(count, len(candidates))].to(candidates.device)]
            corr[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = _agg(_weighted(torch.maximum(loss1, loss2) * corr, rollout_is_weights), mask, s)
    return loss, {"pg_clipfrac": masked_mean((corr == 0).to(mask.dtype), mask),
                  "ppo_kl": _ppo_kl(log_ratio, mask)}


@register_policy_loss("kl_cov")
def kl_cov(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
           rollout_is_weights=None):
    """verl `kl_cov`: the unclipped surrogate -A rho, plus ppo_kl_coef * |logp - old| on the
    top max(1, int(N * kl_cov_ratio)) tokens by covariance (N = masked tokens of this call).
    verl's `actor/ppo_kl` here is the mean |log ratio|."""
    mask = _fmask(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss_mat = -advantages * ratio
    valid = (mask > 0).reshape(-1)
    n_valid = int(valid.sum())
    if n_valid:
        with torch.no_grad():
            flat_idx = torch.nonzero(valid, as_tuple=True)[0]
            adv_v = advantages.detach().reshape(-1)[flat_idx]
            lp_v = log_prob.detach().reshape(-1)[flat_idx]
            cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
            k = max(1, int(n_valid * s.kl_cov_ratio))
            top = flat_idx[torch.topk(cov, k, largest=True).indices]
            penalise = torch.zeros(loss_mat.numel(), dtype=torch.bool, device=loss_mat.device)
            penalise[top] = True
            penalise = penalise.view_as(loss_mat)
        loss_mat = torch.where(penalise, loss_mat + s.ppo_kl_coef * log_ratio.abs(), loss_mat)
    loss = _agg(_weighted(loss_mat, rollout_is_weights), mask, s)
    return loss, {"ppo_kl": masked_mean(log_ratio.detach().abs(), mask)}


# --------------------------------------------------------------------------------- GMPO


@register_policy_loss("geo_mean")
def geo_mean(log_prob, old_log_prob, advantages, response_mask, s: LossSettings,
             rollout_is_weights=None):
    """verl `geo_mean` (GMPO, arXiv 2507.20673): per-token log ratios clipped to
    [-eps_low, eps_high] in the direction of sgn(A) (the wider, token-level clip), the
    sequence ratio exp(mean_t) times the sequence's mean advantage; loss = mean over sequences
    of -A_i rho_i. `loss_agg_mode` is not used (as verl). Forage divides by the global sequence
    count when the trainer gives one, so micro-batch shares add up (verl: torch.mean over the
    micro-batch's rows). Rollout IS weights enter as their geometric mean per sequence. A
    per-token loss multiplier (`token_keep`) has no place in a per-sequence ratio: refused."""
    if s.token_keep is not None:
        raise ValueError("policy_loss geo_mean has no per-token loss to mask: "
                         "off_policy_mask_threshold and top_entropy_quantile < 1 need another loss")
    mask = _fmask(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-s.clip_ratio_low, s.clip_ratio_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1)
    ratio = torch.exp((chosen * mask).sum(dim=-1) / (lengths + 1e-8))
    seq_adv = (advantages * mask).sum(dim=-1) / (lengths + 1e-8)
    per_seq = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        per_seq = per_seq * torch.exp((log_w * mask).sum(dim=-1) / (lengths + 1e-8))
    count = s.global_seq_count if s.global_seq_count is not None else per_seq.shape[0]
    loss = per_seq.sum() / max(float(count), 1e-12) if per_seq.numel() else per_seq.sum()
    with torch.no_grad():
        was_clipped = log_ratio != clamped
        metrics = {
            "pg_clipfrac": masked_mean((was_clipped & (advantages > 0)).to(mask.dtype), mask),
            "ppo_kl": _ppo_kl(log_ratio, mask),
            "pg_clipfrac_lower": masked_mean((was_clipped & (advantages < 0)).to(mask.dtype),
                                             mask),
        }
    return loss, metrics


def compute_policy_loss(
    name: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The named loss and its metrics (detached)."""
    loss, metrics = get_policy_loss_fn(name)(log_prob, old_log_prob, advantages, response_mask,
                                             settings, rollout_is_weights)
    return loss, {k: v.detach() for k, v in metrics.items()}
