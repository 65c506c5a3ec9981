"""Rollout correction: importance weights and rejection masks against the behaviour policy.

With asynchronous training (`learner.max_staleness` > 0) a trajectory was sampled by weights up
to s versions old, by an inference engine whose numerics differ from the trainer's. The
`rollout_logprobs` it carries are log pi_rollout; the learner's `old_logprobs` (or, in bypass
mode, the current log-probs) are log pi_train. Everything here works on
log_ratio = log pi_train - log pi_rollout over response tokens, following verl 0.9.1's
`rollout_corr_helper` (definitions, thresholds, metric names; written from its description,
reference/algorithms.md):

- Importance sampling (`rollout_is`): "token" weights exp(log_ratio) per token (biased, low
  variance), or "sequence" weights exp(sum_t log_ratio) on every token of the row (unbiased,
  high variance). Exponents are clamped to +-20. A threshold "2.0" truncates the weights at 2
  (TIS); "0.5_5.0" zeroes weights outside [0.5, 5] instead (IcePop). `batch_normalize` rescales
  the weights to mean 1 (over tokens, or over sequences for sequence weights).
- Rejection (`rollout_rs`): comma-separated criteria, all of which a token must pass, else its
  mask becomes 0. token_k1/k2/k3 judge each token; seq_sum_*, seq_mean_* and seq_max_* judge
  (and drop) the whole sequence. k1 = -log_ratio with bounds "lower_upper" on exp(k1) =
  pi_rollout / pi_train (verl's convention: the inverse of the IS ratio; a single value u means
  [1/u, u], symmetric, so the direction only matters for asymmetric bands), k2 = log_ratio^2 / 2,
  k3 = exp(log_ratio) - 1 - log_ratio, both with an upper bound only. seq_mean_k1 with
  "0.999_1.001" is verl's geometric-mean rejection (Geo-RS).
- Off-policy metrics: KL(pi_rollout || pi_train) by k1 and k3, perplexities, chi-square.

Every metric is returned under verl's names with the `rollout_corr/` prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.learner.algorithms.masked import masked_mean

SAFETY_BOUND = 20.0  # exponents are clamped to +-20 before exp (verl)
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class ISThreshold:
    upper: float
    lower: float | None  # set: IcePop (zero outside [lower, upper]); None: TIS (truncate)


@dataclass(frozen=True)
class RSBound:
    option: str
    upper: float  # k1: upper bound of exp(k1) = pi_rollout / pi_train; k2/k3: of the divergence
    lower: float | None  # k1 only: lower bound of exp(k1)


def parse_is_threshold(spec: float | str) -> ISThreshold:
    """2.0 / "2.0" -> truncate at 2 (TIS); "0.5_5.0" -> keep [0.5, 5] (IcePop)."""
    if isinstance(spec, bool):
        raise ValueError("rollout_is_threshold must be a number or 'lower_upper', not a boolean")
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    else:
        text = str(spec).strip()
        try:
            if "_" in text:
                low_text, up_text = text.split("_", 1)
                lower, upper = float(low_text), float(up_text)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r}: expected 'upper' or "
                             "'lower_upper' numbers") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: lower bound above upper bound")
    return ISThreshold(upper, lower)


def parse_rs(options: str, spec: float | str | None) -> list[RSBound]:
    """Criteria of `rollout_rs` ("token_k1,seq_mean_k3") with their `rollout_rs_threshold`
    ("0.5_2.0,0.01": one entry per criterion, or one shared by all)."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_rs names no criterion")
    unknown = [n for n in names if n not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs: unknown criterion {unknown[0]!r}; "
                         f"known: {', '.join(RS_OPTIONS)}")
    if spec is None or isinstance(spec, bool):
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = ([str(spec)] if isinstance(spec, int | float)
             else [p.strip() for p in str(spec).split(",") if p.strip()])
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries for {len(names)} "
                         "criteria (give one, or one per criterion)")
    bounds = []
    for name, text in zip(names, specs, strict=True):
        try:
            if name.endswith("k1"):
                if "_" in text:
                    low_text, up_text = text.split("_", 1)
                    lower, upper = float(low_text), float(up_text)
                else:
                    upper = float(text)
                    lower = 1.0 / upper
                if not (lower > 0 and upper > 0 and lower <= upper):
                    raise ValueError
            else:
                if "_" in text:
                    raise ValueError
                upper, lower = float(text), None
                if not upper > 0:
                    raise ValueError
        except (ValueError, ZeroDivisionError):
            form = "'lower_upper' ratio bounds" if name.endswith("k1") else "one positive bound"
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: expected {form}") from None
        bounds.append(RSBound(name, upper, lower))
    return bounds


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(values, mask, dim=-1)


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float | str = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached importance weights (zero on masked positions) and their metrics."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)}, got {level!r}")
    bound = parse_is_threshold(threshold)
    mask = mask.to(log_ratio.dtype)
    log_ratio = log_ratio.detach()
    if level == "token":
        metric_log = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        metric_log = (log_ratio * mask).sum(dim=-1, keepdim=True)
        raw = torch.exp(metric_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if bound.lower is None:
        weights = raw.clamp(max=bound.upper)
    else:
        keep = (raw >= bound.lower) & (raw <= bound.upper)
        weights = torch.where(keep, raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, metric_log, mask, level, bound) if bool(
        (mask > 0).any()) else {}
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_w = _seq_mean(weights, mask)
            seq_valid = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (seq_w * seq_valid).sum() / seq_valid.sum().clamp(min=1e-8)
        if float(mean) > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    metric_log: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    bound: ISThreshold,
) -> dict[str, float]:
    upper = bound.upper
    lower = 1.0 / upper if bound.lower is None else bound.lower
    valid = mask > 0
    out: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(metric_log.max()), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(metric_log.min()))
        out["rollout_is_ratio_fraction_high"] = float((metric_log > math.log(upper)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((metric_log < math.log(lower)).float().mean())
    else:
        out["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).to(mask.dtype),
                                                                  mask))
        out["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lower).to(mask.dtype),
                                                                 mask))
        out["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        out["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
    clamped = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(clamped, mask)
    if mask.sum() > 1:
        var = masked_mean(clamped.square(), mask) - mean.square()
        out["rollout_is_std"] = float(var.clamp(min=0.0).sqrt())
    else:
        out["rollout_is_std"] = 0.0
    # ESS as a fraction of the tokens: 1 / E[(w / E[w])^2] (1 = every weight equal).
    normalised = clamped / (mean + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalised.square(), mask))
    seq = _seq_mean(weights, mask)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    raw_seq = _seq_mean(raw, mask)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < lower).float().mean())
    if bound.lower is not None:
        oob = (raw < bound.lower) | (raw > bound.upper)
        out["rollout_is_oob_ratio"] = float(masked_mean(oob.to(mask.dtype), mask))
    return out


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: str, threshold: float | str | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """`mask` with every token (or whole sequence) that fails a criterion set to 0, and metrics."""
    bounds = parse_rs(options, threshold)
    fmask = mask.to(log_ratio.dtype)
    valid = fmask > 0
    safe = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep_all = torch.ones_like(fmask)
    seq_valid = fmask.sum(dim=-1) > 0
    metrics: dict[str, float] = {}
    for b in bounds:
        level, kind = b.option.rsplit("_", 1)
        values = per_token[kind]
        if level == "token":
            stat = values
        elif level == "seq_sum":
            stat = (values * fmask).sum(dim=-1, keepdim=True)
        elif level == "seq_mean":
            stat = _seq_mean(values, fmask).unsqueeze(-1)
        else:  # seq_max
            top = values.masked_fill(~valid, float("-inf")).max(dim=-1, keepdim=True).values
            stat = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        if kind == "k1":
            low, high = math.log(b.lower), math.log(b.upper)  # type: ignore[arg-type]
            keep = (stat >= low) & (stat <= high)
        else:
            low, high = 0.0, b.upper
            keep = stat <= high
        keep = keep.expand_as(fmask).to(fmask.dtype)
        keep_all = keep_all * keep
        name = f"rollout_rs_{b.option}"
        full = stat.expand_as(fmask)
        metrics[f"{name}_mean"] = float(masked_mean(full, fmask))
        metrics[f"{name}_max"] = float(full.masked_fill(~valid, float("-inf")).max())
        metrics[f"{name}_min"] = float(full.masked_fill(~valid, float("inf")).min())
        if level == "token":
            high_frac = float(masked_mean((full > high).to(fmask.dtype), fmask))
            low_frac = float(masked_mean((full < low).to(fmask.dtype), fmask))
        else:  # over sequences with a valid token (verl)
            per_seq = stat.squeeze(-1)[seq_valid]
            high_frac = float((per_seq > high).float().mean()) if per_seq.numel() else 0.0
            low_frac = float((per_seq < low).float().mean()) if per_seq.numel() else 0.0
        metrics[f"{name}_fraction_high"] = high_frac
        metrics[f"{name}_fraction_low"] = low_frac if kind == "k1" else 0.0
        metrics[f"{name}_masked_fraction"] = float(masked_mean(1 - keep, fmask))
        dropped_seq = ((keep < 0.5) & valid).any(dim=-1)
        metrics[f"{name}_seq_masked_fraction"] = (
            float((dropped_seq & seq_valid).float().sum() / seq_valid.float().sum())
            if seq_valid.any() else 0.0)
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - keep_all, fmask))
    metrics["rollout_rs_seq_masked_fraction"] = float(
        ((keep_all < 0.5) & valid).any(dim=-1).float().mean())
    return (mask * keep_all.to(mask.dtype)), metrics


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the training policy is from the one that sampled: KL(rollout || train) by k1
    (`kl`) and k3 (`k3_kl`), perplexities and their log difference, chi-square (token and
    sequence level)."""
    fmask = mask.to(train_log_prob.dtype)
    train, rollout = train_log_prob.detach(), rollout_log_prob.detach()
    mean_train = _seq_mean(train, fmask)
    mean_rollout = _seq_mean(rollout, fmask)
    log_ratio = train - rollout
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log = (log_ratio * fmask).sum(dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    diff = mean_rollout - mean_train
    return {
        "training_ppl": float(torch.exp(-mean_train).mean()),
        "training_log_ppl": float((-mean_train).mean()),
        "kl": float(masked_mean(rollout - train, fmask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, fmask)),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(safe).square(), fmask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log).mean() - 1.0),
    }


@torch.no_grad()
def rollout_correction(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, the mask after rejection, `rollout_corr/*` metrics) for a batch."""
    if train_log_prob.shape != rollout_log_prob.shape or train_log_prob.shape != response_mask.shape:
        raise ValueError("rollout_correction: log-probs and mask must have one (batch, T) shape, "
                         f"got {tuple(train_log_prob.shape)}, {tuple(rollout_log_prob.shape)} "
                         f"and {tuple(response_mask.shape)}")
    if not bool((response_mask > 0).any()):
        return None, response_mask, {}
    log_ratio = train_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, response_mask, rollout_is,
                                         rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask
    if rollout_rs is not None:
        mask, rs_metrics = rejection_mask(log_ratio, response_mask, rollout_rs,
                                          rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(train_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {PREFIX + k: v for k, v in metrics.items()}
