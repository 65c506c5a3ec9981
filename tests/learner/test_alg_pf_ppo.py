"""Parity with verl 0.9.1's PF-PPO (`verl/trainer/ppo/core_algos.py`
`compute_pf_ppo_reweight_data`, called from `ray_trainer.compute_advantage`; read from the PyPI
wheel): the sampling weights of each `reweight_method` and the resampled indices, against
verl's formula written out here, drawn with the same seeded generator."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.learner.algorithms import (
    PF_PPO_METHODS,
    AlgorithmSettings,
    pf_ppo_resample,
    pf_ppo_weights,
)


def verl_compute_weights(scores, reweight_method, weight_pow):
    if reweight_method == "pow":
        weights = torch.pow(torch.abs(scores), weight_pow)
    elif reweight_method == "max_min":
        max_score = torch.max(scores)
        min_score = torch.min(scores)
        weights = torch.where((scores == max_score) | (scores == min_score), 1.0, 0.0)
    elif reweight_method == "max_random":
        max_score = torch.max(scores)
        weights = torch.where(scores == max_score, 0.4, 0.1)
    else:
        raise ValueError(reweight_method)
    return weights


def verl_sample_indices(token_level_scores, reweight_method, weight_pow, generator):
    scores = token_level_scores.sum(dim=-1)
    weights = verl_compute_weights(scores, reweight_method, weight_pow)
    weights = torch.clamp(weights + 1e-8, min=1e-8)
    batch_size = scores.shape[0]
    return torch.multinomial(weights, batch_size, replacement=True, generator=generator)


def token_level_scores(seed: int = 0, batch: int = 16, width: int = 6) -> torch.Tensor:
    """verl's layout: the outcome score on each row's last response token."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(-2, 3, (batch,), generator=g).float() * 0.5  # ties, zeros, negatives
    out = torch.zeros(batch, width)
    last = torch.randint(1, width, (batch,), generator=g)
    out[torch.arange(batch), last] = rewards
    return out


@pytest.mark.parametrize("method", PF_PPO_METHODS)
@pytest.mark.parametrize("weight_pow", [2.0, 1.0, 0.5, 3.0])
def test_weights_are_verls(method, weight_pow):
    scores = token_level_scores().sum(-1)
    assert torch.equal(pf_ppo_weights(scores, method, weight_pow),
                       verl_compute_weights(scores, method, weight_pow))


@pytest.mark.parametrize("method", PF_PPO_METHODS)
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_resampled_indices_are_verls(method, seed):
    tls = token_level_scores(seed)
    ours = pf_ppo_resample(tls.sum(-1), method, 2.0, torch.Generator().manual_seed(seed + 100))
    ref = verl_sample_indices(tls, method, 2.0, torch.Generator().manual_seed(seed + 100))
    assert ours.dtype == torch.int64 and ours.shape == (tls.shape[0],)
    assert torch.equal(ours, ref)
    # the same seed, the same draw
    again = pf_ppo_resample(tls.sum(-1), method, 2.0, torch.Generator().manual_seed(seed + 100))
    assert torch.equal(ours, again)


def test_resampling_follows_the_weights():
    scores = torch.tensor([0.0, 1.0, 0.5, -1.0, 0.25, 1.0])
    g = torch.Generator().manual_seed(0)
    # max_min: only the rows with the batch max (1.0) or min (-1.0) are (practically) drawn
    drawn = torch.cat([pf_ppo_resample(scores, "max_min", generator=g) for _ in range(200)])
    assert set(drawn.tolist()) <= {1, 3, 5}
    # pow 2: a zero score has weight 1e-8 (never drawn in practice); |-1| counts like 1
    drawn = torch.cat([pf_ppo_resample(scores, "pow", 2.0, generator=g) for _ in range(400)])
    counts = torch.bincount(drawn, minlength=6).float()
    assert counts[0] == 0
    assert counts[3] / counts[4] == pytest.approx(16.0, rel=0.35)  # 1 / 0.25**2
    # max_random: the max rows 4x as likely as each other row
    drawn = torch.cat([pf_ppo_resample(scores, "max_random", generator=g) for _ in range(400)])
    counts = torch.bincount(drawn, minlength=6).float()
    assert (counts[1] + counts[5]) / counts[[0, 2, 3, 4]].sum() == pytest.approx(2.0, rel=0.2)


def test_edge_cases():
    assert pf_ppo_resample(torch.zeros(0)).numel() == 0
    # all-equal scores under max_min: every row is both max and min, uniform draw
    assert pf_ppo_resample(torch.ones(4), "max_min",
                           generator=torch.Generator().manual_seed(0)).shape == (4,)
    # all-zero scores under pow: every weight is the 1e-8 floor, uniform draw (verl)
    assert pf_ppo_resample(torch.zeros(5), "pow").shape == (5,)
    with pytest.raises(ValueError, match="NaN"):
        pf_ppo_resample(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="pf_ppo_reweight_method"):
        pf_ppo_weights(torch.ones(3), "softmax")


def test_config_keys():
    s = AlgorithmSettings()
    assert not s.use_pf_ppo
    assert s.pf_ppo_options() == {"method": "pow", "weight_pow": 2.0}  # verl's defaults
    s = AlgorithmSettings(pf_ppo_reweight_method="max_random", pf_ppo_weight_pow=1.0)
    assert s.pf_ppo_options() == {"method": "max_random", "weight_pow": 1.0}
    with pytest.raises(ValidationError, match="pf_ppo_reweight_method"):
        AlgorithmSettings(pf_ppo_reweight_method="softmax")
    # verl applies it only with GAE: any other estimator is refused at start-up
    from services.learner.rl_batch import check_estimator

    on = AlgorithmSettings(use_pf_ppo=True)
    check_estimator("gae", on)
    with pytest.raises(ValueError, match="use_pf_ppo.*only with.*gae"):
        check_estimator("grpo", on)
    assert set(PF_PPO_METHODS) == set(
        AlgorithmSettings.model_fields["pf_ppo_reweight_method"].annotation.__args__)


def test_the_loops_draw_is_seeded_by_run_and_step():
    """pf_ppo_batch: the indices the loop trains on, the same for the same seed and step (a
    resumed step), another draw at another step, extremes favoured under max_min."""
    from services.learner.rl_batch import pf_ppo_batch

    options = AlgorithmSettings(use_pf_ppo=True, pf_ppo_reweight_method="max_min")
    rewards = [0.0, 0.2, 0.5, 1.0, 0.3, 0.2, 0.4, 0.1]
    first = pf_ppo_batch(rewards, options, seed=3, step=7)
    assert torch.equal(first, pf_ppo_batch(rewards, options, seed=3, step=7))
    assert len(first) == len(rewards)
    assert set(first.tolist()) <= {0, 3}  # max_min: only the batch's min and max have weight
    draws = {tuple(pf_ppo_batch(rewards, AlgorithmSettings(use_pf_ppo=True), 3, s).tolist())
             for s in range(5)}
    assert len(draws) > 1
