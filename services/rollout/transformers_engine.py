"""A transformers engine with a KV cache and continuous batching (CPU or CUDA).

Layout: the running requests form one batch with one KV cache; an explicit attention mask
(rows × cache width) marks each row's real positions, and each row's position ids count only
its real tokens, so rows of different lengths (and with holes) share the batch. A finishing
request's row is removed at once and waiting requests are prefilled as a small batch and
concatenated in, so the batch stays full without stepping finished sequences (docs/architecture.md).
Columns that no row uses any more are trimmed from the left.

Multi-turn reuse: when a finished request has a `cache_key`, its row's KV is parked (only its
real positions); the next request with that key whose prompt extends the parked tokens
prefills only the new tokens (the observation) on top of it, the way vLLM's prefix cache
would. Parked entries are bounded (oldest evicted) and dropped by `release`.

Shared prompts: joiners admitted together with the same prompt and nothing parked (a GRPO
group's n samples) are prefilled once, and their cache rows and first logits are copies; each
then samples on its own. On task (a) of bench/peer_trl.py the prompt is ~190 of ~205 tokens,
so this removes 3/4 of the prefill of a group of 4.

Every request carries the token ids it starts from; the engine never decodes and re-encodes
text it has produced (token-in/token-out). Stop strings are checked on the decoded text of the
new tokens, and only after a token that can complete one (see `stop_trigger_ids`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from services.rollout.engine import (
    ForcedTokens,
    GenerationOutput,
    GenerationRequest,
    run_to_completion,
    stop_trigger_ids,
)

log = logging.getLogger("forage.rollout.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Running:
    request: GenerationRequest
    cached: int  # tokens whose K/V are in the cache (all but `pending`)
    pending: int  # the last sampled token, fed at the next decode step
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    forced: list[int] | None = None
    version_start: int = 0
    done: bool = False  # static batching only: finished, still stepped until the batch ends


@dataclass
class _Parked:
    tokens: list[int]
    keys: list[torch.Tensor]  # per layer (kv_heads, len, head_dim)
    values: list[torch.Tensor]


class TransformersEngine:
    """Engine over any Hugging Face causal LM (the tiny policy, Qwen2.5, ...)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_batch_size: int = 32,
        seed: int = 0,
        refill: bool = True,
        policy_version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        # refill=False is static batching: a new batch is admitted only when the whole previous
        # one has finished (what plain `model.generate` and lockstep loops do). Benchmarks only.
        self.refill = refill
        self.policy_version = policy_version
        self.forced_tokens: ForcedTokens | None = None
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._rows: list[_Running] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # (rows, cache width) real positions
        self._parked: dict[Any, _Parked] = {}
        # LoRA: exact copies of the base weights an adapter changes, kept from the first
        # adapter on, so every version is base + its own delta (no drift across versions).
        self._lora_base: dict[str, torch.Tensor] = {}
        self.max_parked = 4 * max_batch_size
        self.min_admit = max(1, max_batch_size // 8)
        self.tokens_prefilled = 0
        self._trigger_cache: dict[tuple[str, ...], frozenset[int] | None] = {}
        self._next_id = 0
        self.tokens_generated = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tokenizer_path: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        **kwargs: Any,
    ) -> TransformersEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from services.common.paths import (
            LOCAL_ONLY,
            require_model_dir,
            require_tokenizer_dir,
            tokenizer_source,
        )

        # Both paths first (one line naming key and path), then local files only: a missing
        # directory must never turn into model-hub retries.
        require_model_dir(path, "model.path")
        key, tokenizer_dir = tokenizer_source(tokenizer_path, path)
        require_tokenizer_dir(tokenizer_dir, key)
        torch_dtype: Any = _DTYPES.get(dtype, "auto")
        if dtype == "auto" and device == "cpu":
            torch_dtype = torch.float32  # bf16 matmuls are slow on most CPUs
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **LOCAL_ONLY)
        model = model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, **LOCAL_ONLY)
        return cls(model, tokenizer, **kwargs)

    # ------------------------------------------------------------------ interface

    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id < 0:
            request.request_id = self._next_id
            self._next_id += 1
        if not request.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self._waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._rows)

    def num_running(self) -> int:
        return len(self._rows)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        return run_to_completion(self, requests)

    @torch.inference_mode()
    def step(self) -> list[GenerationOutput]:
        finished: list[GenerationOutput] = []
        free = self.max_batch_size - len(self._rows)
        # Joining costs a prefill call and a cache copy: with a batch still busy, wait until
        # `min_admit` slots are free (or everything waiting fits) and admit them together.
        ready = free >= min(self.min_admit, len(self._waiting)) or not self._rows
        if self._waiting and free > 0 and ready and (self.refill or not self._rows):
            finished.extend(self._admit(free))
        if self._rows:
            finished.extend(self._decode())
        return finished

    def abort_all(self) -> list[GenerationRequest]:
        """Drop everything (graceful shutdown); returns the requests that did not finish."""
        dropped = [row.request for row in self._rows if not row.done] + list(self._waiting)
        self._rows, self._cache, self._mask = [], None, None
        self._waiting.clear()
        self._parked.clear()
        return dropped

    def release(self, cache_key: Any) -> None:
        self._parked.pop(cache_key, None)

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Swap weights in place between decoding steps.

        Every name and shape is checked before anything is written, so a bad state dict leaves
        the old weights serving. Cached keys/values of running requests were computed with the
        old weights and are kept (as in-flight updates in PipelineRL/AReaL do); outputs report
        the versions they span. Parked multi-turn KV is dropped: a new turn starts clean.
        """
        own = self.model.state_dict()
        for name, tensor in state_dict.items():
            if name not in own:
                raise ValueError(f"load_weights: unknown tensor {name!r}")
            if tuple(own[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(own[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))
        self._lora_base.clear()  # full weights are the new base
        self._parked.clear()
        self.policy_version = int(version)

    def load_adapter(self, adapter: dict[str, Any], scale: float, version: int) -> None:
        """Apply a LoRA adapter (peft's tensor names) to the base weights, between steps.

        Each adapted weight becomes base + B @ A x `scale`, computed in float32 from an exact
        copy of the base taken when an adapter first touches it; a weight the previous adapter
        changed and this one does not goes back to its base. Everything is checked before
        anything is written, so a bad adapter leaves the old weights serving.
        """
        from services.common.lora import lora_deltas

        deltas = lora_deltas(adapter, scale)
        if not deltas:
            raise ValueError("load_adapter: the adapter holds no LoRA pair")
        own = self.model.state_dict()
        for name, delta in deltas.items():
            if name not in own:
                raise ValueError(f"load_adapter: the model has no weight {name!r}")
            if tuple(own[name].shape) != tuple(delta.shape):
                raise ValueError(f"load_adapter: {name} is {tuple(own[name].shape)}, the "
                                 f"adapter's delta {tuple(delta.shape)}")
        with torch.no_grad():
            for name in list(self._lora_base):
                if name not in deltas:
                    own[name].copy_(self._lora_base.pop(name))
            for name, delta in deltas.items():
                base = self._lora_base.get(name)
                if base is None:
                    base = self._lora_base[name] = own[name].detach().clone()
                merged = base.float() + delta.to(base.device)
                own[name].copy_(merged.to(own[name].dtype))
        self._parked.clear()
        self.policy_version = int(version)

    # ------------------------------------------------------------------ internals

    def _take_parked(self, request: GenerationRequest) -> _Parked | None:
        if request.cache_key is None:
            return None
        parked = self._parked.pop(request.cache_key, None)
        if parked is None:
            return None
        n = len(parked.tokens)
        if n >= len(request.prompt_ids) or request.prompt_ids[:n] != parked.tokens:
            return None  # not a continuation: prefill from scratch
        return parked

    def _admit(self, free: int) -> list[GenerationOutput]:
        from transformers import DynamicCache

        batch = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        parked_all = [self._take_parked(request) for request in batch]
        # Joiners with the same prompt and no parked KV (a GRPO group's n samples) are
        # prefilled once; their rows of the cache and logits are copies (`source`).
        first: dict[tuple[int, ...], int] = {}
        source: list[int] = []
        distinct: list[int] = []
        for position, (request, parked_kv) in enumerate(zip(batch, parked_all, strict=True)):
            key = tuple(request.prompt_ids) if parked_kv is None else (-1, position)
            if key not in first:
                first[key] = len(distinct)
                distinct.append(position)
            source.append(first[key])
        parked = [parked_all[i] for i in distinct]
        past = [len(p.tokens) if p is not None else 0 for p in parked]
        new = [batch[i].prompt_ids[n:] for i, n in zip(distinct, past, strict=True)]
        past_width, width = max(past), max(len(ids) for ids in new)
        count = len(distinct)
        ids = torch.full((count, width), self.pad_id, dtype=torch.long)
        chunk_mask = torch.zeros((count, width), dtype=torch.bool)
        past_mask = torch.zeros((count, past_width), dtype=torch.bool)
        positions = torch.zeros((count, width), dtype=torch.long)
        for row, tokens in enumerate(new):
            n = len(tokens)
            ids[row, width - n :] = torch.tensor(tokens, dtype=torch.long)
            chunk_mask[row, width - n :] = True
            positions[row, width - n :] = torch.arange(past[row], past[row] + n)
            if past[row]:
                past_mask[row, past_width - past[row] :] = True
        cache = _new_cache(DynamicCache, self.model.config)
        if past_width:
            for index, layer in enumerate(cache.layers):
                ref = next(p for p in parked if p is not None)
                keys = torch.stack([_past_row(p, ref, index, past_width, True) for p in parked])
                values = torch.stack([_past_row(p, ref, index, past_width, False) for p in parked])
                layer.update(keys, values)
        mask = torch.cat([past_mask, chunk_mask], dim=1).to(self.device)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.long(),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.tokens_prefilled += int(chunk_mask.sum())
        logits = out.logits[:, -1, :]
        if len(distinct) < len(batch):
            copies = torch.tensor(source, device=self.device)
            logits, mask = logits.index_select(0, copies), mask.index_select(0, copies)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, copies)
                layer.values = layer.values.index_select(0, copies)
        new_rows = []
        for request in batch:
            forced = None
            if self.forced_tokens is not None:
                script = self.forced_tokens(request)
                forced = list(script) if script is not None else None
            new_rows.append(
                _Running(request, cached=len(request.prompt_ids), pending=-1, forced=forced,
                         version_start=self.policy_version)
            )
        finished, keep = self._sample_and_check(logits, new_rows, cache, mask)
        if self.refill:
            rows, index = [new_rows[i] for i in keep], keep
        else:  # static batching: the whole batch stays until its last member finishes
            rows, index = new_rows, list(range(len(batch)))
        if rows:
            self._merge(cache, mask, rows, index)
        return finished

    def _decode(self) -> list[GenerationOutput]:
        rows = len(self._rows)
        mask = torch.cat(
            [self._mask, torch.ones((rows, 1), dtype=torch.bool, device=self.device)], dim=1
        )
        cached = torch.tensor([row.cached for row in self._rows])
        out = self.model(
            input_ids=torch.tensor([[row.pending] for row in self._rows], device=self.device),
            attention_mask=mask.long(),
            position_ids=cached[:, None].to(self.device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._mask = mask
        for row in self._rows:
            row.cached += 1
        finished, keep = self._sample_and_check(out.logits[:, -1, :], self._rows, self._cache,
                                                self._mask)
        if self.refill:
            if len(keep) != rows:
                self._select(keep)
        elif all(row.done for row in self._rows):
            self._select([])
        return finished

    def _sample_and_check(
        self, logits: torch.Tensor, rows: list[_Running], cache: Any, mask: torch.Tensor
    ) -> tuple[list[GenerationOutput], list[int]]:
        tokens, logprobs = self._sample(logits, rows)
        finished, keep = [], []
        for index, row in enumerate(rows):
            if row.done:
                row.pending = tokens[index]  # static batching: stepped but not reported
                continue
            self.tokens_generated += 1
            token = tokens[index]
            row.tokens.append(token)
            row.logprobs.append(logprobs[index])
            row.pending = token
            output = self._finish_cause(row, token)
            if output is None:
                keep.append(index)
                continue
            finished.append(output)
            row.done = True
            if row.request.cache_key is not None:
                self._park(row, cache, mask, index)
        return finished, keep

    def _park(self, row: _Running, cache: Any, mask: torch.Tensor, index: int) -> None:
        real = mask[index].nonzero().squeeze(-1)
        keys = [layer.keys[index].index_select(1, real) for layer in cache.layers]
        values = [layer.values[index].index_select(1, real) for layer in cache.layers]
        tokens = list(row.request.prompt_ids) + row.tokens[:-1]  # the last token is not cached
        assert len(tokens) == keys[0].shape[1], (len(tokens), keys[0].shape)
        self._parked.pop(row.request.cache_key, None)
        self._parked[row.request.cache_key] = _Parked(tokens, keys, values)
        while len(self._parked) > self.max_parked:
            self._parked.pop(next(iter(self._parked)))

    def _finish_cause(self, row: _Running, token: int) -> GenerationOutput | None:
        params = row.request.params
        cause, stop_hit = None, None
        if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
            cause = "eos"  # a stop token id ends the turn as EOS does (vLLM's mapping too)
        elif params.stop:
            triggers = self._triggers(tuple(params.stop))
            if triggers is None or token in triggers:
                tail_len = max(len(stop) for stop in params.stop) + 2
                text = self.tokenizer.decode(row.tokens[-tail_len:], skip_special_tokens=False)
                for stop in params.stop:
                    if stop in text:
                        cause, stop_hit = "stop", stop
                        break
        if cause is None and len(row.tokens) >= params.max_tokens:
            cause = "length"
        if cause is None:
            return None
        return GenerationOutput(
            request=row.request,
            token_ids=row.tokens,
            logprobs=row.logprobs,
            finish=cause,
            stop_string=stop_hit,
            version_start=row.version_start,
            version_end=self.policy_version,
        )

    def _triggers(self, stops: tuple[str, ...]) -> frozenset[int] | None:
        if stops not in self._trigger_cache:
            self._trigger_cache[stops] = stop_trigger_ids(self.tokenizer, stops)
        return self._trigger_cache[stops]

    def _sample(self, logits: torch.Tensor, rows: list[_Running]) -> tuple[list[int], list[float]]:
        logits = logits.float()
        params = [row.request.params for row in rows]
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        forced_now = [
            row.forced[len(row.tokens)] if row.forced and len(row.tokens) < len(row.forced) else -1
            for row in rows
        ]
        if bool(greedy.all()):
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logp.argmax(dim=-1)
        else:
            temps = torch.tensor(
                [p.temperature if not p.greedy else 1.0 for p in params], device=logits.device
            )
            scaled = logits / temps[:, None]
            top_k = [p.top_k for p in params]
            if any(k > 0 for k in top_k):
                scaled = _apply_top_k(scaled, top_k)
            top_p = [p.top_p for p in params]
            if any(p < 1.0 for p in top_p):
                scaled = _apply_top_p(scaled, torch.tensor(top_p, device=logits.device))
            logp = torch.log_softmax(scaled, dim=-1)
            uniform = torch.rand((len(rows), 1), generator=self.generator, device=logits.device)
            sampled = _sample_rows(logp.exp(), uniform)
            if bool(greedy.any()):
                raw = torch.log_softmax(logits, dim=-1)
                logp = torch.where(greedy[:, None], raw, logp)
                sampled = torch.where(greedy, raw.argmax(dim=-1), sampled)
            chosen = sampled
        if any(token >= 0 for token in forced_now):
            forced_t = torch.tensor(forced_now, device=logits.device)
            chosen = torch.where(forced_t >= 0, forced_t, chosen)
        picked = logp.gather(-1, chosen[:, None]).squeeze(-1)
        return chosen.tolist(), picked.tolist()

    def _merge(self, cache: Any, mask: torch.Tensor, rows: list[_Running], index: list[int]) -> None:
        if len(index) != mask.shape[0]:
            select = torch.tensor(index, device=self.device)
            mask = mask.index_select(0, select)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, select)
                layer.values = layer.values.index_select(0, select)
        if self._cache is None or not self._rows:
            self._cache, self._mask, self._rows = cache, mask, list(rows)
        else:
            target = max(self._mask.shape[1], mask.shape[1])
            for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, target), _left_pad(theirs.keys, target)])
                mine.values = torch.cat(
                    [_left_pad(mine.values, target), _left_pad(theirs.values, target)]
                )
            self._mask = torch.cat([_left_pad_mask(self._mask, target), _left_pad_mask(mask, target)])
            self._rows.extend(rows)
        self._trim()

    def _select(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._mask = self._mask.index_select(0, index)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self._trim()

    def _trim(self) -> None:
        used = self._mask.any(dim=0)
        cut = int(used.float().argmax()) if bool(used.any()) else self._mask.shape[1]
        if cut > 0:
            self._mask = self._mask[:, cut:]
            for layer in self._cache.layers:
                if isinstance(layer, _GrowingLayer):
                    layer.trim_left(cut)
                else:
                    layer.keys = layer.keys[:, :, cut:, :]
                    layer.values = layer.values[:, :, cut:, :]


def _past_row(
    parked: _Parked | None, ref: _Parked, layer: int, width: int, keys: bool
) -> torch.Tensor:
    """One joiner's parked K or V for `layer`, left-padded with zeros to `width` (all zeros for
    a joiner without parked KV; the mask hides them)."""
    source = parked if parked is not None else ref
    tensor = source.keys[layer] if keys else source.values[layer]
    if parked is None:
        return tensor.new_zeros(tensor.shape[0], width, tensor.shape[2])
    return _left_pad(tensor, width)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing <= 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def _new_cache(cache_class: Any, config: Any) -> Any:
    cache = cache_class(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [_GrowingLayer() for _ in cache.layers]
    return cache


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer preallocated along the sequence axis.

    DynamicLayer appends with `torch.cat`, copying the whole cache at every decoding step; here
    a step writes one column in place into spare capacity (doubling when full), which is most
    of the difference between the engine's and `model.generate`'s per-step cost on long
    contexts. Assigning `keys`/`values` (row selection, trimming, merging) copies into a fresh
    buffer with headroom; keys and values keep their own lengths so they can be assigned one
    after the other.
    """

    _headroom = 64

    def __init__(self) -> None:
        self._buf: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self._start = {"k": 0, "v": 0}  # trimmed-off columns at the left of the buffer
        self._len = {"k": 0, "v": 0}
        super().__init__()

    def _get(self, which: str) -> torch.Tensor | None:
        buffer, start = self._buf[which], self._start[which]
        return None if buffer is None else buffer[:, :, start : start + self._len[which]]

    def _set(self, which: str, tensor: torch.Tensor | None) -> None:
        self._start[which] = 0
        if tensor is None or tensor.dim() != 4:
            self._buf[which], self._len[which] = None, 0
            return
        self._buf[which] = _buffer(tensor, tensor.shape[2] + self._headroom)
        self._len[which] = tensor.shape[2]

    def trim_left(self, cut: int) -> None:
        """Drop the first `cut` columns without copying."""
        for which in ("k", "v"):
            self._start[which] += cut
            self._len[which] -= cut

    keys = property(lambda self: self._get("k"), lambda self, t: self._set("k", t))  # type: ignore[assignment]
    values = property(lambda self: self._get("v"), lambda self, t: self._set("v", t))  # type: ignore[assignment]

    def _append(self, which: str, states: torch.Tensor) -> None:
        buffer, length, new = self._buf[which], self._len[which], states.shape[2]
        if buffer is None:
            self._set(which, states)
            return
        end = self._start[which] + length
        if end + new > buffer.shape[2]:
            buffer = _buffer(self._get(which), 2 * (length + new))
            self._buf[which], self._start[which], end = buffer, 0, length
        buffer[:, :, end : end + new] = states
        self._len[which] = length + new

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("k", key_states)
        self._append("v", value_states)
        return self.keys, self.values


def _buffer(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    buffer = tensor.new_empty((*tensor.shape[:2], capacity, tensor.shape[3]))
    buffer[:, :, : tensor.shape[2]] = tensor
    return buffer


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([pad, tensor], dim=-2)


def _sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` by inverting its cumulative distribution at that row's
    `uniform` draw (rows × 1, in [0, 1)).

    The same distribution as `torch.multinomial(probs, 1)`: token i is drawn when a uniform
    draw falls in [cdf[i-1], cdf[i]), so a token of probability 0 never is. It needs one
    random number per row instead of a pass over the vocabulary: on the CPU, multinomial took
    ~20 ms for 16 rows of SmolLM2's 49,152-token vocabulary, this ~0.5 ms. The float32 cumsum
    is within 1e-7 of a float64 one there. The scaled draw is kept strictly under the total
    (a draw of 1.0 at a generator's bound would reach it), so the token found always has a
    positive probability.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1)


def _apply_top_k(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=scaled.device)
    kmax = int(ks.max())
    values = scaled.topk(kmax, dim=-1).values
    threshold = values.gather(-1, (ks - 1)[:, None])
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    remove_sorted = before >= top_p[:, None]  # the top token always stays
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return frozenset(ids)
