"""Every shipped config's learner.algorithm block validates against the algorithms package
(load_config leaves that dict free-form), with an estimator the loop can run; and the demo
overrides of issue 18's comparison run (CISPO) validate too."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import load_config
from services.learner.algorithms import AlgorithmSettings
from services.learner.rl_batch import check_estimator

REPO = Path(__file__).resolve().parents[2]
CISPO = ["learner.algorithm.policy_loss=cispo", "learner.algorithm.clip_ratio_low=10"]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_algorithm_blocks_validate(path):
    cfg = load_config(path, environ={})
    settings = AlgorithmSettings.model_validate(dict(cfg.learner.algorithm))
    check_estimator(cfg.learner.adv_estimator, settings, cfg.data.n_samples)


def test_demo_cispo_overrides_validate():
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides=CISPO, environ={})
    settings = AlgorithmSettings.model_validate(dict(cfg.learner.algorithm))
    assert settings.effective_policy_loss == "cispo"
    assert settings.tis_cap == 2.0 and not settings.rollout_correction_needs_batch
    loss = settings.loss_settings()
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (10.0, 0.28)  # verl's CISPO example
