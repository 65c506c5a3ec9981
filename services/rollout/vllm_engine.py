"""The vLLM engine (GPU nodes, the `gpu` extra) behind the same step interface.

Written against vLLM's documented Python API: `LLMEngine.from_engine_args(EngineArgs(...))`,
`add_request(request_id, TokensPrompt(prompt_token_ids=...), SamplingParams(...))`, `step()`
returning `RequestOutput`s, `SamplingParams(stop=..., logprobs=0, n=..., ignore_eos=...)`.
vLLM schedules with continuous batching and paged attention itself, so this class only maps
requests and outputs. Weights are updated in place between steps through `collective_rpc`, the
path vLLM's RLHF examples use (each worker's model `load_weights`); with
`logprobs_mode="processed_logprobs"` the reported log-probs are those of the distribution that
was sampled from (temperature/top-k/top-p applied), like the transformers engine's.

vllm is imported lazily so CPU installs never need it. The `forced_tokens` hook is not
supported here (tests that need scripted tokens run on the transformers engine).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.rollout.engine import (
    ForcedTokens,
    GenerationOutput,
    GenerationRequest,
    run_to_completion,
)


def _load_weights_on_worker(worker: Any, items: list[tuple[str, Any]]) -> None:
    """Runs inside each vLLM worker (collective_rpc): load HF-named tensors into the model."""
    model = worker.model_runner.model
    model.load_weights(weights=items)


class VLLMEngine:
    def __init__(self, llm_engine: Any, tokenizer: Any, max_batch_size: int,
                 policy_version: int = 0) -> None:
        self.llm_engine = llm_engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self.forced_tokens: ForcedTokens | None = None
        self.tokens_generated = 0
        self._requests: dict[str, tuple[GenerationRequest, int]] = {}
        self._next_id = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tokenizer_path: str | None = None,
        max_batch_size: int = 256,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.6,
        **engine_kwargs: Any,
    ) -> VLLMEngine:
        import inspect

        from vllm import EngineArgs, LLMEngine

        kwargs: dict[str, Any] = dict(
            model=path,
            tokenizer=tokenizer_path or path,
            seed=seed,
            dtype=dtype,
            max_num_seqs=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,  # multi-turn: later turns reuse the earlier KV
        )
        if "logprobs_mode" in inspect.signature(EngineArgs).parameters:
            kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(engine_kwargs)
        llm_engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        return cls(llm_engine, llm_engine.get_tokenizer(), max_batch_size)

    def add_request(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.forced_tokens is not None:
            raise NotImplementedError("forced_tokens is a transformers-engine test hook")
        if request.request_id < 0:
            request.request_id = self._next_id
            self._next_id += 1
        p = request.params
        params = SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_tokens,
            stop=list(p.stop) or None,
            include_stop_str_in_output=True,
            ignore_eos=p.ignore_eos,
            logprobs=0,  # the sampled token's own log-prob only
            detokenize=True,
        )
        key = f"r{request.request_id}-{self._next_id}"
        self._next_id += 1
        self._requests[key] = (request, self.policy_version)
        self.llm_engine.add_request(key, TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                    params)

    def step(self) -> list[GenerationOutput]:
        finished = []
        for result in self.llm_engine.step():
            if not result.finished:
                continue
            request, version_start = self._requests.pop(result.request_id)
            completion = result.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [
                float(entry[token].logprob) for entry, token in zip(completion.logprobs or [],
                                                                      token_ids, strict=False)
            ]
            stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
            if completion.finish_reason == "length":
                cause = "length"
            elif stop is not None:
                cause = "stop"
            else:
                cause = "eos"
            self.tokens_generated += len(token_ids)
            finished.append(GenerationOutput(
                request=request, token_ids=token_ids, logprobs=logprobs, finish=cause,
                stop_string=stop, version_start=version_start, version_end=self.policy_version,
            ))
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.llm_engine.has_unfinished_requests()

    def num_running(self) -> int:
        return min(len(self._requests), self.max_batch_size)

    def release(self, cache_key: Any) -> None:
        return  # vLLM's automatic prefix caching reuses earlier turns' KV by content

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        return run_to_completion(self, requests)

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        items = [(name, tensor) for name, tensor in state_dict.items()]
        self.llm_engine.collective_rpc(_load_weights_on_worker, args=(items,))
        if hasattr(self.llm_engine, "reset_prefix_cache"):
            self.llm_engine.reset_prefix_cache()  # cached prefixes came from the old weights
        self.policy_version = int(version)
