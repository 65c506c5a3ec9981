"""Random-weight model directories of a given shape, built once per machine and reused.

A directory holds a Qwen2 causal LM of one of `common.SHAPES` (bf16 on CUDA, float32 on CPU)
and the tiny policy's tokenizer, so the learner, the transformers engine and the weight-sync
server all load it the way they load a real checkpoint. The tokenizer's vocabulary is smaller
than the model's: ids it does not know decode to nothing, which is all the rollout part needs
(it disables EOS and never parses the text).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from common import qwen2_config, torch_device

MARKER = ".complete"
# The tiny policy's own model files; everything else in its directory is the tokenizer.
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "forage_policy.json"}


def cache_root() -> Path:
    return Path(os.environ.get("FORAGE_GPU_CACHE", Path(tempfile.gettempdir()) / "forage-gpu"))


def tokenizer_dir() -> Path:
    from services.tasks.tiny_policy import make_test_policy

    return make_test_policy(cache_root() / "tiny-policy")


def shaped_model(shape: str) -> Path:
    """`cache_root()/models/<shape>`: random weights of `shape` plus a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    out = cache_root() / "models" / shape
    if (out / MARKER).exists():
        return out
    device = torch_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute of CPU
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=dtype)
    staging = Path(tempfile.mkdtemp(prefix=f".{shape}.", dir=out.parent if out.parent.exists()
                                    else _mkdir(out.parent)))
    model.save_pretrained(staging)
    tokenizer = tokenizer_dir()
    for name in os.listdir(tokenizer):
        if name not in MODEL_FILES and not name.startswith("."):
            shutil.copy(tokenizer / name, staging / name)
    (staging / MARKER).touch()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    del model
    return out


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
