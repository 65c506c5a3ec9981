"""Pick an engine from the config (vLLM only imported when asked for)."""

from __future__ import annotations

from typing import Any


def make_engine(config: Any) -> Any:
    """`config` is a RunConfig: model.path, rollout.engine/device/dtype/max_batch_size/seed."""
    rollout, model = config.rollout, config.model
    if not model.path:
        raise ValueError("model.path is not set: the rollout engine needs a model directory")
    if rollout.engine == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(
            model.path, tokenizer_path=model.tokenizer_path, max_batch_size=rollout.max_batch_size,
            seed=rollout.seed, dtype=rollout.dtype,
        )
    from services.rollout.transformers_engine import TransformersEngine

    return TransformersEngine.from_pretrained(
        model.path, tokenizer_path=model.tokenizer_path, device=rollout.device,
        dtype=rollout.dtype, max_batch_size=rollout.max_batch_size, seed=rollout.seed,
    )
