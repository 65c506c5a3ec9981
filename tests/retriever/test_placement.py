"""retriever.encoder_device / index_device / index_gpu_mode: validated, following
retriever.device by default, and refused at start when the install cannot place them.

This machine has a CPU torch and faiss-cpu, so the GPU placements are checked only as far as
their refusal and the cloner options handed to faiss (with a stand-in faiss module)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from services.common.config.retriever import RetrieverSection
from services.retriever.indexes import FAISS_FILE, DeviceError, _to_gpus, load_dense
from services.retriever.manifest import IndexLoadError
from services.retriever.searcher import Searcher, check_device, check_placement


def test_defaults_follow_device() -> None:
    settings = RetrieverSection()
    assert (settings.encoder_device, settings.index_device) == (None, None)
    assert settings.encoder_placement == settings.index_placement == "cpu"
    assert settings.index_gpu_mode == "shard"
    gpu = RetrieverSection(device="cuda:1")
    assert gpu.encoder_placement == gpu.index_placement == "cuda:1"
    split = RetrieverSection(device="cpu", encoder_device="cuda:0", index_device="cuda:all",
                             index_gpu_mode="replicate")
    assert (split.encoder_placement, split.index_placement) == ("cuda:0", "cuda:all")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("encoder_device", "cuda:all", "the encoder runs on one device"),
    ("encoder_device", "gpu", "unknown device 'gpu' (use cpu, cuda or cuda:N)"),
    ("index_device", "cuda:x", "unknown device 'cuda:x' (use cpu, cuda, cuda:N or cuda:all)"),
    ("index_device", "cpu:0", "unknown device 'cpu:0'"),
    ("index_gpu_mode", "mirror", "'shard' or 'replicate'"),
])
def test_bad_placement_is_named(key, value, message) -> None:
    with pytest.raises(ValidationError) as caught:
        RetrieverSection(**{key: value})
    assert key in str(caught.value) and message in str(caught.value)


def test_check_placement_without_split_is_check_device() -> None:
    for call in (lambda: check_device("cuda", "flat"), lambda: check_placement("cuda", "flat")):
        with pytest.raises(DeviceError) as caught:
            call()
        assert str(caught.value).startswith("retriever.device cuda cannot be used: ")
    check_placement("cpu", "flat")


def test_check_placement_names_the_half_that_cannot_run() -> None:
    check_placement("cuda", "flat", encoder_device="cpu", index_device="cpu")
    check_placement("cpu", "bm25", encoder_device="cuda", index_device="cuda:all")
    with pytest.raises(DeviceError) as caught:
        check_placement("cpu", "flat", index_device="cuda:all")
    message = str(caught.value)
    assert message.startswith("retriever.index_device cuda:all cannot be used: faiss ")
    assert "no GPU support" in message and "torch" not in message
    with pytest.raises(DeviceError) as caught:
        check_placement("cpu", "flat", encoder_device="cuda:0")
    message = str(caught.value)
    assert message.startswith("retriever.encoder_device cuda:0 cannot be used: torch ")
    assert "faiss" not in message
    with pytest.raises(DeviceError) as caught:  # device cuda, encoder moved to cpu
        check_placement("cuda", "flat", encoder_device="cpu")
    assert str(caught.value).startswith("retriever.device cuda cannot be used: faiss ")
    with pytest.raises(DeviceError, match="faiss has no GPU implementation of HNSW"):
        check_placement("cpu", "hnsw", index_device="cuda")
    with pytest.raises(DeviceError, match=r"retriever.index_device: unknown device 'tpu'"):
        check_placement("cpu", "flat", index_device="tpu")


def test_searcher_places_encoder_and_index_apart_on_cpu(flat_index) -> None:
    searcher = Searcher.load(flat_index, device="cuda", encoder_device="cpu", index_device="cpu")
    assert searcher.search_many(["castle"], [2])[0]
    with pytest.raises(IndexLoadError, match="device cuda:all: faiss .* has no GPU support"):
        Searcher.load(flat_index, encoder_device="cpu", index_device="cuda:all")


def test_load_dense_checks_gpu_mode(flat_index) -> None:
    with pytest.raises(DeviceError, match="index_gpu_mode 'mirror'"):
        load_dense(flat_index / FAISS_FILE, "flat", {}, device="cpu", gpu_mode="mirror")
    assert load_dense(flat_index / FAISS_FILE, "flat", {}, gpu_mode="replicate").ntotal > 0


def test_gpu_cloner_options_shard_or_replicate() -> None:
    """What load_dense hands faiss on a GPU build, with a stand-in for faiss's GPU API."""
    calls = []
    fake = SimpleNamespace(
        GpuMultipleClonerOptions=lambda: SimpleNamespace(useFloat16=False, shard=False),
        index_cpu_to_all_gpus=lambda index, co: calls.append(("all", co.shard, co.useFloat16)),
        index_cpu_to_gpus_list=lambda index, co, gpus: calls.append((gpus, co.shard,
                                                                     co.useFloat16)),
    )
    _to_gpus(fake, object(), None, "shard")
    _to_gpus(fake, object(), None, "replicate")
    _to_gpus(fake, object(), 2, "shard")
    assert calls == [("all", True, True), ("all", False, True), ([2], True, True)]


def test_serve_refuses_a_cuda_index_device_on_faiss_cpu(tools, flat_index, tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"retriever:\n  index_dir: {flat_index}\n  encoder_device: cpu\n"
                      "  index_device: cuda:all\n  index_gpu_mode: replicate\n  port: 0\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([tools.forage, "retriever", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 2
    line = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert line.startswith(
        "forage retriever serve: error: retriever.index_device cuda:all cannot be used: faiss ")
    assert "no GPU support" in line and "Traceback" not in result.stderr
