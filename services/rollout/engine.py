"""The engine interface every backend implements: token ids in, token ids + log-probs out.

The agent loop drives an engine step by step (`add_request`, `step`) rather than through one
blocking `generate` call, so that a trajectory whose turn just finished can leave, wait for the
retriever, and come back while the others keep decoding (continuous batching, docs/architecture.md).
`generate` is the blocking convenience on top of the same two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# "aborted" and "error": the engine ended the request without a policy answer (vLLM rejected
# or aborted it); `GenerationOutput.extra["error"]` says why, and the agent loop ends that
# trajectory with finish_reason "error" rather than reading the partial text as an answer.
FinishCause = Literal["stop", "eos", "length", "aborted", "error"]


GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 (or below 1e-5) means greedy (evaluation)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 256
    stop: Sequence[str] = ()
    # Token ids that end the request as EOS does (finish "eos"), beside the model's own EOS:
    # a chat template's end of turn that is not the tokenizer's EOS (<|im_end|> with a base
    # model's tokenizer). vLLM matches stop strings on text decoded without special tokens,
    # where such a token never shows, so it must be stopped on by id.
    stop_token_ids: Sequence[int] = ()
    # Ignore EOS (used by benchmarks that must produce an exact number of tokens).
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflows to inf and the softmax to
        # NaN; vLLM treats such temperatures as greedy too (its _SAMPLING_EPS, 1e-5).
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    # Opaque to the engine; the caller uses it to route the output back.
    tag: Any = None
    request_id: int = -1
    # Multi-turn: requests that share a cache_key continue one another (the next turn's prompt
    # extends the previous turn's prompt + output), so an engine may keep the finished turn's
    # KV cache and prefill only the new tokens. Engines check the token prefix before reuse.
    cache_key: Any = None


@dataclass
class GenerationOutput:
    request: GenerationRequest
    token_ids: list[int]
    # Log-prob of each sampled token under the distribution it was sampled from (temperature,
    # top-k and top-p applied; the raw distribution in greedy mode).
    logprobs: list[float]
    finish: FinishCause
    stop_string: str | None = None
    # Oldest and newest policy version whose weights produced these tokens (they differ only
    # when `load_weights` ran while this request was decoding).
    version_start: int = 0
    version_end: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> Any:
        return self.request.tag


# A test/benchmark hook: given a request when it is admitted, return the token ids the engine
# must emit for it (it still runs the model on them and reports their log-probs), or None.
ForcedTokens = Callable[[GenerationRequest], Sequence[int] | None]


class Engine(Protocol):
    tokenizer: Any
    policy_version: int
    max_batch_size: int
    forced_tokens: ForcedTokens | None

    def add_request(self, request: GenerationRequest) -> None: ...

    def step(self) -> list[GenerationOutput]:
        """Advance every running request by one token (admitting waiting ones into free slots
        first); return the requests that finished in this step."""
        ...

    def has_unfinished(self) -> bool: ...

    def num_running(self) -> int: ...

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None: ...

    def release(self, cache_key: Any) -> None:
        """Forget any KV kept for `cache_key` (its trajectory is finished)."""
        ...

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]: ...


def run_to_completion(engine: Engine, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
    """Blocking generate over the step API; outputs in request order."""
    requests = list(requests)
    for index, request in enumerate(requests):
        request.request_id = index
        engine.add_request(request)
    outputs: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request.request_id] = output
    return [outputs[index] for index in range(len(requests))]


def stop_trigger_ids(tokenizer: Any, stops: Iterable[str]) -> frozenset[int] | None:
    """Token ids whose text contains the last character of some stop string.

    A stop string can only appear in the decoded new text at the step whose token supplies its
    final character, so the engine decodes (costly per token) only after such tokens. Returns
    None when the vocabulary cannot be scanned, meaning: check after every token.
    """
    finals = {stop[-1] for stop in stops if stop}
    if not finals:
        return frozenset()
    try:
        size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - any tokenizer oddity: fall back to checking always
        return None
    return frozenset(i for i, text in enumerate(texts) if any(ch in text for ch in finals))
