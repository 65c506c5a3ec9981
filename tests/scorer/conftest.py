"""Fixtures for the scorer tests: the tiny policy's real tokenizer and a trajectory builder."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_policy_dir) -> Path:
    """The project's own test tokenizer (byte-level BPE, Search-R1 tags as single tokens)."""
    return tiny_policy_dir


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _make_trajectory(tokenizer, data_source: str, response: str, ground_truth, *,
                    probe=None, kind: str = "train", uid: str | None = None):
    from services.common.trajectory import Trajectory

    ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    uid = uid or uuid.uuid4().hex[:8]
    return Trajectory(
        uid=uid, sample_id=f"{uid}:0:0", data_source=data_source, policy_version=3,
        prompt_ids=np.arange(5), response_ids=ids, loss_mask=np.ones(len(ids)),
        rollout_logprobs=np.zeros(len(ids)), ground_truth=ground_truth, probe=probe, kind=kind,
    )


@pytest.fixture(scope="session")
def make_trajectory(tokenizer):
    """make_trajectory(data_source, response_text, ground_truth, probe=..., kind=...)."""
    return lambda *args, **kwargs: _make_trajectory(tokenizer, *args, **kwargs)
