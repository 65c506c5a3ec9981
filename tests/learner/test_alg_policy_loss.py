"""Policy loss, aggregation and their gradients w.r.t. log-probs (reference/algorithms.md 2, 4, 6)."""

from __future__ import annotations

import math

import pytest
import torch

from services.learner.algorithms import agg_loss, entropy_from_logits, policy_loss

F64 = torch.float64


def val(t) -> float:
    return float(t.detach()) if isinstance(t, torch.Tensor) else float(t)


# One row, five tokens, each case of the clipped surrogate (eps 0.2, dual clip c = 3):
#   rho 1.5, A +1: clipped high   -> -1.2 (no gradient)
#   rho 0.5, A +1: unclipped      -> -0.5
#   rho 1.1, A -1: inside         ->  1.1
#   rho 0.7, A -1: clipped low    ->  0.8 (no gradient)
#   rho 4.0, A -1: dual clip      ->  3.0 (no gradient)
RATIOS = [1.5, 0.5, 1.1, 0.7, 4.0]
ADVS = [1.0, 1.0, -1.0, -1.0, -1.0]


def toy(ratios=RATIOS, advs=ADVS):
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0]], dtype=F64)[:, : len(ratios)]
    logp = (old + torch.log(torch.tensor([ratios], dtype=F64))).requires_grad_(True)
    adv = torch.tensor([advs], dtype=F64)
    mask = torch.ones_like(adv)
    return logp, old, adv, mask


def test_ppo_clip_dual_clip_values_and_metrics():
    logp, old, adv, mask = toy()
    loss, metrics = policy_loss(logp, old, adv, mask)
    assert val(loss) == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    assert val(metrics["clipfrac_high"]) == pytest.approx(1 / 5)
    assert val(metrics["clipfrac_low"]) == pytest.approx(1 / 5)
    assert val(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 5)  # the dual clip
    assert val(metrics["pg_clipfrac"]) == pytest.approx(2 / 5)
    assert val(metrics["ppo_kl"]) == pytest.approx(-sum(map(math.log, RATIOS)) / 5)
    assert all(not v.requires_grad for v in metrics.values())


def test_gradient_wrt_log_probs_hand_values():
    logp, old, adv, mask = toy()
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    # d(-A rho)/d logp = -A rho on unclipped tokens, 0 where a clip is active; token-mean / 5.
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 5, 1.1 / 5, 0.0, 0.0])


def test_gradcheck_away_from_kinks():
    logp, old, adv, mask = toy()

    def fn(x):
        return policy_loss(x, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(fn, (logp.detach().clone().requires_grad_(True),))


def test_trl_variant_no_dual_clip_no_clamp():
    logp, old, adv, mask = toy()
    loss, metrics = policy_loss(logp, old, adv, mask, clip_ratio_c=None, log_ratio_clamp=None)
    assert val(loss) == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 4.0) / 5)
    assert val(metrics["pg_clipfrac_lower"]) == 0.0
    # TRL's delta (ratio cap) equals the dual clip with c = delta at the token level
    capped, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0, log_ratio_clamp=None)
    assert val(capped) == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    delta, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=None, delta=3.0,
                           log_ratio_clamp=None)
    assert val(delta) == pytest.approx(val(capped))


def test_clip_higher_separate_epsilons():
    logp, old, adv, mask = toy([1.25, 0.75], [1.0, -1.0])
    loss, metrics = policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # 1.25 < 1.28: not clipped -> -1.25; 0.75 < 0.8 with A<0: clipped low -> 0.8
    assert val(loss) == pytest.approx((-1.25 + 0.8) / 2)
    assert val(metrics["clipfrac_high"]) == 0.0
    assert val(metrics["clipfrac_low"]) == pytest.approx(0.5)


def test_log_ratio_clamp():
    old = torch.zeros(1, 1, dtype=F64)
    logp = torch.full((1, 1), 25.0, dtype=F64)
    adv = -torch.ones(1, 1, dtype=F64)
    mask = torch.ones(1, 1, dtype=F64)
    clamped, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=None)
    assert val(clamped) == pytest.approx(math.exp(20.0))
    free, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=None, log_ratio_clamp=None)
    assert val(free) == pytest.approx(math.exp(25.0))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=1.0)


def test_gspo_sequence_ratio_value_and_gradient_match_trl_sequence_level():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], dtype=F64)
    delta = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=F64)
    logp = (old + delta).requires_grad_(True)
    loss, _ = policy_loss(
        logp, old, adv, mask, ratio_kind="sequence", loss_agg_mode="seq-mean-token-mean"
    )
    s1 = math.exp(-0.05)  # row 1's geometric-mean ratio; row 0's exp(0.2) > 1.2 is clipped
    assert val(loss) == pytest.approx((-1.2 + s1) / 2)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, s1 / 4, s1 / 4, 0.0])
    # TRL: per-token loss -min(s A, clip(s) A) with s differentiable through the mean log-ratio
    for mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum"):
        x = (old + delta).requires_grad_(True)
        ours, _ = policy_loss(x, old, adv, mask, ratio_kind="sequence", loss_agg_mode=mode)
        ours.backward()
        y = (old + delta).requires_grad_(True)
        s = torch.exp(((y - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        trl = -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv).expand_as(adv)
        agg_loss(trl, mask, mode).backward()
        assert torch.allclose(x.grad, y.grad, atol=1e-12)


def test_rollout_is_weights_multiply_each_token_as_constants():
    logp, old, adv, mask = toy([1.0, 1.0], [1.0, 1.0])
    weights = torch.tensor([[2.0, 0.5]], dtype=F64, requires_grad=True)  # e.g. truncated IS
    loss, _ = policy_loss(logp, old, adv, mask, rollout_is_weights=weights)
    assert val(loss) == pytest.approx((-1.0 * 2.0 - 1.0 * 0.5) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])
    assert weights.grad is None  # detached: the weights change the measure, not the objective


LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # the last row is empty


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),
        ("token-sum", 7.0),
    ],
)
def test_agg_loss_modes(mode, expected):
    loss = torch.tensor(LOSS, dtype=F64)
    mask = torch.tensor(MASK, dtype=F64)
    assert val(agg_loss(loss, mask, mode)) == pytest.approx(expected)


def test_agg_loss_sum_norm_uses_max_response_len():
    loss, mask = torch.tensor(LOSS, dtype=F64), torch.tensor(MASK, dtype=F64)
    assert val(
        agg_loss(loss, mask, "seq-mean-token-sum-norm", max_response_len=10)
    ) == pytest.approx(0.35)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_agg_loss_global_counts_make_micro_batch_shares_exact(mode):
    loss, mask = torch.tensor(LOSS, dtype=F64), torch.tensor(MASK, dtype=F64)
    whole = agg_loss(loss, mask, mode, max_response_len=3)
    shares = sum(
        agg_loss(
            loss[i : i + 1],
            mask[i : i + 1],
            mode,
            global_token_count=mask.sum(),
            global_seq_count=2,
            max_response_len=3,
        )
        for i in range(3)
    )
    assert val(shares) == pytest.approx(val(whole))


def test_agg_loss_empty_mask_is_zero_and_bad_mode_raises():
    loss = torch.ones(2, 3, dtype=F64)
    mask = torch.zeros(2, 3, dtype=F64)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert val(agg_loss(loss, mask, mode)) == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        agg_loss(loss, mask, "mean")


def test_masked_tokens_get_zero_gradient():
    logp, old, adv, _ = toy()
    mask = torch.tensor([[1, 0, 1, 0, 1]], dtype=F64)
    loss, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=None)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 2] == pytest.approx(1.1 / 3)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]], dtype=F64)
    h = entropy_from_logits(logits)
    assert h[0] == pytest.approx(math.log(2))
    assert h[1] == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
