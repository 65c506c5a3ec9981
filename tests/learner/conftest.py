"""Fixtures of the learner tests: the tiny test policy (built once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def tiny_policy(tiny_policy_dir: Path) -> Path:
    """The session's tiny policy (tests/conftest.py); learner tests only read it."""
    return tiny_policy_dir


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture()
def samples_factory():
    """`make_samples` (importlib mode cannot import conftest from a test module)."""
    return make_samples


def make_samples(n: int = 6, seed: int = 0, vocab: int = 400, with_rl: bool = False):
    """Variable-length sequences with a prompt, policy spans and an observation span."""
    from services.learner.packing import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(24, 80))
        ids = rng.integers(5, vocab, length)
        mask = np.ones(length)
        mask[:8] = 0  # prompt
        mask[16:22] = 0  # an observation inside the response
        mask[-3:] = 0  # a trailing observation
        sample = Sample(ids, mask, prompt_len=8, uid=f"g{i // 2}")
        if with_rl:
            resp = length - 8
            sample.set_response_field("advantages", np.full(resp, 1.0 if i % 2 else -1.0))
        samples.append(sample)
    return samples
