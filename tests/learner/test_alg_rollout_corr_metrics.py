"""Every `rollout_corr/*` metric against verl 0.9.1 (`verl/trainer/ppo/rollout_corr_helper.py`
of the PyPI wheel: `compute_is_metrics`, `compute_rollout_correction_weights`, `compute_rs_metrics`,
`compute_rollout_rejection_mask`, `compute_offpolicy_metrics`,
`compute_rollout_correction_and_rejection_mask`; `core_algos.py::compute_policy_loss_bypass_mode`
for bypass mode; `verl/utils/torch_functional.py::masked_sum/masked_mean` for the masking).

The references below are written out independently, row by row over the valid tokens only
(numpy on Python lists), from verl's definitions: masked means divide by (count + 1e-8), a fully
masked row has mean 0 and takes part in the per-row batch means where verl's do, sequence
statistics of the rejection criteria count only rows with a valid token, exponents are clamped
to +-20 where verl clamps them. The batch has an observation gap, a fully masked row, and NaN
log-probs on masked positions (verl's masked sums never read them). The metric names are checked
to be exactly verl's, in the decoupled mode, in bypass mode and through the learner's batch
application.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.learner.algorithms import AlgorithmSettings, LossSettings, compute_policy_loss
from services.learner.algorithms.rollout_correction import (
    is_weights,
    rejection_mask,
    rollout_correction,
)
from services.learner.packing import Sample
from services.learner.rl_batch import apply_rollout_correction

F64 = torch.float64
EPS = 1e-8  # verl masked_mean: sum / (count + 1e-8)
B, T = 5, 7

OFFPOLICY_NAMES = {
    "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
    "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
    "chi2_token", "chi2_seq",
}
IS_NAMES = {
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low", "rollout_is_std", "rollout_is_eff_sample_size",
    "rollout_is_seq_mean", "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min",
    "rollout_is_seq_max_deviation", "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low",
}


def rs_names(option: str) -> set[str]:
    """verl's per-criterion keys (compute_rs_metrics + the two masked fractions)."""
    suffixes = ["mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean",
                "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                "masked_fraction", "seq_masked_fraction"]
    if option.endswith("k1"):
        suffixes.append("seq_fraction_low")  # verl: only when the lower bound applies
    return {f"rollout_rs_{option}_{s}" for s in suffixes}


RS_GLOBAL = {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}


def batch(seed: int = 0, spread: float = 0.4, nan_padding: bool = True):
    """(train, rollout, mask): row 1 has an observation gap, row 4 no valid token; masked
    positions hold NaN log-probs (with `nan_padding`)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    train = rollout + spread * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 5:] = 0
    mask[1, 2:4] = 0
    mask[2, 6:] = 0
    mask[4, :] = 0
    if nan_padding:
        train = train.masked_fill(mask == 0, float("nan"))
        rollout = rollout.masked_fill(mask == 0, float("nan"))
    return train, rollout, mask


# ------------------------------------------------------------------ references (verl, by row)


def rows(x: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Each row's values at its valid positions (a fully masked row: an empty array)."""
    return [np.array([float(x[i, t]) for t in range(x.shape[1]) if float(mask[i, t]) == 1.0])
            for i in range(x.shape[0])]


def tmean(values: list[np.ndarray]) -> float:
    """Token-level masked mean over the batch."""
    flat = np.concatenate(values)
    return float(flat.sum() / (flat.size + EPS))


def rmean(values: list[np.ndarray]) -> np.ndarray:
    """Per-row masked mean (0 for a row without a valid token)."""
    return np.array([r.sum() / (r.size + EPS) for r in values])


def ref_offpolicy(train, rollout, mask) -> dict[str, float]:
    tr, ro = rows(train, mask), rows(rollout, mask)
    lr = [a - b for a, b in zip(tr, ro, strict=True)]
    mean_train, mean_rollout = rmean(tr), rmean(ro)
    diff = mean_rollout - mean_train
    seq_sums = np.clip([r.sum() for r in lr], -20, 20)
    return {
        "training_ppl": float(np.exp(-mean_train).mean()),
        "training_log_ppl": float((-mean_train).mean()),
        "kl": tmean([b - a for a, b in zip(tr, ro, strict=True)]),
        "k3_kl": tmean([np.exp(r) - r - 1 for r in lr]),
        "rollout_ppl": float(np.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(np.abs(diff).mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(np.exp(diff).mean()),
        "chi2_token": tmean([np.exp(np.clip(r, -20, 20)) ** 2 for r in lr]) - 1.0,
        "chi2_seq": float(np.exp(2.0 * seq_sums).mean() - 1.0),
    }


def ref_is(train, rollout, mask, level: str, upper: float, lower: float | None,
           normalize: bool = False) -> dict[str, float]:
    lr = [a - b for a, b in zip(rows(train, mask), rows(rollout, mask), strict=True)]
    low = 1.0 / upper if lower is None else lower
    sums = [float(r.sum()) for r in lr]
    if level == "token":
        raw = [np.exp(np.clip(r, -20, 20)) for r in lr]
    else:
        raw = [np.full(r.size, math.exp(min(max(s, -20), 20))) for r, s in zip(lr, sums,
                                                                               strict=True)]
    if lower is None:
        applied = [np.minimum(r, upper) for r in raw]
    else:
        applied = [np.where((r >= lower) & (r <= upper), r, 0.0) for r in raw]
    w, rw = np.concatenate(applied), np.concatenate(raw)
    n = w.size
    out: dict[str, float] = {"rollout_is_mean": tmean(applied)}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(max(sums), 20.0))
        out["rollout_is_min"] = math.exp(min(sums))
        out["rollout_is_ratio_fraction_high"] = float(np.mean([s > math.log(upper) for s in sums]))
        out["rollout_is_ratio_fraction_low"] = float(np.mean([s < math.log(low) for s in sums]))
    else:
        out["rollout_is_max"] = float(w.max())
        out["rollout_is_min"] = float(w.min())
        out["rollout_is_ratio_fraction_high"] = float((rw > upper).sum() / (n + EPS))
        out["rollout_is_ratio_fraction_low"] = float((rw < low).sum() / (n + EPS))
    c = np.clip(w, 0.0, upper)
    mc = c.sum() / (n + EPS)
    out["rollout_is_std"] = math.sqrt(max((c**2).sum() / (n + EPS) - mc**2, 0.0)) if n > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / (((c / (mc + 1e-8)) ** 2).sum() / (n + EPS))
    seq = rmean(applied)  # every row, the empty one included (mean 0)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std(ddof=1))
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float(np.abs(seq - 1.0).max())
    raw_seq = rmean(raw)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < low).mean())
    if lower is not None:
        out["rollout_is_oob_ratio"] = float(((rw < lower) | (rw > upper)).sum() / (n + EPS))
    if normalize:
        if level == "token":
            factor = tmean(applied)
        else:
            factor = float(np.mean([s for s, r in zip(rmean(applied), applied, strict=True)
                                    if r.size]))
        out["rollout_is_batch_norm_factor"] = factor
    return out


def ref_rs(train, rollout, mask, option: str, lo: float | None, hi: float) -> dict[str, float]:
    lr = [np.clip(a - b, -20, 20) for a, b in zip(rows(train, mask), rows(rollout, mask),
                                                  strict=True)]
    kind = option[-2:]
    level = option[:-3]
    k = [{"k1": -r, "k2": 0.5 * r**2, "k3": np.exp(r) - 1 - r}[kind] for r in lr]
    valid_rows = np.array([r.size > 0 for r in k])
    if level == "token":
        stat = k
        per_seq = rmean(k)
    else:
        if level == "seq_sum":
            per_seq = np.array([r.sum() for r in k])
        elif level == "seq_mean":
            per_seq = rmean(k)
        else:
            per_seq = np.array([r.max() if r.size else 0.0 for r in k])
        stat = [np.full(r.size, s) for r, s in zip(k, per_seq, strict=True)]
    has_lower = kind == "k1"
    upper = math.log(hi) if has_lower else hi
    lower = math.log(lo) if has_lower else 0.0
    keep = [((s >= lower) & (s <= upper)) if has_lower else (s <= upper) for s in stat]
    flat = np.concatenate(stat)
    n = flat.size
    seqs = per_seq[valid_rows]
    p = f"rollout_rs_{option}"
    out = {f"{p}_mean": tmean(stat)}
    if level == "token":
        out[f"{p}_max"], out[f"{p}_min"] = float(flat.max()), float(flat.min())
        out[f"{p}_fraction_high"] = float((flat > upper).sum() / (n + EPS))
        out[f"{p}_fraction_low"] = float((flat < lower).sum() / (n + EPS)) if has_lower else 0.0
    else:
        out[f"{p}_max"], out[f"{p}_min"] = float(seqs.max()), float(seqs.min())
        out[f"{p}_fraction_high"] = float((seqs > upper).mean())
        out[f"{p}_fraction_low"] = float((seqs < lower).mean()) if has_lower else 0.0
    c = np.clip(flat, lower if has_lower else 0.0, upper)
    mc = c.sum() / (n + EPS)
    out[f"{p}_std"] = math.sqrt(max((c**2).sum() / (n + EPS) - mc**2, 0.0))
    out[f"{p}_seq_mean"] = float(seqs.mean())
    out[f"{p}_seq_std"] = float(seqs.std(ddof=1))
    out[f"{p}_seq_max"] = float(seqs.max())
    out[f"{p}_seq_min"] = float(seqs.min())
    out[f"{p}_seq_max_deviation"] = float(np.abs(seqs).max())
    out[f"{p}_seq_fraction_high"] = float((seqs > upper).mean())
    if has_lower:
        out[f"{p}_seq_fraction_low"] = float((seqs < lower).mean())
    rejected = np.concatenate([~kp for kp in keep])
    out[f"{p}_masked_fraction"] = float(rejected.sum() / (n + EPS))
    hit = np.array([bool((~kp).any()) for kp in keep])
    out[f"{p}_seq_masked_fraction"] = float(hit[valid_rows].sum() / valid_rows.sum())
    out["rollout_rs_masked_fraction"] = out[f"{p}_masked_fraction"]
    out["rollout_rs_seq_masked_fraction"] = float(hit.mean())  # over every row (verl)
    return out


def assert_metrics(ours: dict[str, float], ref: dict[str, float], prefix: str = "") -> None:
    """Every reference value, to float64 precision; fractions to float32's, as verl takes the
    mean of `bool.float()` (float32) for its per-sequence fractions."""
    for key, value in ref.items():
        got = float(ours[prefix + key])
        assert math.isfinite(got), key
        tol = 1e-7 if "fraction" in key else 1e-12
        assert got == pytest.approx(value, rel=1e-9, abs=tol), key


# ------------------------------------------------------------------ decoupled (per batch)


def test_offpolicy_metrics_are_verls_with_nan_padding_and_an_empty_row():
    train, rollout, mask = batch()
    _, kept, metrics = rollout_correction(train, rollout, mask)
    assert set(metrics) == {"rollout_corr/" + k for k in OFFPOLICY_NAMES}
    assert torch.equal(kept, mask)
    assert_metrics(metrics, ref_offpolicy(train, rollout, mask), "rollout_corr/")


@pytest.mark.parametrize("level, spec, upper, lower, normalize", [
    ("token", 1.5, 1.5, None, False),
    ("token", "0.7_1.6", 1.6, 0.7, False),
    ("token", 2.0, 2.0, None, True),
    ("sequence", 3.0, 3.0, None, False),
    ("sequence", "0.5_4.0", 4.0, 0.5, False),
    ("sequence", 5.0, 5.0, None, True),
])
def test_is_metrics_are_verls(level, spec, upper, lower, normalize):
    train, rollout, mask = batch(spread=0.4 if level == "token" else 0.2)
    weights, metrics = is_weights(train - rollout, mask, level, spec, normalize)
    names = set(IS_NAMES)
    if lower is not None:
        names.add("rollout_is_oob_ratio")
    if normalize:
        names.add("rollout_is_batch_norm_factor")
    assert set(metrics) == names
    assert_metrics(metrics, ref_is(train, rollout, mask, level, upper, lower, normalize))
    assert not torch.isnan(weights).any() and float(weights[mask == 0].abs().sum()) == 0.0


@pytest.mark.parametrize("option, spec, lo, hi", [
    ("token_k1", "0.7_1.4", 0.7, 1.4),
    ("token_k2", 0.05, None, 0.05),
    ("token_k3", 0.05, None, 0.05),
    ("seq_sum_k1", "0.8_2.0", 0.8, 2.0),
    ("seq_sum_k2", 0.6, None, 0.6),
    ("seq_sum_k3", 0.6, None, 0.6),
    ("seq_mean_k1", "0.9_1.1", 0.9, 1.1),
    ("seq_mean_k2", 0.1, None, 0.1),
    ("seq_mean_k3", 0.1, None, 0.1),
    ("seq_max_k2", 0.3, None, 0.3),
    ("seq_max_k3", 0.4, None, 0.4),
])
def test_rejection_metrics_are_verls(option, spec, lo, hi):
    train, rollout, mask = batch()
    kept, metrics = rejection_mask(train - rollout, mask, option, spec)
    assert set(metrics) == rs_names(option) | RS_GLOBAL
    assert_metrics(metrics, ref_rs(train, rollout, mask, option, lo, hi))
    assert 0 < float(kept.sum()) < float(mask.sum())  # the case keeps some tokens, drops some


def test_every_mode_reports_verls_names_in_one_call():
    train, rollout, mask = batch()
    _, _, metrics = rollout_correction(
        train, rollout, mask, rollout_is="sequence", rollout_is_threshold="0.5_4.0",
        rollout_is_batch_normalize=True, rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="0.7_1.4,0.1")
    expected = (IS_NAMES | {"rollout_is_oob_ratio", "rollout_is_batch_norm_factor"}
                | rs_names("token_k1") | rs_names("seq_max_k3") | RS_GLOBAL | OFFPOLICY_NAMES)
    assert set(metrics) == {"rollout_corr/" + k for k in expected}
    assert all(math.isfinite(v) for v in metrics.values())
    # the off-policy metrics use the mask before rejection (verl)
    assert_metrics(metrics, ref_offpolicy(train, rollout, mask), "rollout_corr/")


def test_effective_sample_size_when_icepop_zeroes_every_weight():
    """Every ratio outside the band: verl's 1 / 0 raises ZeroDivisionError; reported as 0."""
    train, rollout, mask = batch(nan_padding=False)
    _, metrics = is_weights(train - rollout + 5.0, mask, "token", "0.5_2.0")
    assert metrics["rollout_is_eff_sample_size"] == 0.0
    assert metrics["rollout_is_oob_ratio"] == pytest.approx(1.0)


def test_one_valid_token_gives_zero_stds():
    train, rollout, _ = batch(nan_padding=False)
    mask = torch.zeros(B, T, dtype=F64)
    mask[2, 3] = 1
    _, metrics = is_weights(train - rollout, mask, "token", 2.0)
    assert metrics["rollout_is_std"] == 0.0
    assert metrics["rollout_is_seq_std"] > 0  # over the 5 rows, 4 of them empty (verl)
    _, rs = rejection_mask(train - rollout, mask, "token_k3", 0.1)
    assert rs["rollout_rs_token_k3_std"] == 0.0 and rs["rollout_rs_token_k3_seq_std"] == 0.0


# ------------------------------------------------------------------ bypass mode (in the loss)


@pytest.mark.parametrize("settings, names", [
    (LossSettings(), OFFPOLICY_NAMES),  # verl reports the off-policy gap even without IS / RS
    (LossSettings(bypass_loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5,
                  rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
     OFFPOLICY_NAMES | IS_NAMES | rs_names("token_k1") | RS_GLOBAL),
    (LossSettings(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="seq_mean_k3",
                  rollout_rs_threshold=0.05),
     OFFPOLICY_NAMES | IS_NAMES | rs_names("seq_mean_k3") | RS_GLOBAL),
], ids=["ppo_clip-metrics-only", "reinforce-token-is-token-k1", "ppo_clip-seq-is-seq-mean-k3"])
def test_bypass_mode_reports_verls_metrics_from_the_current_log_probs(settings, names):
    current, rollout, mask = batch(spread=0.3, nan_padding=False)
    adv = torch.linspace(-1, 1, B, dtype=F64).unsqueeze(-1).expand(B, T).clone()
    logp = current.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss("bypass_mode", logp, rollout, adv, mask, settings)
    corr = {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    assert set(corr) == {"rollout_corr/" + k for k in names}
    assert_metrics(corr, ref_offpolicy(current, rollout, mask), "rollout_corr/")
    if settings.rollout_is is not None:
        upper = float(settings.rollout_is_threshold)
        assert_metrics(corr, ref_is(current, rollout, mask, settings.rollout_is, upper, None),
                       "rollout_corr/")
    if settings.rollout_rs is not None:
        spec = settings.rollout_rs_threshold
        lo, hi = ((float(x) for x in str(spec).split("_")) if "_" in str(spec)
                  else (None, float(spec)))
        assert_metrics(corr, ref_rs(current, rollout, mask, settings.rollout_rs, lo, hi),
                       "rollout_corr/")
    loss.backward()  # the metrics are computed without a graph; the loss still has one
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_bypass_mode_with_an_empty_micro_batch_reports_nothing():
    current, rollout, mask = batch(nan_padding=False)
    adv = torch.ones(B, T, dtype=F64)
    s = LossSettings(rollout_is="token", rollout_rs="token_k3", rollout_rs_threshold=0.1)
    _, metrics = compute_policy_loss("bypass_mode", current, rollout, adv, torch.zeros_like(mask),
                                     s)
    assert not any(k.startswith("rollout_corr/") for k in metrics)


# ------------------------------------------------------------------ the learner's batch step


def sample(seed: int, all_masked: bool = False) -> Sample:
    rng = np.random.default_rng(seed)
    length, prompt = 10, 3
    mask = np.ones(length)
    mask[:prompt] = 0
    mask[6:8] = 0
    if all_masked:  # e.g. a truncated completion under mask_truncated_completions
        mask[:] = 0
    s = Sample(rng.integers(5, 50, length), mask, prompt_len=prompt, uid="g")
    s.set_field("rollout_logprobs", -rng.random(length).astype(np.float32) - 0.05)
    s.set_field("old_logprobs", s.fields["rollout_logprobs"]
                + rng.normal(0, 0.3, length).astype(np.float32))
    return s


def test_apply_rollout_correction_reports_verls_names_and_values():
    samples = [sample(0), sample(1), sample(2, all_masked=True), sample(3)]
    before = [s.loss_mask.copy() for s in samples]
    options = AlgorithmSettings(rollout_is="token", rollout_is_threshold=2.0,
                                rollout_rs="seq_sum_k1", rollout_rs_threshold="0.8_1.25")
    metrics = apply_rollout_correction(samples, options)
    expected = OFFPOLICY_NAMES | IS_NAMES | rs_names("seq_sum_k1") | RS_GLOBAL
    assert set(metrics) == {"rollout_corr/" + k for k in expected}
    old = torch.stack([torch.from_numpy(s.fields["old_logprobs"][3:].astype(np.float64))
                       for s in samples])
    rollout = torch.stack([torch.from_numpy(s.fields["rollout_logprobs"][3:].astype(np.float64))
                           for s in samples])
    mask = torch.stack([torch.from_numpy((m[3:] > 0).astype(np.float64)) for m in before])
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    # the batch step runs in float32: compare at float32 precision
    for ref in (ref_offpolicy(old, rollout, mask), ref_is(old, rollout, mask, "token", 2.0, None),
                ref_rs(old, rollout, mask, "seq_sum_k1", 0.8, 1.25)):
        for key, value in ref.items():
            assert metrics["rollout_corr/" + key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
