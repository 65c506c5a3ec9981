"""bench/real_model.py end to end at toy size: the imported SmolLM2, a synthetic world, a real
retriever process, the agent loop; the report's fields and the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_zero_shot_bench_reports_the_recipe_figures(smollm2_dir, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    # the session's import is reused (same source file): the bench does not import again
    (out / "smollm2-135m-instruct").symlink_to(smollm2_dir)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "real_model.py"), "--out", str(out),
         "--questions", "3", "--max-turns", "1", "--tokens-per-turn", "16", "--batch", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("zero_shot_em: ")
    result = json.loads((out / "zero_shot.json").read_text())
    assert result["questions"] == 3 and 0.0 <= result["em"] <= 1.0
    assert sum(result["finish_reasons"].values()) == 3
    assert result["response_tokens_per_question"] > 0 and result["examples"]


def _gpu_modules():
    gpu = str(REPO / "bench" / "gpu")
    if gpu not in sys.path:
        sys.path.insert(0, gpu)
    import real_learn_part
    import run as gpu_run

    return gpu_run, real_learn_part


def test_gpu_check_runs_real_learn_only_when_asked():
    """The GPU check's real_learn part: out of the default parts (its budget would not fit
    them), known to --parts, and summarised in one headline row."""
    gpu_run, _ = _gpu_modules()
    names = [p[0] for p in gpu_run.PARTS]
    assert "real_learn" in names and gpu_run.OPTIONAL == {"real_learn"}
    part = {"part": "real_learn", "results": [{
        "device": "cuda", "wall_s": 500.0, "em_gain": 17.2, "zero_shot": {"em": 0.0},
        "runs": {"full": {"sft_start": {"em": 0.1, "searches_per_question": 0.5},
                          "end": {"em": 0.3, "searches_per_question": 1.2}}}}]}
    (what, figure), = gpu_run.headline_rows(part)
    assert what.startswith("real_learn") and "em_gain 17.2" in figure
    assert "full: EM 10.0% -> 30.0%, searches 0.5 -> 1.2" in figure


def test_gguf_pieces_are_joined_and_checked(tmp_path, monkeypatch):
    """The model travels to the GPU machine in pieces (one call carries 64 MiB, the GGUF file is
    94 MiB): joined in name order, refused when the sha256 is not the packaged file's."""
    import hashlib

    _, part = _gpu_modules()
    monkeypatch.delenv("FORAGE_SMOLLM2_DIR", raising=False)
    monkeypatch.delenv("FORAGE_SMOLLM2_GGUF", raising=False)
    repo = tmp_path / "repo"
    for folder, name, data in (("smollm2-gguf2", "m.gguf.part-1", b"world"),
                               ("smollm2-gguf1", "m.gguf.part-0", b"hello ")):
        (repo / "bench" / "gpu" / folder).mkdir(parents=True)
        (repo / "bench" / "gpu" / folder / name).write_bytes(data)
    monkeypatch.setattr(part, "REPO", repo)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(part, "GGUF_SHA256", hashlib.sha256(b"hello world").hexdigest())
    flags, note = part.model_source(work)
    assert flags == ["--gguf", str(work / "m.gguf")] and "2 pieces" in note
    assert (work / "m.gguf").read_bytes() == b"hello world"
    monkeypatch.setattr(part, "GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="missing or stale"):
        part.model_source(work)
    monkeypatch.setenv("FORAGE_SMOLLM2_DIR", "/models/smollm2")
    assert part.model_source(work)[0] == ["--model-dir", "/models/smollm2"]


def _real_learn():
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import real_learn

    return real_learn


def test_real_learn_sizes_follow_the_device_and_the_flags():
    """`--size auto` is the GPU profile on CUDA and the 60-minute CPU profile elsewhere; the
    CPU profile's short SFT teaches searching (good demonstrations only), its GRPO drops
    constant-reward groups and plays on one vLLM replica with configs/vllm_cpu.yaml's settings
    (two replicas on the transformers engine), the GPU profile keeps the demo's mix unfiltered
    on one transformers replica; a flag given wins over its profile."""
    from services.common.config import load_config

    rl = _real_learn()
    cpu = rl.make_parser().parse_args([])
    rl.resolve_sizes(cpu, "cpu")
    assert cpu.size == "cpu" and (cpu.rl_steps, cpu.groups, cpu.samples) == (16, 4, 4)
    sets = rl.run_overrides(cpu, "cpu")
    assert "data.sft_mix=good=1.0" in sets and "learner.eval_every=0" in sets
    assert "learner.micro_batch_tokens=1024" in sets
    assert "learner.algorithm.filter_groups=true" in sets   # DAPO's dynamic sampling
    assert cpu.engine == "vllm" and cpu.rollouts == 1
    assert not any(s.startswith("rollout.groups_per_batch") for s in sets)
    rollout = load_config(rl.BASE_CONFIG, sets).rollout
    import yaml

    for key, value in yaml.safe_load(rl.VLLM_CPU_CONFIG.read_text())["rollout"].items():
        assert getattr(rollout, key) == value, key
    # the transformers engine: two replicas, each holding its half of the 8 groups in flight
    hf = rl.make_parser().parse_args(["--engine", "transformers"])
    rl.resolve_sizes(hf, "cpu")
    sets = rl.run_overrides(hf, "cpu")
    assert hf.rollouts == 2 and "rollout.groups_per_batch=4" in sets
    assert load_config(rl.BASE_CONFIG, sets).rollout.groups_per_batch == 4
    assert load_config(rl.BASE_CONFIG, sets).rollout.engine == "transformers"
    mixed = rl.make_parser().parse_args(["--sft-mix", "good=0.5,guess=0.5", "--no-filter-groups"])
    rl.resolve_sizes(mixed, "cpu")
    sets = rl.run_overrides(mixed, "cpu")
    assert "data.sft_mix=good=0.5,guess=0.5" in sets
    assert "learner.algorithm.filter_groups=false" in sets
    gpu = rl.make_parser().parse_args(["--rl-steps", "12", "--sft-lr", "3e-5"])
    rl.resolve_sizes(gpu, "cuda")
    assert gpu.size == "gpu" and gpu.rl_steps == 12 and gpu.sft_lr == 3e-5 and gpu.sft_steps == 200
    sets = rl.run_overrides(gpu, "cuda")
    assert not any(s.startswith("data.sft_mix=") for s in sets)
    assert "learner.eval_every=6" in sets and "learner.algorithm.filter_groups=false" in sets
    assert gpu.rollouts == 1 and not any(s.startswith("rollout.groups_per_batch") for s in sets)
    assert gpu.engine == "transformers" and "rollout.engine=transformers" in sets
    quick = rl.make_parser().parse_args(["--quick", "--rollouts", "2"])
    rl.resolve_sizes(quick, "cuda")
    assert quick.size == "quick" and quick.questions == 4
    # synchronous (max_staleness 0): one group in flight, held by one replica at a time
    assert "rollout.groups_per_batch=1" in rl.run_overrides(quick, "cuda")
    with pytest.raises(SystemExit, match="--rollouts must be at least 1"):
        rl.resolve_sizes(rl.make_parser().parse_args(["--rollouts", "0"]), "cpu")
    # greedy evaluation by default (Search-R1's); --eval-samples k samples k at temperature 1
    assert "learner.eval_samples=1" in sets and "learner.eval_temperature=0.0" in sets
    sampled = rl.make_parser().parse_args(["--eval-samples", "4"])
    rl.resolve_sizes(sampled, "cpu")
    learner = load_config(rl.BASE_CONFIG, rl.run_overrides(sampled, "cpu")).learner
    assert (learner.eval_samples, learner.eval_temperature) == (4, 1.0)


def test_real_learn_reads_em_per_question_kind_from_an_evaluation():
    """The report splits held-out EM by the world's question kinds (single-hop, two-hop):
    the learner logs `eval/em/<kind>` and `eval/n/<kind>`, `eval/em/mean` is not a kind."""
    rl = _real_learn()
    row = {"eval/em": 0.6667, "eval/em/mean": 0.6667, "eval/em/synth_multihop": 0.0,
           "eval/em/synth_single": 1.0, "eval/n/synth_multihop": 16, "eval/n/synth_single": 32,
           "eval/n": 48}
    assert rl.eval_by_kind(row) == {"synth_multihop": {"em": 0.0, "n": 16},
                                    "synth_single": {"em": 1.0, "n": 32}}
    assert rl.eval_by_kind({"eval/em": 0.5}) == {}


def test_real_learn_reads_sampled_em_per_kind_with_the_filtered_groups():
    """The sampled EM per kind over the first and last steps counts the groups the filter
    dropped (`generated/*`, weighted by their counts); a run without the filter has only the
    batch's `em/<kind>`, averaged over the steps with no count."""
    rl = _real_learn()
    filtered = [
        {"em/synth_multihop": 0.5, "generated/em/synth_multihop": 0.25,
         "generated/n/synth_multihop": 8, "generated/em/synth_single": 1.0,
         "generated/n/synth_single": 8, "generated/em/mean": 0.625},
        {"em/synth_multihop": 0.5, "generated/em/synth_multihop": 0.0,
         "generated/n/synth_multihop": 4},
        {"em/synth_multihop": 0.5, "generated/em/synth_multihop": 0.75,
         "generated/n/synth_multihop": 4},
    ]
    assert rl.sampled_em_by_kind(filtered, 2) == {
        "synth_multihop": {"first": round(2 / 12, 3), "n_first": 12, "last": 0.375,
                           "n_last": 8},
        "synth_single": {"first": 1.0, "n_first": 8, "last": None, "n_last": None}}
    plain = [{"em/synth_single": 1.0, "em/mean": 0.8}, {"em/synth_single": 0.5}]
    assert rl.sampled_em_by_kind(plain, 1) == {
        "synth_single": {"first": 1.0, "n_first": None, "last": 0.5, "n_last": None}}


@pytest.mark.slow
def test_real_learn_reads_the_search_again_decision_of_a_real_model(smollm2_dir, tmp_path):
    """hop_decisions: after the first passage of each held-out good demonstration, the two
    texts part at one token; its probability under SmolLM2 is a probability, the greedy flag
    agrees with it, the demonstrated next turn (many tokens) is no likelier than its first
    token, and rows that are not good two-turn demonstrations are left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rl = _real_learn()
    first = {"text": "<think> I need to find Ronam Tokim. </think>\n<search> Ronam Tokim </search>",
             "trainable": True}
    passage = {"text": "\n\n<information>Doc 1(Title: \"Ronam Tokim\") Born in Bemi, Ronam Tokim "
                       "is a pilot.</information>\n\n", "trainable": False}
    last = {"text": "<think> The passage says Bemi. </think>\n<answer> Bemi </answer>",
            "trainable": True}

    def row(source: str, strategy: str, segments: list[dict]) -> dict:
        question = "In which country was Ronam Tokim born?" if "multi" in source else \
            "In which city was Ronam Tokim born?"
        return {"data_source": source, "prompt": [{"role": "user", "content": question}],
                "segments": segments, "extra_info": {"strategy": strategy}}

    rows = [row("synth_single", "good", [first, passage, last]),
            row("synth_multihop", "good", [first, passage, last]),
            row("synth_multihop", "guess", [first, passage, last]),
            row("synth_single", "good", [last])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft_heldout.parquet")
    found = rl.hop_decisions(smollm2_dir, tmp_path, "cpu")
    assert set(found) == {"synth_single", "synth_multihop"}
    for kind in found.values():
        assert kind["n"] == 1 and 0.0 <= kind["p_search_again"] <= 1.0
        assert 0.0 <= kind["p_demonstrated_turn"] <= 1.0
        assert kind["greedy_searches_again"] in (0.0, 1.0)
    # the single-hop row's next turn starts with " The", the search-again token's rival
    single = found["synth_single"]
    assert single["p_demonstrated_turn"] <= 1.0 - single["p_search_again"] + 1e-6
    for kind in found.values():
        if kind["p_search_again"] > 0.5:
            assert kind["greedy_searches_again"] == 1.0


def test_real_learn_reuses_a_world_only_when_built_from_the_same_settings(tmp_path):
    rl = _real_learn()
    args = rl.make_parser().parse_args(["--quick"])
    rl.resolve_sizes(args, "cpu")
    world = tmp_path / "world"
    (world / "index").mkdir(parents=True)
    for name in ("test.parquet", "sft.parquet"):
        (world / name).write_text("")
    overrides = rl.run_overrides(args, "cpu")
    from services.common.config import load_config

    cfg = load_config(rl.BASE_CONFIG, overrides)
    (world / "real_learn_world.json").write_text(rl.world_stamp(cfg))
    assert rl.build_world(world, overrides, tmp_path) == 0.0  # reused: nothing ran
    assert rl.world_stamp(load_config(rl.BASE_CONFIG, [*overrides, "data.sft_mix=good=1.0"])) \
        != rl.world_stamp(cfg)
