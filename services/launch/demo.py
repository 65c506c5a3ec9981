"""`forage demo [--quick] [--out DIR] [--set k=v ...]`: the embedded default, end to end.

Phases (each a `forage` sub-command in its own process, its output in OUT/logs/<phase>.log):
  1. world   `forage data synth`: corpus, train/test questions, retriever index, SFT rows
  2. policy  `forage model init`: tokenizer + tiny Qwen2 policy
  3. sft     `forage learner sft`: warm start that teaches the format, not the strategy
  4. rl      `forage up` with the demo config: retriever, learner, scorer, rollout on loopback;
             greedy evaluation on the held-out questions before and after RL
  5. report  `forage report OUT`: plots and summary.json
Phases 1–3 are reused when OUT already holds their output for the same settings (a second
`forage demo` goes straight to RL); `--fresh` rebuilds them.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.common.config import RunConfig, load_config
from services.common.skill_gate import shortfall
from services.launch.supervisor import forage_argv

log = logging.getLogger("forage.launch")

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
QUICK_CONFIG = REPO / "configs" / "demo_quick.yaml"


# What `--quick` is for: its 4 steps x 2 groups x 2 samples on an SFT warm start of 4 steps
# cannot move EM, and EM 0 -> 0 with flat plots otherwise reads as broken.
QUICK_NOTE = ("--quick checks the plumbing at toy size (every service, stream, weight sync and "
              "the report); it does not learn, so EM and the plots stay flat. "
              "`forage demo` (without --quick) is the run that learns.")


class DemoError(RuntimeError):
    pass


def _say(text: str) -> None:
    print(text, flush=True)


def _run_phase(name: str, argv: list[str], log_dir: Path, follow: Any = None) -> float:
    """Run one phase to completion with its output in log_dir/name.log; returns seconds."""
    started = time.monotonic()
    path = log_dir / f"{name}.log"
    with path.open("ab") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=REPO)
        try:
            while process.poll() is None:
                if follow is not None:
                    follow()
                time.sleep(0.5)
        except KeyboardInterrupt:
            process.terminate()
            process.wait()
            raise
    if follow is not None:
        follow()
    if process.returncode != 0:
        tail = "\n    ".join(path.read_text(errors="replace").splitlines()[-15:])
        raise DemoError(f"phase {name} failed (exit {process.returncode}); log {path}:\n    {tail}")
    return time.monotonic() - started


def _settings_stamp(cfg: RunConfig) -> dict[str, Any]:
    """What phases 1–3 depend on: reuse their output only when this is unchanged."""
    return {"data": cfg.data.model_dump(mode="json"), "topk": cfg.retriever.topk,
            "model": {k: v for k, v in cfg.model.model_dump(mode="json").items()
                      if k.startswith("init_") or k == "max_length"},
            "sft": {k: getattr(cfg.learner, k) for k in ("sft_lr", "sft_epochs", "sft_batch_size",
                                                         "sft_max_rows", "sft_warmup_steps",
                                                         "micro_batch_tokens", "seed",
                                                         "sft_until", "sft_eval_every",
                                                         "sft_min_steps", "sft_max_steps",
                                                         "sft_heldout")},
            "max_tokens_per_turn": cfg.rollout.max_tokens_per_turn,
            **_protocol_stamp(cfg)}


def _protocol_stamp(cfg: RunConfig) -> dict[str, Any]:
    """The action protocol and tools the world's prompts and demonstrations are written in;
    nothing for Search-R1's tags (a stamp written before the tool_calls protocol still
    matches)."""
    rollout = cfg.rollout.model_dump(mode="json")
    if rollout.get("protocol", "tags") == "tags":
        return {}
    return {"protocol": rollout["protocol"], "tools": rollout.get("tools")}


def _skills_text(skills: dict[str, Any], thresholds: dict[str, float] | None) -> str:
    names = list(thresholds) if thresholds else [
        s for s in ("format", "query", "answer") if s in skills]
    text = ", ".join(f"{n} {skills[n]:.2f}" if n in skills else f"{n} n/a" for n in names)
    if thresholds:
        text += " (thresholds " + " / ".join(f"{thresholds[n]:.2f}" for n in names) + ")"
    return text


def warm_start_line(result: dict[str, Any]) -> str:
    """What the warm start reached, from the SFT phase's sft_result.json, in one line."""
    skills, thresholds = result.get("skills") or {}, result.get("thresholds")
    steps, cap = result.get("steps"), result.get("max_steps")
    stopped = result.get("stopped")
    if stopped == "thresholds":
        return (f"warm start: {_skills_text(skills, thresholds)} reached at step {steps} of at "
                f"most {cap}")
    if stopped == "cap":
        return (f"warm start: WARNING: the cap of {cap} SFT steps was hit before the skill "
                f"thresholds ({shortfall(skills, thresholds or {})}); RL starts from a weaker "
                "warm start")
    if skills:
        return f"warm start: {_skills_text(skills, None)} after {steps} steps (no gate)"
    return f"warm start: {steps} steps (skills not measured)"


def read_warm_start(sft_out: Path) -> dict[str, Any] | None:
    path = sft_out / "sft_result.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class SftProgress:
    """A progress bar over the SFT subprocess's metrics file."""

    def __init__(self, path: Path, total: int) -> None:
        from tqdm import tqdm

        self.path = path
        # disable=None: a bar on a terminal, nothing when the output is a file or a pipe
        self.bar = tqdm(total=total, desc="sft", unit="step", disable=None)
        self.seen = 0

    def __call__(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        if len(lines) > self.seen:
            try:
                loss = json.loads(lines[-1]).get("loss")
                self.bar.set_postfix(loss=f"{loss:.3f}")
            except (json.JSONDecodeError, TypeError):
                pass
            self.bar.update(len(lines) - self.seen)
            self.seen = len(lines)

    def close(self) -> None:
        self.bar.close()


def prepare(cfg: RunConfig, config_file: Path, overrides: list[str], out: Path,
            fresh: bool = False) -> tuple[dict[str, float], Path]:
    """Phases 1–3; returns their timings and the SFT policy directory."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp_path = out / "prepared.json"
    stamp = _settings_stamp(cfg)
    world, policy, sft_out = out / "world", out / "world" / "policy", out / "sft"
    reuse = (not fresh and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp
             and (sft_out / "policy" / "config.json").exists())
    timings: dict[str, float] = {}
    if reuse:
        _say(f"[1-3/5] world, policy and SFT already in {out} (same settings): reusing them")
        result = read_warm_start(sft_out)
        if result is not None:
            _say(warm_start_line(result))
        return timings, sft_out / "policy"
    for path in (world, sft_out):
        shutil.rmtree(path, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    sets = [arg for o in overrides for arg in ("--set", o)]
    conf = ["--config", str(config_file), *sets]
    _say(f"[1/5] synthetic world (seed {cfg.data.seed}) and retriever index -> {world}")
    timings["world_s"] = _run_phase("world", forage_argv(
        "data", "synth", "--out", str(world), *conf, "--sft-topk", str(cfg.retriever.topk),
        "--quiet"), logs)
    summary = world / "world.json"
    if summary.exists():
        info = json.loads(summary.read_text()).get("summary", {})
        if info:
            _say(f"      {json.dumps(info)[:200]}")
    _say(f"[2/5] tokenizer + tiny Qwen2 policy -> {policy}")
    timings["policy_s"] = _run_phase("policy", forage_argv(
        "model", "init", "--data", str(world), "--out", str(policy), *conf), logs)
    import pyarrow.parquet as pq

    rows = pq.read_metadata(str(world / "sft.parquet")).num_rows
    learner = cfg.learner
    total = learner.sft_step_budget(rows)
    rows = min(rows, learner.sft_max_rows or rows)
    if learner.sft_until:
        until = ", ".join(f"{n} {v:.2f}" for n, v in learner.sft_until.items())
        _say(f"[3/5] SFT warm start: {rows} demonstrations, until the held-out skills reach "
             f"{until}, at most {total} steps -> {sft_out}")
    else:
        _say(f"[3/5] SFT warm start: {rows} demonstrations, {total} steps -> {sft_out}")
    bar = SftProgress(sft_out / "sft_metrics.jsonl", total)
    try:
        timings["sft_s"] = _run_phase("sft", forage_argv(
            "learner", "sft", *conf, "--set", f"model.path={policy}",
            "--set", f"run_dir={out}", "--data", str(world / "sft.parquet"),
            "--out", str(sft_out)), logs, follow=bar)
    finally:
        bar.close()
    result = read_warm_start(sft_out)
    if result is not None:
        _say(warm_start_line(result))
    stamp_path.write_text(json.dumps(stamp))
    return timings, sft_out / "policy"


# What a Hermes search call costs over `<search> … </search>` in the tiny policy's tokenizer:
# 21 tokens of markup around the query against 3 (a call turn of the seed-0 world's
# demonstrations is at most 36 tokens, a tags turn 23), plus the template's ~10 tokens around
# each tool message in the response.
TOOL_CALL_TURN_TOKENS = 16
TOOL_CALL_RESPONSE_TOKENS = 32


def protocol_overrides(config_file: Path, overrides: list[str]) -> list[str]:
    """Turn budgets the demo gives the tool_calls protocol, before the user's `--set`s (which
    win): `rollout.max_tokens_per_turn` + 16 (a turn that stops mid-call cannot act) and
    `rollout.max_response_length` + 32 per turn. None for Search-R1's tags."""
    cfg = load_config(config_file, overrides)
    if cfg.rollout.protocol != "tool_calls":
        return []
    given = {o.split("=", 1)[0].strip().lstrip("+") for o in overrides}
    rollout = cfg.rollout
    extra = {
        "rollout.max_tokens_per_turn": rollout.max_tokens_per_turn + TOOL_CALL_TURN_TOKENS,
        "rollout.max_response_length": rollout.max_response_length
        + TOOL_CALL_RESPONSE_TOKENS * (rollout.max_turns + 1),
    }
    return [f"{key}={value}" for key, value in extra.items() if key not in given]


def rl_overrides(out: Path, policy: Path) -> list[str]:
    world = out / "world"
    return [f"run_dir={out}", f"model.path={policy}",
            f"data.train_files=[{world / 'train.parquet'}]",
            f"data.test_files=[{world / 'test.parquet'}]",
            f"retriever.index_dir={world / 'index'}",
            "retriever.port=0", "learner.weight_sync_port=0", "learner.metrics_port=0",
            "scorer.port=0", "scorer.metrics_port=0", f"learner.checkpoint_dir={out / 'checkpoints'}"]


def early_stop_line(records: list[dict[str, Any]], total_steps: int) -> str | None:
    """What the console says when RL ended before `total_steps` because held-out EM stopped
    improving (learner.early_stop_patience), from the run's metrics lines; None otherwise."""
    steps = [int(r["step"]) for r in records if r.get("kind") == "train" and "step" in r]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval/em") is not None]
    if not steps or max(steps) >= total_steps or not evals:
        return None
    best = max(evals, key=lambda r: r["eval/em"])
    return (f"      RL stopped at step {max(steps)} of {total_steps}: held-out EM stopped "
            f"improving (best {100 * best['eval/em']:.1f}% at step {best['step']}; "
            "learner.early_stop_patience)")


def run_demo(out: Path, quick: bool = False, overrides: list[str] | None = None,
             fresh: bool = False, rollouts: int = 1) -> int:
    from services.launch.progress import MetricsFollower
    from services.launch.report import write_report
    from services.launch.up import run_up

    started = time.monotonic()
    overrides = list(overrides or [])
    config_file = QUICK_CONFIG if quick else DEMO_CONFIG
    budgets = protocol_overrides(config_file, overrides)
    overrides = [*budgets, *overrides]
    cfg = load_config(config_file, overrides)
    out.mkdir(parents=True, exist_ok=True)
    _say(f"forage demo{' --quick' if quick else ''}: output in {out}")
    if budgets:
        _say(f"{cfg.rollout.protocol}: {', '.join(budgets)} (a Hermes call's JSON is longer "
             "than a <search> tag)")
    if quick:
        _say(f"note: {QUICK_NOTE}")
    timings, policy = prepare(cfg, config_file, overrides, out, fresh)
    # A fresh RL run each time: old metrics, checkpoints and streams are not mixed in.
    for stale in ("metrics.jsonl", "checkpoints", "report", "demo.json"):
        target = out / stale
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    namespace = f"{cfg.redis.namespace}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_cfg = load_config(config_file, [*overrides, *rl_overrides(out, policy),
                                        f"redis.namespace={namespace}"])
    _say(f"[4/5] RL: {run_cfg.learner.adv_estimator}, {run_cfg.learner.total_steps} steps x "
         f"{run_cfg.learner.train_batch_size} groups x {run_cfg.data.n_samples} samples, "
         f"max_staleness {run_cfg.learner.max_staleness}; services' logs in {out / 'logs'}")
    follower = MetricsFollower(out / "metrics.jsonl", emit=_say,
                               total_steps=run_cfg.learner.total_steps)
    rl_started = time.monotonic()
    code = run_up(run_cfg, rollouts=rollouts, on_tick=lambda _sup: follower.poll())
    follower.poll()
    timings["rl_s"] = time.monotonic() - rl_started
    if code != 0:
        _say(f"forage demo: the run stopped (learner exit {code}); logs in {out / 'logs'}")
        return code
    stop = early_stop_line(follower.records, run_cfg.learner.total_steps)
    if stop:
        _say(stop)
    info = {"wall_seconds": time.monotonic() - started, "quick": quick, "phases": timings,
            "config": str(out / "config.yaml"), "namespace": namespace,
            "warm_start": read_warm_start(out / "sft")}
    (out / "demo.json").write_text(json.dumps(info, indent=1))
    _say("[5/5] report")
    summary = write_report(out)
    print_summary(summary, out, quick=quick)
    return 0


def print_summary(summary: dict[str, Any], out: Path, quick: bool = False) -> None:
    def pct(value: Any) -> str:
        return "n/a" if value is None else f"{100 * value:5.1f}%"

    def num(value: Any) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    rows = [
        (f"held-out EM ({summary.get('eval_mode') or 'greedy'})", pct(summary.get("em_before")),
         pct(summary.get("em_after"))),
        ("searches per question", num(summary.get("searches_before")),
         num(summary.get("searches_after"))),
        ("train reward", num(summary.get("reward_first")), num(summary.get("reward_last"))),
    ]
    _say("")
    _say(f"{'':24}{'before RL':>12}{'after RL':>12}")
    for name, before, after in rows:
        _say(f"{name:24}{before:>12}{after:>12}")
    delta = summary.get("em_delta")
    _say(f"EM change: {'n/a' if delta is None else f'{100 * delta:+.1f} points'}   "
         f"steps: {summary.get('steps')}   wall: {summary.get('wall_seconds', 0):.0f}s")
    _say(f"report: {out / 'report' / 'index.html'}")
    if quick:
        _say(f"note: {QUICK_NOTE}")


def main_entry(out: str | None, quick: bool, overrides: list[str], fresh: bool,
               rollouts: int) -> int:
    target = Path(out or ("runs/demo-quick" if quick else "runs/demo")).resolve()
    try:
        return run_demo(target, quick=quick, overrides=overrides, fresh=fresh, rollouts=rollouts)
    except DemoError as exc:
        print(f"forage demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("forage demo: interrupted", file=sys.stderr)
        return 130
