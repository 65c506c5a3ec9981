"""`forage learner sft`: trains from a parquet of segments; a SIGKILLed run resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

FORAGE = Path(sys.executable).with_name("forage")


def _write_data(path: Path, make_rows: Callable[..., list[dict]], rows: int = 24) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = make_rows(rows, answer_turn="<answer> {city} </answer><|im_end|>")
    pq.write_table(pa.Table.from_pylist(table), str(path))


def _config(path: Path, policy: Path, run_dir: Path, epochs: int) -> None:
    path.write_text(
        f"run_dir: {run_dir}\nmodel:\n  path: {policy}\nlearner:\n  lr: 0.002\n"
        f"  sft_batch_size: 4\n  sft_epochs: {epochs}\n  sft_save_every: 1\n"
        "  micro_batch_tokens: 256\n"
    )


def test_encode_row_masks_segments_without_retokenizing(tiny_policy) -> None:
    from transformers import AutoTokenizer

    from services.learner.sft import encode_row

    tok = AutoTokenizer.from_pretrained(str(tiny_policy))
    segments = [{"text": "<search> Tamra </search>", "trainable": True},
                {"text": "\n\n<information>x</information>\n\n", "trainable": False},
                {"text": "<answer> Ashby </answer>", "trainable": True}]
    sample = encode_row(tok, [{"role": "user", "content": "Where?"}], segments, 4096)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Where?"}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    pieces = [tok(s["text"], add_special_tokens=False)["input_ids"] for s in segments]
    assert sample.input_ids.tolist() == list(prompt) + pieces[0] + pieces[1] + pieces[2]
    expected = [0] * len(prompt) + [1] * len(pieces[0]) + [0] * len(pieces[1]) + [1] * len(pieces[2])
    assert sample.loss_mask.tolist() == expected
    assert sample.prompt_len == len(prompt)


@pytest.mark.slow
def test_sft_killed_then_resumed(tiny_policy, tmp_path, sft_rows) -> None:
    data, cfg, run_dir = tmp_path / "sft.parquet", tmp_path / "cfg.yaml", tmp_path / "run"
    _write_data(data, sft_rows)
    _config(cfg, tiny_policy, run_dir, epochs=4)  # 24 rows / 4 = 6 steps per epoch, 24 steps
    out = run_dir / "sft"
    cmd = [str(FORAGE), "learner", "sft", "--config", str(cfg), "--data", str(data)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if latest.is_file() and int(latest.read_text().strip().split("_")[1]) >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint within the deadline")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    saved = int(latest.read_text().strip().split("_")[1])
    assert saved < 24, "the run finished before it was killed; make it longer"

    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    match = re.search(r"resumed from \S+ at step (\d+)", resumed.stderr)
    assert match is not None, resumed.stderr[-3000:]
    assert int(match.group(1)) >= saved >= 3
    steps = [
        json.loads(line)["step"]
        for line in (out / "sft_metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, 25))  # every step once: none lost, none repeated
    state = json.loads((out / "checkpoints" / "step_00000024" / "trainer_state.json").read_text())
    assert state["step"] == 24 and state["data_cursor"] == {"epoch": 3, "position": 6}
    losses = [h["loss"] for h in state["metrics_history"]]
    assert len(losses) == 24 and np.mean(losses[-6:]) < np.mean(losses[:6])
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out / "policy"))
