"""KL estimators, controllers, the reward penalty and the value loss (reference section 3)."""

from __future__ import annotations

import math

import pytest
import torch

from services.learner.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
    value_loss,
)

F64 = torch.float64


def pair(d: float):
    ref = torch.tensor([-1.5], dtype=F64)
    return (ref + d).requires_grad_(True), ref


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", 0.5),
        ("kl", 0.5),
        ("abs", 0.5),
        ("k2", 0.125),
        ("mse", 0.125),
        ("k3", math.exp(-0.5) + 0.5 - 1),
        ("low_var_kl", math.exp(-0.5) + 0.5 - 1),
    ],
)
def test_kl_estimators_hand_values(kind, expected):
    logp, ref = pair(0.5)
    assert float(kl_penalty(logp, ref, kind).detach()) == pytest.approx(expected)


def test_k1_abs_sign():
    logp, ref = pair(-0.5)
    assert float(kl_penalty(logp, ref, "k1").detach()) == -0.5
    assert float(kl_penalty(logp, ref, "abs").detach()) == 0.5


def test_k3_clamp_verl_versus_trl():
    logp, ref = pair(-30.0)  # far below the reference: e^{30} - 31 unclamped
    assert float(kl_penalty(logp, ref, "k3").detach()) == 10.0  # verl: clamp to +-10
    free = float(kl_penalty(logp, ref, "k3", clamp=False).detach())
    assert free == pytest.approx(math.exp(30.0) - 31.0)


def test_k3_gradient_and_plus_variant_straight_through():
    logp, ref = pair(0.5)
    kl_penalty(logp, ref, "k3").backward()
    assert float(logp.grad) == pytest.approx(1 - math.exp(-0.5))  # d/dd (e^{-d} + d - 1)
    logp, ref = pair(0.5)
    value = kl_penalty(logp, ref, "k3+")
    assert float(value.detach()) == pytest.approx(math.exp(-0.5) - 0.5)
    value.backward()
    assert float(logp.grad) == pytest.approx(0.5)  # gradient of k2 = d


def test_kl_unknown_kinds():
    logp, ref = pair(0.5)
    with pytest.raises(NotImplementedError):
        kl_penalty(logp, ref, "full")
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty(logp, ref, "k4")


def test_adaptive_controller_proportional_update_and_state():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.2, n_steps=10)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert ctrl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 10 / 100))
    other = AdaptiveKLController(0.5, 0.1, 100)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == ctrl.value
    fixed = FixedKLController(0.3)
    fixed.update(5.0, 10)
    assert fixed.value == 0.3
    assert isinstance(make_kl_controller("adaptive", 0.1, 0.1, 10), AdaptiveKLController)
    with pytest.raises(ValueError):
        make_kl_controller("pid")


def test_apply_kl_penalty_uses_coef_before_update():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    ref = torch.zeros_like(scores)
    logp = torch.tensor([[0.2, -0.1, 0.3], [0.4, 0.4, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    ctrl = AdaptiveKLController(0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, ctrl, "kl")
    expected = [[-0.1, 0.05, 1.0], [-0.2, 1.8, 0.0]]
    assert torch.allclose(rewards, torch.tensor(expected, dtype=F64))
    current = ((0.2 - 0.1) / 2 + 0.8 / 2) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # error clipped, n_steps = 2


def test_value_loss_clipping():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    values = torch.tensor([[0.8, 0.5, 1.0]], dtype=F64)
    returns = torch.tensor([[1.5, 0.0, 0.0]], dtype=F64)
    mask = torch.ones_like(values)
    loss, metrics = value_loss(vpreds, values, returns, mask, 0.5, "token-mean")
    # token 0: both 0.25; token 1: max(4, (1 - 0)^2) = 4; token 2: max(0, (0.5 - 0)^2) = 0.25
    assert float(loss.detach()) == pytest.approx(0.5 * (0.25 + 4.0 + 0.25) / 3)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(1 / 3)
    loss.backward()
    # token 2 takes the clipped branch (constant in vpreds): no gradient
    assert vpreds.grad[0].tolist() == pytest.approx([0.5 * 2 * (-0.5) / 3, 0.5 * 2 * 2 / 3, 0.0])
