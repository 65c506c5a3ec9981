"""The vLLM engine (GPU nodes, the `gpu` extra) behind the same step interface.

Written against vLLM's V1 `LLMEngine` (the range pinned in pyproject's `gpu` extra):
`LLMEngine.from_engine_args(EngineArgs(...))`, `add_request(request_id,
TokensPrompt(prompt_token_ids=...), SamplingParams(...))`, `step()` returning `RequestOutput`s,
`abort_request(request_ids)`, `collective_rpc(method_name, args=...)` and
`reset_prefix_cache(reset_running_requests=...)`.
vLLM schedules with continuous batching and paged attention itself, so this class maps
requests and outputs, and drives weight updates:

- Weights never cross the engine's RPC (it is msgpack-encoded; see vllm_worker.py). The
  rollout service calls `pull_weights(version, address, token)`; every vLLM worker fetches
  that version from the learner itself, all ranks stage it, then all load it (or none does).
- After an update, prefix-cache blocks computed with the old weights must not be reused.
  vLLM's `reset_prefix_cache()` returns False (and resets nothing) while running requests hold
  blocks, and Forage updates between engine steps with requests running; so the reset is done
  with `reset_running_requests=True` (vLLM preempts the running requests; they recompute their
  KV with the new weights when rescheduled), its result is checked, failures are retried and
  counted (`forage_rollout_prefix_cache_reset_failures_total`), and an update whose reset never
  succeeds stops the replica rather than serve stale KV.
- A request vLLM rejects (e.g. a prompt longer than `max_model_len`) finishes at once with
  cause "error"; vLLM's "abort" / "error" finish reasons are never reported as EOS.
- After a failed batch the rollout worker calls `abort_all`, which aborts the live requests in
  vLLM (their KV blocks are freed at once) instead of generating them to completion only to
  discard the answers.
- LoRA adapters (`learner.lora.publish: adapter`) go through vLLM's own LoRA support, not the
  worker extension: the replica fetches the adapter (a few MB) itself, published.py checks the
  base model's fingerprint, `load_adapter` writes it as a peft directory and registers it with
  `add_lora(LoRARequest(name, id, path))`; new requests carry `lora_request=` for it, and an
  old adapter is removed once no live request uses it (services/rollout/vllm_lora.py). Only a
  str, an int and a path cross the engine RPC for it.

With `logprobs_mode="processed_logprobs"` the reported log-probs are those of the distribution
that was sampled from (temperature/top-k/top-p applied), like the transformers engine's.
vllm is imported lazily so CPU installs never need it. The `forced_tokens` test hook is not
supported here (tests that need scripted tokens run on the transformers engine).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.rollout import metrics
from services.rollout.engine import (
    FinishCause,
    ForcedTokens,
    GenerationOutput,
    GenerationRequest,
    run_to_completion,
)
from services.rollout.engine import (
    SamplingParams as EngineSamplingParams,
)
from services.rollout.vllm_lora import (
    AdapterSlot,
    AdapterVersions,
    lora_request_kwargs,
)
from services.rollout.vllm_worker import COMMIT_METHOD, DROP_METHOD, STAGE_METHOD

log = logging.getLogger("forage.rollout.vllm")

RESET_ATTEMPTS = 3
# KV cache of an engine on a machine without CUDA when rollout.kv_cache_gib is 0 (see there).
CPU_KV_CACHE_GIB = 2.0


# ---------------------------------------------------------------------------- what crosses RPC


class RpcCall(NamedTuple):
    """One call over vLLM's engine RPC: a method name and plain positional arguments."""

    method: str
    args: tuple


def stage_call(version: int, address: str, token: str | None,
               plan: Mapping[str, Any] | None = None) -> RpcCall:
    """`plan`: relay settings and the tensor-parallel share socket (vllm_worker.py), plain
    values only; left out when there is none, so the call is what it was before relays."""
    args: tuple[Any, ...] = (int(version), str(address), str(token or ""))
    return RpcCall(STAGE_METHOD, args + ((dict(plan),) if plan else ()))


def commit_call(version: int) -> RpcCall:
    return RpcCall(COMMIT_METHOD, (int(version),))


def drop_call() -> RpcCall:
    return RpcCall(DROP_METHOD, ())


def rank_failures(results: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """One line per rank that did not succeed (an empty answer counts as a failure)."""
    if not results:
        return ["no answer from any vLLM worker"]
    failures = []
    for index, result in enumerate(results):
        if not isinstance(result, Mapping) or not result.get("ok"):
            rank = result.get("rank", index) if isinstance(result, Mapping) else index
            detail = (result.get("error") or result.get("reason")) if isinstance(
                result, Mapping) else repr(result)
            failures.append(f"rank {rank}: {detail}")
    return failures


def failure_reason(results: Sequence[Mapping[str, Any]] | None) -> str:
    """The first failing rank's machine-readable reason (WeightSyncError.reason's words)."""
    for result in results or ():
        if isinstance(result, Mapping) and not result.get("ok"):
            return str(result.get("reason") or "transport")
    return "transport"


# ---------------------------------------------------------------------------- prefix cache


def reset_prefix_cache(reset: Callable[..., bool], attempts: int = RESET_ATTEMPTS) -> bool:
    """Drop every cached prefix block; True once vLLM confirms it.

    `reset` is vLLM's `LLMEngine.reset_prefix_cache`. It is asked to preempt running requests
    too: without that, vLLM refuses (returns False) whenever a request holds blocks, which is
    always the case between two steps of a busy engine. vLLM's scheduler raises RuntimeError
    when even that cannot free the blocks (remote KV transfers in flight); through the
    multiprocess engine client a utility call's failure arrives as a plain `Exception` with
    that message. Each failed attempt is counted in
    `forage_rollout_prefix_cache_reset_failures_total`.
    """
    for attempt in range(1, attempts + 1):
        try:
            if reset(reset_running_requests=True):
                return True
            problem = "vLLM returned False"
        except Exception as exc:  # noqa: BLE001 - vLLM's MP client raises bare Exception
            problem = f"{type(exc).__name__}: {exc}"
        metrics.PREFIX_CACHE_RESET_FAILURES.inc()
        log.warning("prefix cache reset attempt %d/%d failed: %s", attempt, attempts, problem)
    return False


# ---------------------------------------------------------------------------- outputs


@dataclass
class MappedCompletion:
    cause: FinishCause
    token_ids: list[int]
    logprobs: list[float]
    stop_string: str | None = None
    error: str | None = None


def map_completion(
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float]] | None,
) -> MappedCompletion:
    """A finished vLLM completion in Forage's terms (plain values in, plain values out).

    vLLM's finish reasons are "stop", "length", "abort", "error" and "repetition". "stop"
    with a string `stop_reason` is a stop string; with None (the EOS token) or an int (another
    of the model's stop token ids, e.g. from its generation config) it is EOS. "abort" and
    "error" are not answers, and neither is a reason Forage does not know: they map to
    "aborted" / "error" with a message, never to "eos". `logprobs` holds, per generated token,
    a mapping token id -> log-prob that must contain the sampled token; a missing or
    misaligned entry is an error too (a silently shifted log-prob would corrupt the loss).
    """
    ids = [int(t) for t in token_ids]
    stop_string = None
    if finish_reason == "length":
        cause: FinishCause = "length"
    elif finish_reason == "stop":
        if isinstance(stop_reason, str):
            cause, stop_string = "stop", stop_reason
        else:
            cause = "eos"
    elif finish_reason == "abort":
        return MappedCompletion("aborted", ids, [], error="vLLM aborted the request")
    elif finish_reason == "error":
        return MappedCompletion("error", ids, [], error="vLLM ended the request with an error")
    else:
        return MappedCompletion("error", ids, [],
                                error=f"vLLM finish_reason {finish_reason!r} is not handled")
    if logprobs is None or len(logprobs) != len(ids):
        got = "none" if logprobs is None else len(logprobs)
        return MappedCompletion("error", ids, [],
                                error=f"vLLM returned {got} log-prob entries for {len(ids)} tokens")
    values = []
    for position, (token, entry) in enumerate(zip(ids, logprobs, strict=True)):
        if token not in entry:
            return MappedCompletion(
                "error", ids, [], error=f"vLLM gave no log-prob for token {token} at {position}")
        values.append(float(entry[token]))
    return MappedCompletion(cause, ids, values, stop_string=stop_string)


def sampling_kwargs(p: EngineSamplingParams) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments of Forage's sampling (plain values, tested
    without vLLM). vLLM detokenizes by default and matches stop strings on that text, decoded
    without special tokens: a stop string such as `<|im_end|>` never appears in it, so the
    template's end-of-turn token travels in `stop_token_ids` (vLLM then finishes with "stop"
    and the token id as `stop_reason`, which `map_completion` reads as EOS, and keeps the token
    in the output ids, as for the model's own EOS)."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "max_tokens": p.max_tokens,
        "stop": list(p.stop) or None,
        "include_stop_str_in_output": True,
        "ignore_eos": p.ignore_eos,
        "logprobs": 0,  # the sampled token's own log-prob only
    }
    if p.stop_token_ids:
        kwargs["stop_token_ids"] = sorted({int(t) for t in p.stop_token_ids})
    return kwargs


def plain_logprobs(entries: Iterable[Mapping[int, Any]] | None) -> list[dict[int, float]] | None:
    """vLLM's per-token {token_id: Logprob} entries as {token_id: float}."""
    if entries is None:
        return None
    return [{int(t): float(getattr(lp, "logprob", lp)) for t, lp in entry.items()}
            for entry in entries]


def error_output(request: GenerationRequest, message: str, version: int) -> GenerationOutput:
    """A request that ends without generating: the agent loop records it as an error."""
    return GenerationOutput(request=request, token_ids=[], logprobs=[], finish="error",
                            version_start=version, version_end=version,
                            extra={"error": message})


# ---------------------------------------------------------------------------- the engine


@dataclass
class _Live:
    request: GenerationRequest
    version_start: int
    # the LoRA adapter version it runs with (None: none); it keeps that adapter to the end
    adapter: int | None = None


@dataclass(eq=False)
class VLLMEngine:
    llm_engine: Any
    tokenizer: Any
    max_batch_size: int
    policy_version: int = 0
    prefix_caching: bool = True
    forced_tokens: ForcedTokens | None = None
    tokens_generated: int = 0
    # LoRA adapters (engine started with enable_lora); None: full-weight updates only
    lora: AdapterVersions | None = None
    _live: dict[str, _Live] = field(default_factory=dict)
    _failed: list[GenerationOutput] = field(default_factory=list)
    _next_id: int = 0
    _lora_requests: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: dict[str, Any]) -> VLLMEngine:
        """Start vLLM from `engines.vllm_engine_kwargs(config)` (the EngineArgs fields)."""
        import torch
        from vllm import EngineArgs, LLMEngine

        engine_kwargs = dict(engine_kwargs)
        if engine_kwargs.get("kv_cache_memory_bytes") is None and not torch.cuda.is_available():
            engine_kwargs["kv_cache_memory_bytes"] = int(CPU_KV_CACHE_GIB * 2**30)
            log.info("no CUDA device: vLLM's KV cache takes %.1f GiB of host memory "
                     "(rollout.kv_cache_gib)", CPU_KV_CACHE_GIB)
        llm_engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs))
        lora = (AdapterVersions(max_rank=int(engine_kwargs["max_lora_rank"]))
                if engine_kwargs.get("enable_lora") else None)
        return cls(llm_engine, llm_engine.get_tokenizer(), int(engine_kwargs["max_num_seqs"]),
                   prefix_caching=bool(engine_kwargs.get("enable_prefix_caching", True)),
                   lora=lora)

    @classmethod
    def from_pretrained(cls, path: str, tokenizer_path: str | None = None,
                        max_batch_size: int = 256, seed: int = 0, lora: Any = None,
                        **rollout_keys: Any) -> VLLMEngine:
        """Python use and tests: the EngineArgs a config with these `rollout.*` keys (and
        `learner.lora` settings, for adapters) gives."""
        from services.common.config.model import ModelSection
        from services.common.config.rollout import RolloutSection
        from services.rollout.engines import vllm_engine_kwargs

        rollout = RolloutSection(engine="vllm", max_batch_size=max_batch_size, seed=seed,
                                 **rollout_keys)
        model = ModelSection(path=str(path), tokenizer_path=tokenizer_path)
        return cls.from_engine_kwargs(vllm_engine_kwargs(rollout, model, lora))

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes now, not whenever the garbage
        collector gets to them (a replica or a test that starts another engine after this one
        would otherwise hold two models' memory for a while)."""
        core = getattr(self.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: GenerationRequest) -> None:
        if self.forced_tokens is not None:
            raise NotImplementedError("forced_tokens is a transformers-engine test hook")
        if request.request_id < 0:
            request.request_id = self._next_id
            self._next_id += 1
        key = f"r{request.request_id}-{self._next_id}"
        self._next_id += 1
        adapter = self.lora.current if self.lora is not None else None
        try:
            self._submit(key, request,
                         self._lora_request(adapter) if adapter is not None else None)
        except Exception as exc:  # noqa: BLE001 - vLLM validates inputs by raising (ValueError...)
            log.warning("vLLM rejected request %s: %s", key, exc)
            self._failed.append(error_output(
                request, f"vLLM rejected the request: {type(exc).__name__}: {exc}",
                self.policy_version))
            return
        self._live[key] = _Live(request, self.policy_version,
                                adapter.version if adapter is not None else None)

    def _submit(self, key: str, request: GenerationRequest, lora_request: Any = None) -> None:
        """Hand one request to vLLM (the only place that builds vLLM's request types);
        `lora_request`: the adapter it runs with (`_lora_request`), or None."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(**sampling_kwargs(request.params))
        self.llm_engine.add_request(key, TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                    params, lora_request=lora_request)

    def step(self) -> list[GenerationOutput]:
        finished, self._failed = self._failed, []
        if not self._live:
            return finished
        for result in self.llm_engine.step():
            if not result.finished or result.request_id not in self._live:
                continue
            live = self._live.pop(result.request_id)
            completion = result.outputs[0]
            mapped = map_completion(completion.finish_reason, completion.stop_reason,
                                    completion.token_ids, plain_logprobs(completion.logprobs))
            if mapped.error:
                log.warning("request %s: %s", result.request_id, mapped.error)
            self.tokens_generated += len(mapped.token_ids)
            finished.append(GenerationOutput(
                request=live.request, token_ids=mapped.token_ids, logprobs=mapped.logprobs,
                finish=mapped.cause, stop_string=mapped.stop_string,
                version_start=live.version_start, version_end=self._version_end(live),
                extra={"error": mapped.error} if mapped.error else {},
            ))
        if finished:
            self._remove_retired_adapters()
        return finished

    def _version_end(self, live: _Live) -> int:
        """The newest version whose weights produced a request's tokens. A full-weight update
        reaches running requests; with LoRA a request keeps the adapter it started with (an
        adapter update never changes running requests), so it ends on its own version."""
        return live.version_start if self.lora is not None else self.policy_version

    def has_unfinished(self) -> bool:
        return bool(self._failed) or bool(self._live)

    def abort_all(self) -> list[GenerationRequest]:
        """Drop every request (after a failed batch); returns those that were still running.

        The rollout worker resets the engine this way when a batch fails, so the next batch
        starts clean. Stepping the live requests to completion instead would spend up to
        `max_tokens` decode steps each on answers nobody reads, with the replica stalled; vLLM's
        `abort_request` frees their scheduler slots and KV blocks at once. Rejected requests
        waiting to be reported are dropped too.
        """
        keys = list(self._live)
        if keys:
            self.llm_engine.abort_request(keys)
        dropped = [live.request for live in self._live.values()]
        self._live.clear()
        self._failed.clear()
        self._remove_retired_adapters()
        return dropped

    def num_running(self) -> int:
        return min(len(self._live), self.max_batch_size)

    def release(self, cache_key: Any) -> None:
        return  # vLLM's automatic prefix caching reuses earlier turns' KV by content

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        return run_to_completion(self, requests)

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        raise NotImplementedError(
            "the vLLM engine does not take tensors: its workers fetch weights themselves "
            "(use pull_weights(version, address, token))")

    # ------------------------------------------------------------------ LoRA adapters

    def load_adapter(self, adapter: dict[str, Any], scale: float, version: int) -> None:
        """Serve a LoRA adapter (peft's tensor names) as `version` through vLLM's LoRA support.

        Called by published.load_published once the adapter's base fingerprint matched this
        replica's model. The adapter becomes a peft directory, vLLM loads it in every worker
        (`add_lora`), and only then do new requests get it; running requests finish on the
        adapter they started with. Raises ValueError, with the old adapter serving on, when
        the engine was started without LoRA, the adapter is malformed or too large a rank, or
        vLLM refuses it.
        """
        if self.lora is None:
            raise ValueError("this vLLM engine was started without LoRA (enable_lora); the "
                             "replica's config needs learner.lora.rank > 0 and "
                             "learner.lora.publish: adapter, as the learner's")
        slot = self.lora.prepare(version, adapter, scale)
        try:
            added = self.llm_engine.add_lora(self._lora_request(slot))
        except Exception as exc:  # noqa: BLE001 - vLLM's MP client raises bare Exception
            added, problem = False, f"{type(exc).__name__}: {exc}"
        else:
            problem = "vLLM answered False"
        if not added:
            self._drop_lora(slot)
            raise ValueError(f"vLLM did not load adapter v{slot.version}: {problem}")
        self.lora.activate(slot)
        self.policy_version = slot.version
        self._remove_retired_adapters()

    def _lora_request(self, slot: AdapterSlot) -> Any:
        """vLLM's `LoRARequest` for `slot`, built once per adapter (the only vLLM type the LoRA
        path builds; its fields are plain: vllm_lora.lora_request_kwargs)."""
        request = self._lora_requests.get(slot.version)
        if request is None:
            from vllm.lora.request import LoRARequest

            request = self._lora_requests[slot.version] = LoRARequest(
                **lora_request_kwargs(slot))
        return request

    def _drop_lora(self, slot: AdapterSlot) -> None:
        """Remove `slot` from vLLM (best effort) and forget it and its directory."""
        try:
            self.llm_engine.remove_lora(slot.lora_int_id)  # False: not (or no longer) loaded
        except Exception as exc:  # noqa: BLE001 - nothing uses it; log and go on
            log.warning("removing adapter v%d from vLLM failed: %s", slot.version, exc)
        self._lora_requests.pop(slot.version, None)
        assert self.lora is not None
        self.lora.forget(slot)

    def _remove_retired_adapters(self) -> None:
        """Remove every adapter that is neither the newest nor used by a live request."""
        if self.lora is None or len(self.lora.registered) < 2:
            return
        for slot in self.lora.retired(live.adapter for live in self._live.values()):
            self._drop_lora(slot)
            log.info("removed adapter v%d (no request uses it)", slot.version)

    def _rpc(self, call: RpcCall) -> list[Any]:
        return self.llm_engine.collective_rpc(call.method, args=call.args)

    def pull_weights(self, version: int, address: str, token: str | None = None,
                     plan: Mapping[str, Any] | None = None) -> int:
        """Have every vLLM worker fetch `version` from the weight server and load it (with
        `plan`, rank 0 fetches through relays and the other ranks read from it: vllm_worker.py).

        Raises WeightSyncError (old weights keep serving) when any rank could not fetch and
        verify it; ValueError, before any worker is asked, when this engine serves LoRA
        adapters; RuntimeError when ranks failed to load staged weights or the prefix cache
        could not be reset (the replica must not go on serving a half-updated model).
        """
        from services.common.weight_sync import WeightSyncError

        version = int(version)
        if self.lora is not None:
            # Adapters apply to the base vLLM loaded; new full weights under them would leave
            # running requests on a base their adapter was not trained on.
            raise ValueError(f"v{version} is full weights, but this vLLM engine serves LoRA "
                             "adapters (learner.lora.publish: adapter): keeping the current "
                             "weights")
        staged = self._rpc(stage_call(version, address, token, plan))
        failures = rank_failures(staged)
        if failures:
            self._rpc(drop_call())
            raise WeightSyncError(failure_reason(staged),
                                  f"v{version} not staged on every vLLM worker: "
                                  + "; ".join(failures))
        loaded = self._rpc(commit_call(version))
        failures = rank_failures(loaded)
        if failures:
            raise RuntimeError(f"vLLM workers failed to load staged weights v{version}: "
                               + "; ".join(failures))
        self.policy_version = version
        if self.prefix_caching and not reset_prefix_cache(self.llm_engine.reset_prefix_cache):
            raise RuntimeError(
                f"loaded v{version} but vLLM's prefix cache could not be reset after "
                f"{RESET_ATTEMPTS} attempts; cached blocks from old weights would be reused")
        return version
