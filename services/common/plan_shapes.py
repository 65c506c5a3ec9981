"""Model shapes `forage plan` knows without the weights: each entry is the public config.json
of a model the shipped configs or docs name, copied field for field (the repository on the
Hugging Face Hub is in the comment), so a plan works before anything is downloaded.

Only the fields a memory estimate reads are kept. A model that is not here is read from its
own directory (model.path/config.json) or from `forage plan --model-config FILE`.
"""

from __future__ import annotations

from typing import Any

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B config.json (the bench's GPU check uses the same shape,
    # bench/gpu/common.py)
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768,
                         attention_bias=True),
    # Qwen/Qwen2.5-1.5B config.json
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         attention_bias=True),
    # Qwen/Qwen2.5-Math-1.5B config.json (configs/gsm8k_probe.yaml): the 1.5B body with a
    # 4k context
    "Qwen2.5-Math-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                              tie_word_embeddings=True, max_position_embeddings=4096,
                              attention_bias=True),
    # Qwen/Qwen2.5-3B config.json (configs/search_r1_*.yaml; Search-R1's BASE_MODEL)
    "Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=32768,
                       attention_bias=True),
    # Qwen/Qwen2.5-7B config.json (docs/deploy.md's sizing table)
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=131072,
                       attention_bias=True),
    # meta-llama/Llama-3.2-3B config.json
    "Llama-3.2-3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, attention_bias=False),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (configs/smollm2.yaml imports it as
    # runs/smollm2)
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, attention_bias=False),
}

# Directory names that stand for a known model: the Instruct variants have the base's shape,
# and configs/smollm2.yaml's `runs/smollm2` is SmolLM2-135M-Instruct.
ALIASES: dict[str, str] = {
    **{f"{name}-instruct".lower(): name for name in KNOWN_MODELS},
    "smollm2": "SmolLM2-135M",
}

# Retrieval encoders, by the name build-index records (manifest `encoder_name`) or the
# directory's name: BERT-shaped, so parameters follow from these fields.
KNOWN_ENCODERS: dict[str, dict[str, int]] = {
    # intfloat/e5-base-v2 config.json (Search-R1's wiki-18 encoder; configs/search_r1_*.yaml)
    "e5-base-v2": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       vocab_size=30522, max_position_embeddings=512),
    # sentence-transformers/all-MiniLM-L6-v2 config.json (the demo's encoder)
    "all-MiniLM-L6-v2": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                             vocab_size=30522, max_position_embeddings=512),
}

# wiki-18 as Search-R1 ships it (wiki-18.jsonl, e5-base-v2 embeddings): what configs/search_r1_*
# index when no index has been built here to read its manifest.
WIKI18_ROWS = 21_015_324
WIKI18_DIM = 768


def lookup_model(name: str) -> tuple[str, dict[str, Any]] | None:
    """(canonical name, config fields) for a directory or repository name, or None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    for key in KNOWN_MODELS:
        if key.lower() == base.lower():
            return key, KNOWN_MODELS[key]
    alias = ALIASES.get(base.lower())
    return (alias, KNOWN_MODELS[alias]) if alias else None


def lookup_encoder(name: str) -> tuple[str, dict[str, int]] | None:
    base = name.rstrip("/").rsplit("/", 1)[-1].lower().replace("_", "-")
    for key, fields in KNOWN_ENCODERS.items():
        if key.lower() in base:
            return key, fields
    return None
