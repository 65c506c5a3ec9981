"""Pick an engine from the config (vLLM only imported when asked for)."""

from __future__ import annotations

import importlib.util
from typing import Any

from services.common.config import ConfigError
from services.common.paths import require_model_dir, require_tokenizer_dir
from services.rollout.vllm_lora import lora_engine_kwargs
from services.rollout.vllm_worker import EXTENSION_CLASS

# EngineArgs fields Forage sets from its own keys; `rollout.vllm_engine_args` may not override
# them (a second, silently winning place for the same setting would make configs lie).
MANAGED_VLLM_ARGS = frozenset({
    "model", "tokenizer", "seed", "dtype", "max_num_seqs", "gpu_memory_utilization",
    "tensor_parallel_size", "enforce_eager", "enable_prefix_caching", "max_model_len",
    "worker_extension_cls", "logprobs_mode", "kv_cache_memory_bytes",
    # from learner.lora with `publish: adapter` (services/rollout/vllm_lora.py)
    "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
})


def vllm_engine_kwargs(rollout: Any, model: Any, lora: Any = None) -> dict[str, Any]:
    """The vLLM `EngineArgs(**kwargs)` for a config's `rollout` and `model` sections.

    A pure function (no vLLM import), so the mapping from Forage's keys to vLLM's is tested on
    machines without a GPU. `max_batch_size` becomes `max_num_seqs` (one batch-size key for
    every engine); `max_model_len` 0 means the model's own limit (vLLM's None). `lora` is
    `learner.lora`: when replicas receive adapters (`publish: adapter`), vLLM's LoRA support
    is switched on with room for the adapter's rank (vllm_lora.lora_engine_kwargs).
    """
    if not model.path:
        raise ValueError("model.path is not set: the rollout engine needs a model directory")
    clash = sorted(MANAGED_VLLM_ARGS & set(rollout.vllm_engine_args))
    if clash:
        raise ValueError(f"rollout.vllm_engine_args sets {clash}: use the rollout.* keys "
                         "for these (docs/rollout.md)")
    kwargs: dict[str, Any] = dict(
        model=str(model.path),
        tokenizer=str(model.tokenizer_path or model.path),
        seed=rollout.seed,
        dtype=rollout.dtype,
        max_num_seqs=rollout.max_batch_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        tensor_parallel_size=rollout.tensor_parallel_size,
        enforce_eager=rollout.enforce_eager,
        enable_prefix_caching=rollout.enable_prefix_caching,
        max_model_len=rollout.max_model_len or None,
        # Weight updates run inside the workers (services/rollout/vllm_worker.py).
        worker_extension_cls=EXTENSION_CLASS,
        # Log-probs of the distribution actually sampled from (as the transformers engine).
        logprobs_mode="processed_logprobs",
    )
    if rollout.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * 2**30)
    kwargs.update(lora_engine_kwargs(lora))
    kwargs.update(rollout.vllm_engine_args)
    return kwargs


class EngineUnavailable(ConfigError):
    """The configured engine's package is not installed here (one line, exit code 2)."""


def require_engine(engine: str, key: str = "rollout.engine") -> None:
    """Refuse an engine whose package is missing before anything loads: one line naming the
    package, not vLLM's ImportError traceback from deep inside a replica's start."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(f"{key}: vllm needs the `vllm` package, which is not installed "
                                "here (on a GPU node: pip install -e .[gpu])")


def make_engine(config: Any) -> Any:
    """`config` is a RunConfig: model.path, rollout.engine/device/dtype/max_batch_size/seed."""
    rollout, model = config.rollout, config.model
    # One line naming the key and the path (exit 2), for every engine, before any loading.
    require_model_dir(model.path, "model.path")
    if model.tokenizer_path:
        require_tokenizer_dir(model.tokenizer_path, "model.tokenizer_path")
    require_engine(rollout.engine)
    if rollout.engine == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_engine_kwargs(
            vllm_engine_kwargs(rollout, model, config.learner.lora))
    from services.rollout.transformers_engine import TransformersEngine

    return TransformersEngine.from_pretrained(
        model.path, tokenizer_path=model.tokenizer_path, device=rollout.device,
        dtype=rollout.dtype, max_batch_size=rollout.max_batch_size, seed=rollout.seed,
    )
