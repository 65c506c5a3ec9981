"""Forage's GRPO side by side with Hugging Face TRL's GRPOTrainer on the same work.

Task (a), single-turn: the synthetic world's questions with a good demonstration's searches and
retrieved passages already in the prompt (the Search-R1 prompt rendered with the chat template,
then the demonstration's turns up to and including its last `<information>` block, as one plain
string); the policy writes the final `<think>...</think>\\n<answer>...</answer>` turn. Both tools
start from the same SFT warm-started tiny Qwen2 policy (a policy that never earns reward would
make the comparison meaningless), take the same prompts in the same order, sample the same group
size and batch, train with the same loss and optimiser settings and score with the same reward
function: Forage through its scorer service, TRL by calling the scorer's Python code in-process.

Forage runs as `forage up` (learner, scorer, rollout, Redis on loopback; asynchronous with
max_staleness 1 as the demo, then synchronous), TRL as one `GRPOTrainer` process. Each run is
timed from its step timestamps, its process tree's memory is sampled with psutil, and
checkpoints saved along the way are evaluated afterwards by ONE evaluator (greedy EM on held-out
prompts of the same kind), outside the timed part: after the same number of steps and after the
same wall time. Last line: `ratio: <forage steps/min / trl steps/min>` (asynchronous Forage).

    .venv/bin/python bench/peer_trl.py                    # builds (or reuses) the warm start
    .venv/bin/python bench/peer_trl.py --policy runs/demo/sft/policy --steps 30

Needs the `bench` extra (pip install -e '.[bench]': TRL, pinned). Settings table, figures and
the task (b) analysis: bench/README.md, "GRPO side by side with TRL".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "peer_trl.yaml"
CACHE = Path(tempfile.gettempdir()) / "forage-peer-trl"
TRL_VERSION = "1.16.0"  # the version whose GRPOTrainer source the settings below were read from


class BenchError(RuntimeError):
    """A user-facing problem: printed as one line, exit 2."""


# ---------------------------------------------------------------------------- the warm start

def warm_start(policy: str | None, world: str | None) -> tuple[Path, Path, str]:
    """(world dir, policy dir, what was used). Without --policy, the demo's phases 1-3 (world,
    tiny policy, SFT) are built once into CACHE and reused, as `forage demo` reuses them."""
    if policy:
        policy_dir = Path(policy).resolve()
        if not (policy_dir / "config.json").is_file():
            raise BenchError(f"--policy {policy}: no config.json there (a transformers model "
                             "directory, e.g. a finished `forage demo --out DIR`'s DIR/sft/policy)")
        candidates = [Path(world)] if world else [policy_dir.parent.parent / "world",
                                                  policy_dir.parent / "world"]
        for candidate in candidates:
            if (candidate / "world.json").is_file() and (candidate / "index").is_dir():
                return candidate.resolve(), policy_dir, f"given: {policy_dir}"
        raise BenchError(f"no synthetic world next to --policy {policy} (looked for "
                         f"{', '.join(str(c) for c in candidates)}); pass --world DIR")
    from services.common.config import load_config
    from services.launch.demo import DEMO_CONFIG, prepare

    out = CACHE / "warmstart"
    cfg = load_config(DEMO_CONFIG, [])
    started = time.monotonic()
    _, policy_dir = prepare(cfg, DEMO_CONFIG, [], out)
    took = time.monotonic() - started
    how = "reused" if took < 30 else f"built in {took:.0f} s"
    return out / "world", policy_dir, (f"the demo's warm start ({how}, world seed "
                                       f"{cfg.data.seed}, configs/demo.yaml's SFT) in {out}")


# ---------------------------------------------------------------------------- task (a)

def render_prompt(tokenizer: Any, question: str, segments: list[dict[str, Any]]) -> str:
    """The chat-templated Search-R1 prompt + every segment before the final answer turn."""
    from services.common.formats import search_r1_prompt

    messages = [{"role": "user", "content": search_r1_prompt(question)}]
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        head = messages[0]["content"]
    return head + "".join(str(s["text"]) for s in segments[:-1])


def build_task(world: Path, policy: Path, seed: int) -> dict[str, Path]:
    """train.parquet (in one seeded order, read unshuffled by both tools) and test.parquet."""
    import numpy as np
    from transformers import AutoTokenizer

    from services.retriever.searcher import Searcher
    from services.tasks.datasets import load_rows, write_rows
    from services.tasks.sft import DemoBuilder, prefetch

    # the prompts are rendered with the policy's chat template: another policy, other prompts
    key = hashlib.sha256(f"{world}|{seed}|{policy}".encode()).hexdigest()[:10]
    out = CACHE / f"task-a-{key}"
    files = {"train": out / "train.parquet", "test": out / "test.parquet"}
    stamp = out / "source.json"
    source = {"world": str(world), "mtime": (world / "world.json").stat().st_mtime, "seed": seed,
              "policy": str(policy)}
    if all(p.exists() for p in files.values()) and stamp.exists() and \
            json.loads(stamp.read_text()) == source:
        return files
    meta = json.loads((world / "world.json").read_text())
    topk = int(meta.get("recommended_topk", 1))
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    search = prefetch(Searcher.load(world / "index"), meta, topk)
    builder = DemoBuilder(search, meta, topk, seed)
    for split, path in files.items():
        rows = []
        for row in load_rows(world / f"{split}.parquet"):
            extra = row["extra_info"]
            question = {"question": extra["question"], "answer_type": extra["answer_type"],
                        "subject": extra["subject"], "relation": extra["relation"],
                        "hops": extra["hops"],
                        "answer": row["reward_model"]["ground_truth"]["target"][0]}
            segments, _, searches = builder.play(question, "good")
            rows.append({"data_source": row["data_source"],
                         "prompt": render_prompt(tokenizer, extra["question"], segments),
                         "reward_model": row["reward_model"],
                         "extra_info": {"split": split, "index": extra["index"],
                                        "question": extra["question"], "searches": searches}})
        if split == "train":
            rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
        write_rows(path, rows)
    stamp.write_text(json.dumps(source))
    return files


# ---------------------------------------------------------------------------- measuring

@dataclass
class MemoryPeak:
    rss_bytes: int = 0
    pss_bytes: int = 0
    processes: int = 0


class TreeMemory:
    """Peak of the summed memory of a process and all its descendants, sampled with psutil.
    PSS (proportional set size) splits shared pages between the processes mapping them, so the
    sum counts libtorch once however many services load it; RSS sums count it every time."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak = MemoryPeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = pss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        peak = self.peak
        peak.rss_bytes, peak.pss_bytes = max(peak.rss_bytes, rss), max(peak.pss_bytes, pss)
        peak.processes = max(peak.processes, len(procs))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)


@dataclass
class RunResult:
    """One tool's run: step timestamps (seconds since its launch), generated tokens and mean
    reward per step, checkpoints {step: (seconds since launch, policy dir)}."""
    name: str
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    trajectories_per_step: int = 0
    checkpoints: dict[int, tuple[float, str]] = field(default_factory=dict)
    wall_s: float = 0.0
    memory: MemoryPeak = field(default_factory=MemoryPeak)
    load_before: float = 0.0
    load_after: float = 0.0
    # mean seconds per step of each phase, steps 2.. (Forage: the learner's timing/*; TRL: the
    # wrapped trainer methods)
    phases: dict[str, float] = field(default_factory=dict)

    def add_phases(self, per_step: list[dict[str, float]]) -> None:
        rows = per_step[1:] or per_step
        for key in sorted({k for row in rows for k in row}):
            self.phases[key] = sum(row.get(key, 0.0) for row in rows) / max(1, len(rows))

    def steps_per_min(self) -> float:
        """Steady rate between the first and the last step (start-up and step 1 excluded)."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return math.nan
        return 60.0 * (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def rates(self) -> dict[str, float]:
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else math.nan
        tokens = sum(self.tokens[1:])
        return {"steps_per_min": self.steps_per_min(),
                "s_per_step": 60.0 / self.steps_per_min(),
                "trajectories_per_s": self.trajectories_per_step * (len(self.times) - 1) / span,
                "gen_tokens_per_s": tokens / span,
                "end_to_end_steps_per_min": 60.0 * len(self.times) / self.wall_s}


def _launch(argv: list[str], log_path: Path, env: dict[str, str], result: RunResult) -> float:
    """Run argv to completion with memory sampling; returns its launch time (monotonic)."""
    result.load_before = os.getloadavg()[0]
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        with TreeMemory(proc.pid) as memory:
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                proc.terminate()
                proc.wait()
                raise
    result.wall_s = time.monotonic() - started
    result.memory = memory.peak
    result.load_after = os.getloadavg()[0]
    if code != 0:
        tail = "\n    ".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise BenchError(f"{result.name} exited {code}; log {log_path}:\n    {tail}")
    return started


# ---------------------------------------------------------------------------- Forage

def forage_env(threads: int = 0) -> dict[str, str]:
    """The environment of `forage up`: its own DeepSpeed JIT-extension folder. On CPU the
    learner's DeepSpeed init compiles the shm_comm op (C++, about a minute on 2 cores) into
    TORCH_EXTENSIONS_DIR, behind a lock file; a build killed elsewhere on the machine leaves that
    lock behind and every later learner sharing the folder waits on it forever (seen here)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["TORCH_EXTENSIONS_DIR"] = str(CACHE / "torch_extensions")
    if threads:  # every child of `forage up` gets this many (services/common/threads.py)
        env["FORAGE_THREADS"] = str(threads)
    return env


def prebuild_deepspeed_ops() -> float:
    """Compile DeepSpeed's CPU shm_comm op once, outside the timed runs; returns seconds."""
    started = time.monotonic()
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    done = subprocess.run([sys.executable, "-c", code], env=forage_env(), cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"building DeepSpeed's shm_comm op failed: {done.stderr[-500:]}")
    return time.monotonic() - started


def run_forage(policy: Path, task: dict[str, Path], out: Path, steps: int, staleness: int,
               save_every: int, threads: int = 0, seed: int | None = None,
               overrides: list[str] | None = None) -> RunResult:
    from services.common.config import load_config

    name = f"forage (max_staleness {staleness})"
    run_dir = out / f"forage-s{staleness}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sets = [f"run_dir={run_dir}", f"model.path={policy}",
            f"data.train_files=[{task['train']}]", f"data.test_files=[{task['test']}]",
            f"learner.total_steps={steps}", f"learner.max_staleness={staleness}",
            *([] if seed is None else [f"learner.seed={seed}", f"rollout.seed={seed}"]),
            f"learner.save_every={save_every}", f"learner.checkpoint_dir={run_dir / 'ckpt'}",
            f"redis.namespace=peer-trl-{time.strftime('%Y%m%d-%H%M%S')}-s{staleness}",
            "learner.weight_sync_port=0", "learner.metrics_port=0", "scorer.port=0",
            "scorer.metrics_port=0", *(overrides or [])]
    cfg = load_config(CONFIG, sets)
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(CONFIG),
            *[a for s in sets for a in ("--set", s)]]
    result = RunResult(name, trajectories_per_step=cfg.learner.train_batch_size * cfg.data.n_samples)
    env = forage_env(threads)
    started_wall = time.time()
    started = _launch(argv, run_dir / "up.log", env, result)
    del started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    phases = []
    for rec in (r for r in records if r.get("kind") == "train"):
        phases.append({k.split("/")[1][:-2]: float(v) for k, v in rec.items()
                       if k.startswith("timing/") and k.endswith("_s") and k != "timing/step_s"})
        result.steps.append(int(rec["step"]))
        result.times.append(float(rec["time"]) - started_wall)
        result.tokens.append(float(rec.get("policy_tokens/mean", 0.0))
                             * float(rec.get("throughput/trajectories", 0)))
        result.rewards.append(float(rec.get("reward/mean", math.nan)))
    result.add_phases(phases)
    at = dict(zip(result.steps, result.times, strict=True))
    for step_dir in sorted((run_dir / "ckpt").glob("step_*")):
        step = int(step_dir.name.split("_")[1])
        if (step_dir / "policy" / "config.json").exists() and step in at:
            result.checkpoints[step] = (at[step], str(step_dir / "policy"))
    if len(result.steps) != steps:
        raise BenchError(f"{name}: {len(result.steps)} of {steps} steps in {run_dir}/metrics.jsonl")
    return result


# ---------------------------------------------------------------------------- TRL

def trl_settings(policy: Path, task: dict[str, Path], out: Path, steps: int, save_every: int,
                 per_device: int, seed: int | None = None,
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """GRPOConfig values derived from configs/peer_trl.yaml (the table in bench/README.md),
    with the same `--set` overrides Forage's run gets."""
    from services.common.config import load_config

    cfg = load_config(CONFIG, list(overrides or []))
    lrn, alg = cfg.learner, cfg.learner.algorithm
    batch = lrn.train_batch_size * cfg.data.n_samples  # completions per optimizer step
    if batch % per_device:
        raise BenchError(f"--trl-micro-batch {per_device} must divide {batch} completions")
    if alg.get("loss_agg_mode", "token-mean") != "token-mean" or lrn.adv_estimator != "grpo":
        raise BenchError("configs/peer_trl.yaml must use grpo with loss_agg_mode token-mean")
    return {
        "policy": str(policy), "train": str(task["train"]), "out": str(out / "trl"),
        "stop_strings": list(cfg.rollout.stop_strings),
        "grpo": {
            "output_dir": str(out / "trl"), "use_cpu": True, "bf16": False, "fp16": False,
            "use_vllm": False, "seed": lrn.seed if seed is None else seed,
            "data_seed": lrn.seed if seed is None else seed,
            "max_steps": steps, "num_train_epochs": 1,
            "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": batch // per_device,
            "num_generations": cfg.data.n_samples,
            "max_completion_length": cfg.rollout.max_tokens_per_turn,
            "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
            "top_k": cfg.rollout.top_k, "num_iterations": lrn.ppo_epochs,
            "learning_rate": lrn.lr, "lr_scheduler_type": lrn.lr_schedule,
            "warmup_steps": lrn.warmup_steps, "weight_decay": lrn.weight_decay,
            "adam_beta1": lrn.betas[0], "adam_beta2": lrn.betas[1],
            "max_grad_norm": lrn.grad_clip, "optim": "adamw_torch",
            # TRL's default is True (GRPOConfig); Forage's model.gradient_checkpointing is off
            "gradient_checkpointing": cfg.model.gradient_checkpointing,
            "beta": 0.0, "loss_type": "dapo", "scale_rewards": "group"
            if alg.get("norm_adv_by_std", True) else "none",
            "epsilon": float(alg.get("clip_ratio_low", 0.2)),
            "epsilon_high": float(alg.get("clip_ratio_high", 0.28)),
            "mask_truncated_completions": False, "shuffle_dataset": False,
            "logging_steps": 1, "save_strategy": "steps", "save_steps": save_every,
            "report_to": [], "disable_tqdm": True, "dataloader_num_workers": 0,
            "log_completions": False,
        },
    }


def run_trl(settings: dict[str, Any], out: Path) -> RunResult:
    run_dir = Path(settings["out"])
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec = run_dir / "spec.json"
    spec.write_text(json.dumps(settings, indent=1))
    grpo = settings["grpo"]
    result = RunResult("trl GRPOTrainer", trajectories_per_step=grpo[
        "per_device_train_batch_size"] * grpo["gradient_accumulation_steps"])
    env = dict(os.environ)
    env["FORAGE_CPU_SHARE"] = "1"  # one process: it gets every usable core (see the README)
    started_wall = time.time()
    _launch([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(spec)],
            run_dir / "trl.log", env, result)
    phases = []
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            gen, total = rec.get("generate_s", 0.0), rec.get("train_step_s", 0.0)
            phases.append({"generate+reward": gen, "reward": rec.get("reward_s", 0.0),
                           "update": total - gen})
            result.steps.append(int(rec["step"]))
            result.times.append(float(rec["time"]) - started_wall)
            result.tokens.append(float(rec.get("tokens", 0.0)))
            result.rewards.append(float(rec.get("reward", math.nan)))
        elif rec["kind"] == "save":
            ckpt = run_dir / f"checkpoint-{rec['step']}"
            result.checkpoints[int(rec["step"])] = (float(rec["time"]) - started_wall, str(ckpt))
    result.add_phases(phases)
    if len(result.steps) != grpo["max_steps"]:
        raise BenchError(f"trl: {len(result.steps)} of {grpo['max_steps']} steps ({run_dir})")
    return result


def trl_worker(spec_path: str) -> int:
    """The TRL process: GRPOTrainer with the settings from trl_settings, Forage's reward code."""
    from services.common.threads import apply_thread_policy

    plan = apply_thread_policy()  # before torch: same policy as a forage process (PASSIVE)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.scorer.scoring import Scorer, ScoreRequest
    from services.tasks.datasets import load_rows

    settings = json.loads(Path(spec_path).read_text())
    run_dir = Path(settings["out"])
    print(f"threads: {plan.describe()}; torch {torch.get_num_threads()}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(settings["policy"])
    model = AutoModelForCausalLM.from_pretrained(settings["policy"], dtype=torch.float32)
    stop_ids = stop_token_ids(tokenizer, settings["stop_strings"])
    # TRL's transformers path stops only at EOS ids (generate() gets no tokenizer, so no
    # stop_strings): each stop string is one token in this vocabulary, so it becomes an EOS id,
    # which TRL also uses to mask everything after it.
    model.generation_config.eos_token_id = stop_ids
    rows = load_rows(settings["train"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                  "ground_truth": json.dumps(r["reward_model"]["ground_truth"])}
                                 for r in rows])
    scorer = Scorer()
    phases: dict[str, float] = {}  # seconds per phase in the current optimizer step

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    def forage_reward(prompts: list[str], completions: list[str], data_source: list[str],
                      ground_truth: list[str], **_: Any) -> list[float]:
        """The scorer service's own code path (Scorer.score_many), called in-process."""
        requests = [ScoreRequest(s, c, json.loads(g))
                    for s, c, g in zip(data_source, completions, ground_truth, strict=True)]
        start = time.perf_counter()
        scores = [r.score for r in scorer.score_many(requests)]
        phases["reward"] = phases.get("reward", 0.0) + time.perf_counter() - start
        return scores

    log_path = run_dir / "steps.jsonl"

    class StepLog(TrainerCallback):
        """A timestamp per optimizer step (before its log and save, as Forage's step record)
        and per checkpoint; tokens and reward are merged in from the log history after."""

        @staticmethod
        def _write(record: dict[str, Any]) -> None:
            with log_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._write({"kind": "step", "step": state.global_step, "time": time.time(),
                         **{f"{k}_s": v for k, v in phases.items()}})
            phases.clear()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._write({"kind": "save", "step": state.global_step, "time": time.time()})

    grpo = settings["grpo"]
    batch = grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"]
    config = GRPOConfig(**grpo, generation_kwargs={"eos_token_id": stop_ids})
    callback = StepLog()
    trainer = GRPOTrainer(model=model, reward_funcs=[forage_reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    # Profile: generation + reward + advantages ("generate") and the whole step; the update is
    # the difference (TRL's own profiling_context reports only to wandb/mlflow/trackio).
    trainer._generate_and_score_completions = timed(
        "generate", trainer._generate_and_score_completions)
    trainer.training_step = timed("train_step", trainer.training_step)
    trainer.train()
    # on_log runs after on_step_end in this version: merge the metrics into the step lines
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    for rec, hist in zip(steps, logged, strict=False):
        rec["tokens"] = hist["completions/mean_length"] * batch
        rec["reward"] = hist.get("reward", math.nan)
    log_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return 0


def stop_token_ids(tokenizer: Any, stop_strings: list[str]) -> list[int]:
    """EOS plus one id per stop string; a stop string that is not one token is an error (TRL's
    generate path could not stop on it the way Forage's engine does)."""
    ids = [tokenizer.eos_token_id]
    for text in stop_strings:
        pieces = tokenizer.encode(text, add_special_tokens=False)
        if len(pieces) != 1:
            raise BenchError(f"stop string {text!r} is {len(pieces)} tokens in this vocabulary; "
                             "TRL's transformers generation can only stop on single-token EOS ids")
        ids.append(pieces[0])
    return ids


# ---------------------------------------------------------------------------- the evaluator

def evaluate(policy_dir: str, test_file: Path, max_new_tokens: int, stop_strings: list[str],
             batch_size: int = 32) -> list[float]:
    """Greedy held-out EM per question (0 or 1) with the scorer's reward code: the one
    evaluator for both tools. Per question, so two tools can be compared question by question
    (paired_sign_test)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.scorer.scoring import Scorer, ScoreRequest
    from services.tasks.datasets import load_rows

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, stop_strings)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    rows = load_rows(test_file)
    texts: list[str] = []
    for start in range(0, len(rows), batch_size):
        prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False)
                   for r in rows[start:start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=stops,
                                 pad_token_id=pad)
        for seq in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            texts.append(tokenizer.decode(seq[:cut], skip_special_tokens=True))
    scorer = Scorer()
    results = scorer.score_many([
        ScoreRequest(r["data_source"], text, r["reward_model"]["ground_truth"])
        for r, text in zip(rows, texts, strict=True)])
    return [float(r.score) for r in results]


def paired_sign_test(a: list[float], b: list[float]) -> tuple[int, int, float]:
    """Two evaluations of the same questions: how many only `a` got right, how many only `b`,
    and the two-sided exact sign-test p-value of that split (McNemar's exact test). The
    questions both got right or both missed say nothing about which is better."""
    if len(a) != len(b):
        raise ValueError("paired_sign_test needs the same questions on both sides")
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x > 0.5 >= y)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y > 0.5 >= x)
    n = only_a + only_b
    if n == 0:
        return 0, 0, 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n
    return only_a, only_b, min(1.0, 2 * tail)


def checkpoint_at(result: RunResult, *, step: int | None = None,
                  seconds: float | None = None) -> tuple[int, str] | None:
    """The checkpoint at `step`, or the newest one saved at or before `seconds` after launch."""
    if step is not None:
        found = result.checkpoints.get(step)
        return (step, found[1]) if found else None
    eligible = [(s, path) for s, (t, path) in result.checkpoints.items()
                if seconds is not None and t <= seconds]
    return max(eligible) if eligible else None


# ---------------------------------------------------------------------------- report

def compare_answers(results: list[RunResult], scores: dict[str, dict[str, Any]],
                    steps: int) -> list[str]:
    """Each tool's EM curve over its checkpoints, and each Forage run against TRL question by
    question after `steps` steps (paired_sign_test): whether an EM gap is more than noise."""
    lines = []
    for res in results:
        curve = scores[res.name]["em_curve"]
        if curve:
            lines.append(f"  {res.name} EM by step: " + ", ".join(
                f"{step} {100 * value:.1f}%" for step, value in curve.items())
                + f" (mean {100 * statistics.fmean(curve.values()):.1f}%)")
    trl = next((r for r in results if r.name.startswith("trl")), None)
    for res in results:
        if trl is None or res is trl:
            continue
        mine, theirs = scores[res.name]["answers_steps"], scores[trl.name]["answers_steps"]
        if mine and theirs:
            only_f, only_t, p = paired_sign_test(mine, theirs)
            lines.append(f"  {res.name} vs {trl.name} at step {steps}: right only with Forage "
                         f"{only_f}, only with TRL {only_t} of {len(mine)} (sign test p={p:.2f})")
    return lines


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


RATE_HEADER = (f"{'tool':28}{'s/step':>8}{'steps/min':>10}{'traj/s':>8}{'gen tok/s':>10}"
               f"{'peak PSS':>10}")


def _rate_cells(res: RunResult) -> str:
    """A run's columns under RATE_HEADER: its rates and its peak PSS."""
    rates = res.rates()
    return (f"{res.name:28}{_fmt(rates['s_per_step']):>8}{_fmt(rates['steps_per_min']):>10}"
            f"{_fmt(rates['trajectories_per_s']):>8}{_fmt(rates['gen_tokens_per_s'], 1):>10}"
            f"{res.memory.pss_bytes / 2**30:>9.2f}G")


def _load_cell(res: RunResult) -> str:
    return f"{res.load_before:>5.1f}->{res.load_after:<4.1f}"


def _phase_lines(results: list[RunResult]) -> list[str]:
    return [f"  {res.name} per step: " + ", ".join(f"{k} {v:.2f} s" for k, v in
                                                    res.phases.items()) for res in results]


def report(results: list[RunResult], scores: dict[str, dict[str, Any]], base_em: float,
           steps: int, same_time_s: float) -> list[str]:
    lines = [f"held-out greedy EM of the SFT policy (step 0): {100 * base_em:.1f}%",
             f"{RATE_HEADER}{'peak RSS':>10}{'EM@' + str(steps):>9}"
             f"{'EM@' + str(round(same_time_s)) + 's':>12}{'load':>11}"]
    for res in results:
        sc = scores[res.name]
        at_time = sc.get("em_time")
        lines.append(
            f"{_rate_cells(res)}{res.memory.rss_bytes / 2**30:>9.2f}G"
            f"{_fmt(100 * sc['em_steps'], 1):>8}%"
            f"{(_fmt(100 * at_time, 1) + '%@' + str(sc['time_step'])) if at_time is not None else 'n/a':>12}"
            f"{_load_cell(res)}")
    return lines + _phase_lines(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="SFT policy dir (default: build/reuse the demo's)")
    parser.add_argument("--world", help="its synthetic world (default: next to --policy)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per tool (30)")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint interval (5)")
    parser.add_argument("--trl-micro-batch", type=int, default=16,
                        help="TRL per_device_train_batch_size; gradient accumulation makes up "
                             "the step's batch (16)")
    parser.add_argument("--no-sync", action="store_true",
                        help="skip Forage's synchronous run (max_staleness 0)")
    parser.add_argument("--forage-threads", type=int, default=0,
                        help="FORAGE_THREADS for every `forage up` child (0: Forage's default, "
                             "usable cores / 3 processes here, no retriever, at least 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling/initialisation seed of both tools (default: the config's, "
                             "0); the prompts and their order stay the same: repeat runs with "
                             "other seeds to tell a score gap from sampling noise")
    parser.add_argument("--trl-first", action="store_true",
                        help="run TRL before Forage (alternate the order between repeats)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a configs/peer_trl.yaml key for both tools, e.g. "
                             "rollout.max_tokens_per_turn=256 (TRL's max_completion_length "
                             "follows); repeatable")
    parser.add_argument("--no-eval", action="store_true",
                        help="speed only: skip the held-out evaluation of the checkpoints")
    parser.add_argument("--out", default=str(CACHE / "run"), help="run folder")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: _launch then stops the tool it started (its own session)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    try:
        return _bench(args)
    except BenchError as exc:
        print(f"peer_trl: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    try:
        import trl
    except ImportError:
        raise BenchError("TRL is not installed: pip install -e '.[bench]'") from None
    if trl.__version__ != TRL_VERSION:
        print(f"note: TRL {trl.__version__}; the settings were read from {TRL_VERSION}'s source")
    if args.steps < 2 or args.save_every < 1:
        raise BenchError("--steps must be at least 2 and --save-every at least 1")
    from services.common.config import ConfigError, load_config

    try:
        cfg = load_config(CONFIG, args.overrides)
    except ConfigError as exc:
        raise BenchError(f"--set: {exc}") from None
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    world, policy, how = warm_start(args.policy, args.world)
    print(f"policy: {how}", flush=True)
    task = build_task(world, policy, cfg.data.seed)
    print(f"task (a): {task['train']} / {task['test']}", flush=True)
    print(f"DeepSpeed shm_comm op ready ({prebuild_deepspeed_ops():.0f} s, not timed)",
          flush=True)
    results: list[RunResult] = []
    settings = trl_settings(policy, task, out, args.steps, args.save_every, args.trl_micro_batch,
                            args.seed, args.overrides)
    plan = [("forage", 1), ("trl", None)] + ([] if args.no_sync else [("forage", 0)])
    if args.trl_first:
        plan = [plan[1], plan[0], *plan[2:]]
    for tool, staleness in plan:
        print(f"running {tool}{'' if staleness is None else f' max_staleness {staleness}'} "
              f"({args.steps} steps)...", flush=True)
        if tool == "trl":
            results.append(run_trl(settings, out))
        else:
            results.append(run_forage(policy, task, out, args.steps, staleness,
                                      args.save_every, args.forage_threads, args.seed,
                                      args.overrides))
        res = results[-1]
        print(f"  {res.name}: {_fmt(res.steps_per_min())} steps/min, wall {res.wall_s:.0f} s",
              flush=True)
    trl_rate = next(r for r in results if r.name.startswith("trl")).steps_per_min()
    forage_async = next(r for r in results if r.name == "forage (max_staleness 1)")
    if args.no_eval:
        return _speed_only(results, out, how, args, settings,
                           forage_async.steps_per_min() / trl_rate)
    # after the same wall time: the shorter of the runs' lengths (launch to last step)
    same_time = min(r.times[-1] for r in results)
    stops = list(cfg.rollout.stop_strings)
    max_new = cfg.rollout.max_tokens_per_turn
    print("evaluating checkpoints (greedy, held-out)...", flush=True)
    cache: dict[str, list[float]] = {}

    def answers(path: str) -> list[float]:
        if path not in cache:
            cache[path] = evaluate(path, task["test"], max_new, stops)
        return cache[path]

    def em(path: str) -> float:
        return statistics.fmean(answers(path))

    base_em = em(str(policy))
    scores: dict[str, dict[str, Any]] = {}
    for res in results:
        by_step = checkpoint_at(res, step=args.steps)
        by_time = checkpoint_at(res, seconds=same_time)
        scores[res.name] = {  # no checkpoint yet at that time: the policy it started from
            "em_steps": em(by_step[1]) if by_step else math.nan,
            "em_time": em(by_time[1]) if by_time else base_em,
            "time_step": by_time[0] if by_time else 0,
            # every checkpoint: one evaluation is noisy (140 questions), the curve less so
            "em_curve": {step: em(path) for step, (_, path) in sorted(res.checkpoints.items())},
            "answers_steps": answers(by_step[1]) if by_step else []}
    lines = report(results, scores, base_em, args.steps, same_time)
    lines += compare_answers(results, scores, args.steps)
    summary = {"policy": how, "steps": args.steps, "same_time_s": same_time, "base_em": base_em,
               "runs": [{**asdict(r), "rates": r.rates(), "scores": scores[r.name]}
                        for r in results], "trl_settings": settings}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    print(f"summary: {out / 'summary.json'}")
    print(f"ratio: {forage_async.steps_per_min() / trl_rate:.2f}")
    return 0


def _speed_only(results: list[RunResult], out: Path, how: str, args: argparse.Namespace,
                settings: dict[str, Any], ratio: float) -> int:
    """`--no-eval`: the rates of each run (no checkpoint is evaluated), summary.json, ratio."""
    lines = [f"{RATE_HEADER}{'load':>11}",
             *(f"{_rate_cells(res)}{_load_cell(res)}" for res in results),
             *_phase_lines(results)]
    summary = {"policy": how, "steps": args.steps, "overrides": args.overrides,
               "runs": [{**asdict(r), "rates": r.rates()} for r in results],
               "trl_settings": settings}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    print(f"summary: {out / 'summary.json'}")
    print(f"ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
