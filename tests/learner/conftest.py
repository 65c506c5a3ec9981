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


@pytest.fixture()
def group_samples_factory():
    """`make_group_samples` (importlib mode cannot import conftest from a test module)."""
    return make_group_samples


@pytest.fixture()
def sft_rows():
    """`born_in_rows` (importlib mode cannot import conftest from a test module)."""
    return born_in_rows


ANSWER_TURN = "<think> {city} </think>\n<answer> {city} </answer>"


def born_in_rows(count: int, offset: int = 0, answer_turn: str = ANSWER_TURN) -> list[dict]:
    """SFT rows (prompt + segments) of a toy "Where was X born?" world: search the name, read the
    city from the observation, answer with `answer_turn` (formatted with the city)."""
    names = ["Brixol", "Tamra", "Velden", "Osric"]
    cities = ["Corvale", "Dunmore", "Ashby", "Pellam"]
    rows = []
    for i in range(offset, offset + count):
        name, city = names[i % 4], cities[(3 * i) % 4]
        rows.append({
            "prompt": [{"role": "user", "content": f"Where was {name} born?"}],
            "segments": [
                {"text": f"<think> find {name} </think>\n<search> {name} </search>",
                 "trainable": True},
                {"text": f"\n\n<information>Doc 1(Title: \"{name}\") {name} was born in "
                         f"{city}.</information>\n\n", "trainable": False},
                {"text": answer_turn.format(city=city), "trainable": True},
            ],
        })
    return rows


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


def make_group_samples(groups: int = 3, per_group: int = 4, seed: int = 0, vocab: int = 400,
                       with_rl: bool = False, lone: int = 1):
    """GRPO-shaped samples: `groups` prompts of 20-40 tokens, each repeated by `per_group`
    samples with their own responses (an observation span inside), then `lone` samples with a
    prompt of their own."""
    from services.learner.packing import Sample

    rng = np.random.default_rng(seed)
    samples = []
    shapes = [(g, per_group) for g in range(groups)] + [(groups + k, 1) for k in range(lone)]
    for group, count in shapes:
        prompt = rng.integers(5, vocab, int(rng.integers(20, 40)))
        for member in range(count):
            response = rng.integers(5, vocab, int(rng.integers(6, 30)))
            ids = np.concatenate([prompt, response])
            mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(response))])
            if len(response) > 12:
                mask[len(prompt) + 4 : len(prompt) + 8] = 0  # an observation
            sample = Sample(ids, mask, prompt_len=len(prompt), uid=f"g{group}")
            if with_rl:
                sample.set_response_field(
                    "advantages", np.full(len(response), 1.0 if member % 2 else -0.5))
            samples.append(sample)
    return samples
