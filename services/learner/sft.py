"""SFT warm start: supervised training on demonstration trajectories with RL's masking.

Rows (parquet, written by services/tasks): `prompt` (chat messages, or plain text) and
`segments` (list of {text, trainable}). The prompt is rendered with the tokenizer's chat template
(generation prompt added), then every segment is tokenized on its own and the ids concatenated:
exactly how the agent loop builds a trajectory (policy turns and observations appended as token
ids, never re-tokenized as one string), so a demonstration and a live trajectory agree token for
token. Loss only on trainable segments (the policy's turns), never on prompt or observations.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.common.config import RunConfig
from services.common.paths import (
    LOCAL_ONLY,
    check_parquet_columns,
    require_file,
    require_model_dir,
    require_tokenizer_dir,
    tokenizer_source,
)
from services.learner.packing import Sample

log = logging.getLogger("forage.learner.sft")


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_row(
    tokenizer: Any, prompt: Any, segments: Sequence[dict[str, Any]], max_length: int
) -> Sample:
    """One demonstration -> Sample (prompt ids + segment ids; mask = trainable segments)."""
    ids = encode_prompt(tokenizer, prompt)
    prompt_len = len(ids)
    mask = [0.0] * prompt_len
    for segment in segments:
        piece = tokenizer(str(segment["text"]), add_special_tokens=False)["input_ids"]
        ids.extend(int(x) for x in piece)
        mask.extend([1.0 if segment.get("trainable") else 0.0] * len(piece))
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
    return Sample(np.asarray(ids), np.asarray(mask), prompt_len=min(prompt_len, len(ids)))


def _as_python(value: Any) -> Any:
    """Parquet cells may arrive as numpy arrays of dicts, or as JSON text; normalise."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, np.ndarray):
        return [_as_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_as_python(v) for v in value]
    return value


def load_sft_samples(path: str | os.PathLike[str], tokenizer: Any, max_length: int) -> list[Sample]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path), columns=["prompt", "segments"])
    prompts = table.column("prompt").to_pylist()
    segments = table.column("segments").to_pylist()
    samples = []
    for prompt, segs in zip(prompts, segments, strict=True):
        prompt, segs = _as_python(prompt), _as_python(segs)
        sample = encode_row(tokenizer, prompt, segs, max_length)
        if sample.num_loss_tokens > 0:
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no rows with trainable tokens")
    return samples


def check_sft_inputs(cfg: RunConfig, data: str) -> None:
    """One line naming key and path for a policy, tokenizer or SFT parquet that is not there."""
    require_model_dir(cfg.model.path, "model.path")
    key, tokenizer = tokenizer_source(cfg.model.tokenizer_path, cfg.model.path)
    require_tokenizer_dir(tokenizer, key)
    from services.tasks.datasets import SFT_COLUMNS

    path = require_file(data, "--data", "an SFT parquet file")
    check_parquet_columns(path, "--data", SFT_COLUMNS)


def heldout_path(learner: Any, data: str) -> Path:
    """`learner.sft_heldout`, else sft_heldout.parquet beside the SFT data."""
    return Path(learner.sft_heldout or Path(data).with_name("sft_heldout.parquet"))


def check_gate_inputs(learner: Any, data: str) -> None:
    """One line for bad thresholds or a missing held-out set, before anything is loaded."""
    from services.common.config import ConfigError
    from services.common.skill_gate import check_thresholds

    if learner.sft_until is not None:
        try:
            check_thresholds(learner.sft_until)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if learner.sft_eval_every:
        from services.tasks.datasets import SFT_COLUMNS

        key = "learner.sft_heldout" if learner.sft_heldout else (
            "learner.sft_heldout (default: beside --data)")
        path = require_file(str(heldout_path(learner, data)), key,
                            "held-out demonstrations; `forage data synth` writes them")
        check_parquet_columns(path, key, SFT_COLUMNS)


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def run_sft(cfg: RunConfig, data: str, out_dir: str, resume: bool = False) -> int:
    """Train, checkpoint every `learner.sft_save_every` steps and at the end, export the final
    policy (HF format) to `out_dir/policy`. With `resume`, continue from the last checkpoint."""
    from transformers import AutoTokenizer

    from services.learner import distributed as D
    from services.learner.checkpoint import (
        TrainerState,
        agreed_checkpoint,
        check_shared_dir,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        trim_metrics,
    )
    from services.learner.trainer import PolicyTrainer

    check_sft_inputs(cfg, data)  # every input path, before anything is loaded
    check_gate_inputs(cfg.learner, data)
    learner = cfg.learner
    if learner.sft_warmup_steps is not None:
        learner = learner.model_copy(update={"warmup_steps": learner.sft_warmup_steps})
    out = Path(out_dir)
    ckpt_dir = out / "checkpoints"
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path,
                                              **LOCAL_ONLY)
    samples = load_sft_samples(data, tokenizer, cfg.model.max_length)
    if learner.sft_max_rows is not None:
        samples = samples[: learner.sft_max_rows]
    per_step = learner.sft_batch_size
    steps_per_epoch = math.ceil(len(samples) / per_step)
    total = learner.sft_step_budget(len(samples))
    thresholds = dict(learner.sft_until) if learner.sft_until is not None else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = PolicyTrainer(
        cfg.model.path, learner, lr=learner.sft_lr or learner.lr, total_steps=total,
        pad_token_id=pad_id, gradient_checkpointing=cfg.model.gradient_checkpointing,
    )
    state = TrainerState()
    metrics_path = out / "sft_metrics.jsonl"
    check_shared_dir(ckpt_dir, "the SFT checkpoint directory")  # one directory on all nodes
    if resume:
        path = agreed_checkpoint(ckpt_dir)  # rank 0's choice on every rank
        if path is not None:
            state = load_checkpoint(trainer, path)
            log.info("resumed from %s at step %d", path, state.step)
            if D.rank() == 0:
                trim_metrics(metrics_path, state.step)
        else:
            log.info("no checkpoint under %s; starting fresh", ckpt_dir)
    if D.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    log.info("SFT: %d samples, %d steps %s(%d per epoch), %d rank(s)", len(samples), total,
             "at most " if thresholds else "", steps_per_epoch, D.world_size())
    skill_items: list[Any] = []
    if learner.sft_eval_every:
        from services.learner.sft_skills import load_items

        skill_items, mismatches = load_items(str(heldout_path(learner, data)), tokenizer,
                                             cfg.model.max_length)
        log.info("skills measured every %d steps on %d held-out items%s", learner.sft_eval_every,
                 len(skill_items), f"; {mismatches} <search> splits were not a token prefix "
                 "of their turn" if mismatches else "")
    history = [_skills_of(r) for r in state.metrics_history if "skill/format" in r]
    stopped = "epochs"
    if thresholds and history and history[-1]["step"] == state.step and _gate_open(
            history[-1], thresholds, learner.sft_min_steps):
        stopped = "thresholds"  # resumed after the gate had already stopped the run
    from tqdm import tqdm

    saved_at = state.step
    bar = tqdm(total=total, initial=state.step, desc="sft", disable=D.rank() != 0)
    while state.step < total and stopped != "thresholds":
        epoch, position = divmod(state.step, steps_per_epoch)
        order = _epoch_order(len(samples), learner.seed, epoch)
        batch = [samples[i] for i in order[position * per_step : (position + 1) * per_step]]
        metrics = trainer.sft_step(batch)
        state.step += 1
        state.data_cursor = {"epoch": epoch, "position": position + 1}
        record = {"step": state.step, "epoch": epoch, **metrics}
        if skill_items and (state.step % learner.sft_eval_every == 0 or state.step == total):
            skills = _measure(trainer, tokenizer, skill_items, cfg.rollout.max_tokens_per_turn)
            record.update({f"skill/{k}": v for k, v in skills.items() if k != "seconds"})
            record["skill_seconds"] = skills["seconds"]
            history.append(_skills_of(record))
            log.info("step %d: skills %s [%.1fs]", state.step,
                     _describe(history[-1], thresholds), skills["seconds"])
            if thresholds and _gate_open(history[-1], thresholds, learner.sft_min_steps):
                stopped = "thresholds"
        state.metrics_history.append(record)
        if D.rank() == 0:
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        if learner.sft_save_every and state.step % learner.sft_save_every == 0:
            save_checkpoint(trainer, ckpt_dir, state, tokenizer_from=cfg.model.path,
                            keep=learner.keep_checkpoints)
            saved_at = state.step
    bar.close()
    if thresholds and stopped != "thresholds":
        stopped = "cap"
        last = history[-1] if history else {"step": state.step}
        log.warning("SFT hit the cap learner.sft_max_steps=%d before the skills reached "
                    "learner.sft_until: %s at step %d; RL starts from a weaker warm start",
                    total, _shortfall(last, thresholds) or "not measured", last["step"])
    elif thresholds:
        log.info("SFT skills reached at step %d: %s", state.step,
                 _describe(history[-1], thresholds))
    if D.rank() == 0:
        result = {"steps": state.step, "max_steps": total, "stopped": stopped,
                  "skills": {k: v for k, v in (history[-1] if history else {}).items()
                             if k != "step"},
                  "thresholds": thresholds, "history": history}
        tmp = out / "sft_result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out / "sft_result.json")
    # Decided by rank 0 for every rank: the save is collective, and a rank that decided alone
    # on a file system that shows it another `latest` would leave the others waiting in it.
    if saved_at != state.step or agreed_checkpoint(ckpt_dir) is None:
        save_checkpoint(trainer, ckpt_dir, state, tokenizer_from=cfg.model.path,
                        keep=learner.keep_checkpoints)
    final = latest_checkpoint(ckpt_dir)
    if D.rank() == 0 and final is not None:
        export = out / "policy"
        staging = out / ".policy.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(final / "policy", staging)
        shutil.rmtree(export, ignore_errors=True)
        os.replace(staging, export)
        log.info("SFT done at step %d; policy in %s", state.step, export)
    D.barrier()
    return 0


def _skills_of(record: dict[str, Any]) -> dict[str, Any]:
    """{step, format, query, ...} from a metrics record's `skill/*` keys."""
    return {"step": record["step"], **{k.removeprefix("skill/"): v for k, v in record.items()
                                       if k.startswith("skill/")}}


def _gate_open(skills: dict[str, Any], thresholds: dict[str, float], min_steps: int) -> bool:
    from services.common.skill_gate import reached

    return skills["step"] >= min_steps and reached(skills, thresholds)


def _describe(skills: dict[str, Any], thresholds: dict[str, float] | None) -> str:
    from services.common.skill_gate import describe

    return describe({k: v for k, v in skills.items() if k != "step"}, thresholds)


def _shortfall(skills: dict[str, Any], thresholds: dict[str, float]) -> str:
    from services.common.skill_gate import shortfall

    return shortfall({k: v for k, v in skills.items() if k != "step"}, thresholds)


def _measure(trainer: Any, tokenizer: Any, items: list[Any], max_new_tokens: int) -> dict:
    """Skills of the policy being trained. Every rank runs the same greedy generations on the
    same weights (ZeRO-3 needs every rank in each forward), so every rank decides alike."""
    from services.learner.sft_skills import measure

    return measure(trainer.policy.module, tokenizer, items, max_new_tokens)
