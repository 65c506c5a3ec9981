"""Per-token log-probabilities from one forward pass over a packed micro-batch.

Why logsumexp + gather instead of log_softmax: a log_softmax materialises a second (N, vocab)
tensor; with a 150k vocabulary that doubles the learner's peak memory for no gain. Why divide by
the temperature: the behaviour policy sampled from softmax(logits / T), and the importance
ratios and KL are only meaningful against the same distribution.
"""

from __future__ import annotations

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


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(1, N) log p(token p | tokens < p); position 0 gets 0 (nothing predicts it).

    At a sequence boundary inside a packed row the value is meaningless (the previous sequence's
    last logits), but the first token of every sequence has loss mask 0, so it is never used.
    """
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = shifted.gather(-1, targets).squeeze(-1)
    logp = picked - torch.logsumexp(shifted, dim=-1)
    return torch.nn.functional.pad(logp, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(1, N) entropy of the distribution that predicted token p (aligned like token_logprobs)."""
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    lse = torch.logsumexp(shifted, dim=-1)
    ent = lse - (torch.softmax(shifted, dim=-1) * shifted).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def token_values(value_logits: torch.Tensor) -> torch.Tensor:
    """(1, N) critic values aligned with tokens: V for token p is read at position p - 1 (the
    state from which token p is generated), as verl's critic does."""
    values = value_logits[..., 0].float() if value_logits.dim() == 3 else value_logits.float()
    return torch.nn.functional.pad(values[:, :-1], (1, 0), value=0.0)
