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


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def run_sft(cfg: RunConfig, data: str, out_dir: str, resume: bool = False) -> int:
    """Train, checkpoint every `learner.sft_save_every` steps and at the end, export the final
    policy (HF format) to `out_dir/policy`. With `resume`, continue from the last checkpoint."""
    from transformers import AutoTokenizer

    from services.learner import distributed as D
    from services.learner.checkpoint import (
        TrainerState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        trim_metrics,
    )
    from services.learner.trainer import PolicyTrainer

    check_sft_inputs(cfg, data)  # every input path, before anything is loaded
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
    total = steps_per_epoch * learner.sft_epochs
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = PolicyTrainer(
        cfg.model.path, learner, lr=learner.sft_lr or learner.lr, total_steps=total,
        pad_token_id=pad_id, gradient_checkpointing=cfg.model.gradient_checkpointing,
    )
    state = TrainerState()
    metrics_path = out / "sft_metrics.jsonl"
    if resume:
        path = latest_checkpoint(ckpt_dir)
        if path is not None:
            state = load_checkpoint(trainer, path)
            log.info("resumed from %s at step %d", path, state.step)
            if D.rank() == 0:
                trim_metrics(metrics_path, state.step)
        else:
            log.info("no checkpoint under %s; starting fresh", ckpt_dir)
    if D.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    log.info("SFT: %d samples, %d steps (%d per epoch), %d rank(s)", len(samples), total,
             steps_per_epoch, D.world_size())
    from tqdm import tqdm

    saved_at = state.step
    bar = tqdm(total=total, initial=state.step, desc="sft", disable=D.rank() != 0)
    while state.step < total:
        epoch, position = divmod(state.step, steps_per_epoch)
        order = _epoch_order(len(samples), learner.seed, epoch)
        batch = [samples[i] for i in order[position * per_step : (position + 1) * per_step]]
        metrics = trainer.sft_step(batch)
        state.step += 1
        state.data_cursor = {"epoch": epoch, "position": position + 1}
        record = {"step": state.step, "epoch": epoch, **metrics}
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
    if saved_at != state.step or latest_checkpoint(ckpt_dir) is None:
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
