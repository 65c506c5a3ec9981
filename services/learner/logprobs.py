"""Per-token log-probabilities from one forward pass over a packed micro-batch.

Why logsumexp + gather instead of log_softmax: a log_softmax materialises a second (N, vocab)
tensor; with a 150k vocabulary that doubles the learner's peak memory for no gain. Why divide by
the temperature: the behaviour policy sampled from softmax(logits / T), and the importance
ratios and KL are only meaningful against the same distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.learner.attention import forward_kwargs
from services.learner.packing import MicroBatch


def forward_logits(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Logits (1, N, V) for a packed row: position ids restart per sequence, and what the
    model's attention kernel needs to keep the sequences apart (attention.forward_kwargs; for
    SDPA nothing on a plain row, transformers builds the block-diagonal mask from the position
    ids, and a shared row's own mask, packing.py). The kernel is the one the model was loaded
    with (its config's `_attn_implementation`)."""
    config = getattr(model, "config", None) or model.module.config
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                **forward_kwargs(config._attn_implementation, mb))
    return out.logits


class KeptLogits(NamedTuple):
    """A forward that computed logits only at `positions` of a row of `length` tokens
    (transformers' `logits_to_keep` with an index tensor): the positions whose logits predict a
    loss token (`MicroBatch.logit_positions`). Why: a loss reads log-probs of its loss tokens
    only, and on a search trajectory most of a row is prompt and retrieved text. The output
    layer and the (N, vocab) log-softmax are a large part of a small model's step (SmolLM2-135M:
    a 49k x 576 head, a fifth of its weights), and (N, vocab) float32 logits dominate its peak
    memory; both now scale with the loss tokens. The values at those positions are the ones a
    full forward gives (tests/learner/test_kept_logits.py)."""

    positions: torch.Tensor  # (K,) int64, ascending
    length: int  # N, the row's token count


def _predicting(logits: torch.Tensor, temperature: float,
                kept: KeptLogits | None) -> torch.Tensor:
    """The float32 logits / T that predict tokens: every position but the last of a full
    forward, or all of a kept forward's (which hold only predicting positions)."""
    shifted = (logits[:, :-1] if kept is None else logits).float()
    return shifted / temperature if temperature != 1.0 else shifted


def _aligned(values: torch.Tensor, kept: KeptLogits | None) -> torch.Tensor:
    """(1, N) with the value of the distribution that predicted token p at p, 0 at position 0
    and, for a kept forward, wherever no logits were computed (never a loss token)."""
    if kept is None:
        return torch.nn.functional.pad(values, (1, 0), value=0.0)
    index = (kept.positions + 1).unsqueeze(0)
    return values.new_zeros(1, kept.length).scatter(1, index, values)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
    kept: KeptLogits | None = None,
) -> torch.Tensor:
    """(1, N) log p(token p | tokens < p); position 0 gets 0 (nothing predicts it).

    At a sequence boundary inside a packed row the value is meaningless (the previous sequence's
    last logits), but the first token of every sequence has loss mask 0, so it is never used.
    With `kept`, `logits` is (1, K, V) at `kept.positions` and other positions get 0.
    """
    shifted = _predicting(logits, temperature, kept)
    targets = input_ids[:, 1:] if kept is None else input_ids[:, kept.positions + 1]
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return _aligned(picked - torch.logsumexp(shifted, dim=-1), kept)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0,
                  kept: KeptLogits | None = None) -> torch.Tensor:
    """(1, N) entropy of the distribution that predicted token p (aligned like token_logprobs)."""
    shifted = _predicting(logits, temperature, kept)
    lse = torch.logsumexp(shifted, dim=-1)
    ent = lse - (torch.softmax(shifted, dim=-1) * shifted).sum(-1)
    return _aligned(ent, kept)


def token_sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0,
                         kept: KeptLogits | None = None) -> torch.Tensor:
    """(1, N) sum over the vocabulary of p^2 for the distribution that predicted token p
    (aligned like token_logprobs; position 0 gets 0): exp(lse(2 z) - 2 lse(z)) of z = logits / T
    (verl's calculate_sum_pi_squared_from_logits)."""
    shifted = _predicting(logits, temperature, kept)
    value = torch.exp(torch.logsumexp(2.0 * shifted, dim=-1)
                      - 2.0 * torch.logsumexp(shifted, dim=-1))
    return _aligned(value, kept)


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do; a
    custom class may not, and then the learner computes every position's logits)."""
    import inspect

    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def token_values(value_logits: torch.Tensor) -> torch.Tensor:
    """(1, N) critic values aligned with tokens: V for token p is read at position p - 1 (the
    state from which token p is generated), as verl's critic does."""
    values = value_logits[..., 0].float() if value_logits.dim() == 3 else value_logits.float()
    return torch.nn.functional.pad(values[:, :-1], (1, 0), value=0.0)
