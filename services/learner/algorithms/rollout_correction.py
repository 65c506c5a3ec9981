"""Rollout correction: importance weights and rejection masks against the behaviour policy.

With asynchronous training (`learner.max_staleness` > 0) a trajectory was sampled by weights up
to s versions old, by an inference engine whose numerics differ from the trainer's. The
`rollout_logprobs` it carries are log pi_rollout; the learner's `old_logprobs` (or, in bypass
mode, the current log-probs) are log pi_train. Everything here works on
log_ratio = log pi_train - log pi_rollout over response tokens, following verl 0.9.1's
`rollout_corr_helper` (definitions, thresholds, metric names and formulas; written from its
description, reference/algorithms.md, and checked against the source of the PyPI wheel,
`verl/trainer/ppo/rollout_corr_helper.py`):

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
- Off-policy metrics: KL(pi_rollout || pi_train) by k1 and k3, perplexities, chi-square. verl
  reports them whenever rollout correction runs, bypass mode included (there from the current
  log-probs, per micro-batch).

Every metric is returned under verl's names with the `rollout_corr/` prefix. Masked sums and
means follow verl's `torch_functional.masked_sum/masked_mean`: a NaN or inf on a masked
position (padding) never reaches a metric, and a fully masked row has mean 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.learner.algorithms.masked import MEAN_EPS

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


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl 0.9.1 `verl/utils/torch_functional.py::masked_sum`: values outside the mask are
    replaced by 0 before the product, so a NaN or inf there (padding) cannot leak into the sum."""
    prod = torch.where(mask.bool(), values, 0.0) * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl 0.9.1 `torch_functional.py::masked_mean`: masked sum / (mask count + 1e-8); a fully
    masked row gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return _masked_sum(values, mask, dim) / (count + MEAN_EPS)


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked_mean(values, mask, dim=-1)


def _std_or_zero(values: torch.Tensor) -> float:
    """`tensor.std()` (unbiased) when there are at least two values, else 0 (verl's guard)."""
    return float(values.std()) if values.numel() > 1 else 0.0


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float | str = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached importance weights (zero on masked positions) and their metrics (unprefixed).

    verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights`
    (without the distributed mean of `batch_normalize`: here the batch is the caller's tensor).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)}, got {level!r}")
    bound = parse_is_threshold(threshold)
    fmask = mask.to(log_ratio.dtype)
    valid = fmask.bool()
    log_ratio = log_ratio.detach()
    if level == "token":
        metric_log = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        metric_log = _masked_sum(log_ratio, fmask, dim=-1).unsqueeze(-1)
        raw = torch.exp(metric_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    # verl: raw * response_mask; the where keeps padding at 0 even where its log-probs are NaN
    raw = torch.where(valid, raw, 0.0) * fmask
    if bound.lower is None:
        weights = raw.clamp(max=bound.upper)
    else:
        keep = (raw >= bound.lower) & (raw <= bound.upper)
        weights = torch.where(keep, raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, metric_log, fmask, level, bound) if bool(
        valid.any()) else {}
    if batch_normalize:
        if level == "token":
            mean = _masked_mean(weights, fmask)
        else:
            seq_w = _seq_mean(weights, fmask)
            seq_valid = (fmask.sum(dim=-1) > 0).to(weights.dtype)
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
    """verl 0.9.1 `rollout_corr_helper.py::compute_is_metrics` (+ `rollout_is_oob_ratio` from
    `compute_rollout_correction_weights`). `mask` is float; it selects at least one token.

    Sequence-level statistics run over every row of the batch, a fully masked row included
    (its mean weight is 0), as in verl."""
    upper = bound.upper
    lower = 1.0 / upper if bound.lower is None else bound.lower
    valid = mask.bool()
    out: dict[str, float] = {}
    if level == "sequence":
        out["rollout_is_max"] = float(torch.exp(metric_log.max().clamp(max=SAFETY_BOUND)))
        out["rollout_is_min"] = float(torch.exp(metric_log.min()))
        out["rollout_is_mean"] = float(_masked_mean(weights, mask))
        out["rollout_is_ratio_fraction_high"] = float((metric_log > math.log(upper)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((metric_log < math.log(lower)).float().mean())
    else:
        out["rollout_is_mean"] = float(_masked_mean(weights, mask))
        out["rollout_is_ratio_fraction_high"] = float(_masked_mean((raw > upper).to(mask.dtype),
                                                                   mask))
        out["rollout_is_ratio_fraction_low"] = float(_masked_mean((raw < lower).to(mask.dtype),
                                                                  mask))
        out["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        out["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
    # std and ESS from the applied weights, clamped to [0, upper] (IcePop's zeros count)
    clamped = weights.clamp(min=0.0, max=upper)
    mean = _masked_mean(clamped, mask)
    if mask.sum() > 1:
        var = _masked_mean(clamped.square(), mask) - mean.square()
        out["rollout_is_std"] = float(var.clamp(min=0.0).sqrt())
    else:
        out["rollout_is_std"] = 0.0
    # ESS as a fraction of the tokens: 1 / E[(w / E[w])^2] (1 = every weight equal). Every
    # weight 0 (IcePop rejected all): verl divides by 0 and raises; reported as 0 here.
    second = float(_masked_mean((clamped / (mean + 1e-8)).square(), mask))
    out["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    seq = _seq_mean(weights, mask)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = _std_or_zero(seq)
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())  # from the ideal 1
    raw_seq = _seq_mean(raw, mask)  # before truncation: a truncated mean never exceeds `upper`
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < lower).float().mean())
    if bound.lower is not None:
        oob = (raw < bound.lower) | (raw > bound.upper)
        out["rollout_is_oob_ratio"] = float(_masked_mean(oob.to(mask.dtype), mask))
    return out


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: str, threshold: float | str | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """`mask` with every token (or whole sequence) that fails a criterion set to 0, and metrics
    (unprefixed).

    verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_rejection_mask`, with
    the per-criterion metrics of `compute_rs_metrics` (`_rs_metrics` here)."""
    bounds = parse_rs(options, threshold)
    fmask = mask.to(log_ratio.dtype)
    valid = fmask.bool()
    safe = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep_all = torch.ones_like(fmask)
    seq_valid = fmask.sum(dim=-1) > 0
    metrics: dict[str, float] = {}
    for b in bounds:
        level, kind = b.option.rsplit("_", 1)
        values = per_token[kind]
        seq_stat: torch.Tensor | None = None
        if level == "token":
            stat = values
        else:
            if level == "seq_sum":
                seq_stat = _masked_sum(values, fmask, dim=-1)
            elif level == "seq_mean":
                seq_stat = _seq_mean(values, fmask)
            else:  # seq_max; a row without a valid token gets 0 (verl)
                top = values.masked_fill(~valid, float("-inf")).max(dim=-1).values
                seq_stat = torch.where(top == float("-inf"), torch.zeros_like(top), top)
            stat = seq_stat.unsqueeze(-1).expand_as(fmask)
        if kind == "k1":
            low, high = math.log(b.lower), math.log(b.upper)  # type: ignore[arg-type]
            keep = (stat >= low) & (stat <= high)
        else:
            low, high = 0.0, b.upper
            keep = stat <= high
        keep = keep.to(fmask.dtype)
        keep_all = keep_all * keep
        name = f"rollout_rs_{b.option}"
        metrics.update(_rs_metrics(name, stat, seq_stat, fmask, seq_valid, high, low,
                                   kind == "k1"))
        metrics[f"{name}_masked_fraction"] = float(_masked_mean(1 - keep, fmask))
        dropped_seq = ((keep < 0.5) & valid).any(dim=-1)
        metrics[f"{name}_seq_masked_fraction"] = (
            float((dropped_seq & seq_valid).float().sum() / seq_valid.float().sum())
            if seq_valid.any() else 0.0)
    metrics["rollout_rs_masked_fraction"] = float(_masked_mean(1 - keep_all, fmask))
    metrics["rollout_rs_seq_masked_fraction"] = float(
        ((keep_all < 0.5) & valid).any(dim=-1).float().mean())
    return (mask * keep_all.to(mask.dtype)), metrics


def _rs_metrics(
    name: str,
    token_stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    mask: torch.Tensor,
    seq_valid: torch.Tensor,
    upper: float,
    lower: float,
    has_lower: bool,
) -> dict[str, float]:
    """One criterion's statistics: verl 0.9.1 `rollout_corr_helper.py::compute_rs_metrics`.

    `token_stat`: the statistic on every token ((batch, T); a sequence criterion's value
    repeated over its row); `seq_stat`: the per-sequence value of a sequence criterion, None for
    a token criterion (whose per-sequence value is then the masked mean over the row).
    `upper`/`lower`: the bounds in the statistic's units (log-ratio bounds for k1; `lower` is 0
    and unused for k2/k3). Token-weighted means (`_mean`, `_std`) count every valid token;
    `_seq_*` count the sequences with a valid token. `mask` selects at least one token."""
    valid = mask.bool()
    per_seq = seq_stat if seq_stat is not None else _seq_mean(token_stat, mask)
    seqs = per_seq[seq_valid]
    out: dict[str, float] = {f"{name}_mean": float(_masked_mean(token_stat, mask))}
    if seq_stat is not None and seqs.numel() > 0:
        out[f"{name}_max"] = float(seqs.max())
        out[f"{name}_min"] = float(seqs.min())
        out[f"{name}_fraction_high"] = float((seqs > upper).float().mean())
        out[f"{name}_fraction_low"] = float((seqs < lower).float().mean()) if has_lower else 0.0
    else:
        out[f"{name}_max"] = float(token_stat.masked_fill(~valid, float("-inf")).max())
        out[f"{name}_min"] = float(token_stat.masked_fill(~valid, float("inf")).min())
        out[f"{name}_fraction_high"] = float(_masked_mean((token_stat > upper).to(mask.dtype),
                                                          mask))
        out[f"{name}_fraction_low"] = (float(_masked_mean((token_stat < lower).to(mask.dtype),
                                                          mask)) if has_lower else 0.0)
    if mask.sum() > 1:  # std of the statistic clamped to [lower (k1) or 0, upper]
        clamped = token_stat.clamp(min=lower if has_lower else 0.0, max=upper)
        mean = _masked_mean(clamped, mask)
        var = _masked_mean(clamped.square(), mask) - mean.square()
        out[f"{name}_std"] = float(var.clamp(min=0.0).sqrt())
    else:
        out[f"{name}_std"] = 0.0
    if seqs.numel() > 0:
        out[f"{name}_seq_mean"] = float(seqs.mean())
        out[f"{name}_seq_std"] = _std_or_zero(seqs)
        out[f"{name}_seq_max"] = float(seqs.max())
        out[f"{name}_seq_min"] = float(seqs.min())
        out[f"{name}_seq_max_deviation"] = float(seqs.abs().max())  # from the ideal 0
        out[f"{name}_seq_fraction_high"] = float((seqs > upper).float().mean())
        if has_lower:  # verl reports it for k1 criteria only
            out[f"{name}_seq_fraction_low"] = float((seqs < lower).float().mean())
    else:  # no sequence with a valid token (verl: unreachable once the mask selects one)
        for key in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                    "seq_fraction_high", "seq_fraction_low"):
            out[f"{name}_{key}"] = 0.0
    return out


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the training policy is from the one that sampled (unprefixed): KL(rollout ||
    train) by k1 (`kl`) and k3 (`k3_kl`), perplexities and their log difference, chi-square
    (token and sequence level).

    verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py::compute_offpolicy_metrics`. Token
    metrics are masked means over the valid tokens; perplexities and log-ppl differences are
    per-sequence masked means averaged over every row (a fully masked row counts with mean
    log-prob 0, i.e. perplexity 1, as in verl); only the chi-square exponents are clamped to
    +-20. `mask` selects at least one token."""
    fmask = mask.to(train_log_prob.dtype)
    train, rollout = train_log_prob.detach(), rollout_log_prob.detach()
    mean_train = _seq_mean(train, fmask)
    mean_rollout = _seq_mean(rollout, fmask)
    log_ratio = train - rollout
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log = _masked_sum(log_ratio, fmask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    diff = mean_rollout - mean_train
    values = {
        "training_ppl": torch.exp(-mean_train).mean(),
        "training_log_ppl": (-mean_train).mean(),
        "kl": _masked_mean(rollout - train, fmask),
        "k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, fmask),
        "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "rollout_log_ppl": (-mean_rollout).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": _masked_mean(torch.exp(safe).square(), fmask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log).mean() - 1.0,
    }
    # one device-to-host copy for all of them (bypass mode runs this every micro-batch)
    return dict(zip(values, torch.stack(list(values.values())).tolist(), strict=True))


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
    """(IS weights or None, the mask after rejection, `rollout_corr/*` metrics) for a batch.

    verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`,
    `compute_rollout_correction_and_rejection_mask`: the IS metrics, the rejection metrics and
    always the off-policy metrics, all computed on the mask before rejection. The decoupled
    mode calls it with the old log-probs (rl_batch.apply_rollout_correction), bypass mode from
    the loss with the current ones (policy_losses.bypass_mode), as verl's
    `core_algos.py::compute_policy_loss_bypass_mode` does. A mask without a valid token gives
    (None, the mask, {}) where verl raises."""
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
