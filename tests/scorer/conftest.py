"""Fixtures for the scorer tests: a real (tiny) Hugging Face tokenizer and trajectory builder."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

TAGS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
        "<information>", "</information>"]


def build_tokenizer(out_dir: Path) -> Path:
    """Byte-level BPE (any text round-trips) with the Search-R1 tags as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The answer is Paris. Thus the final answer"] * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 pad_token="<|endoftext|>")
    hf.add_tokens(TAGS)
    hf.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("scorer_tokenizer"))


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
