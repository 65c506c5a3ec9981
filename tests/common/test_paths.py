"""Input paths are checked at start: one line on stderr naming key and path, exit code 2, no
model-hub lookups (services/common/paths.py).

The old code handed a missing model directory to `from_pretrained`, which took it for a hub
repo id: with HF_HUB_OFFLINE=0 (as the GPU image had it) each of learner, rollout and scorer
retried the hub for 28-54 s here, then died with exit code 1 and a ~100-line traceback; the
learner loaded its model before it looked at its data files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.paths import (
    InputPathError,
    check_parquet_columns,
    require_files,
    require_model_dir,
    require_tokenizer_dir,
    tokenizer_source,
)

REPO = Path(__file__).resolve().parents[2]
# The environment a misconfigured container had: hub access allowed.
ENV = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
ENV.update(HF_HUB_OFFLINE="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _rl_parquet(path: Path) -> Path:
    return _write_parquet(path, [{
        "data_source": "nq", "prompt": [{"role": "user", "content": "q?"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["a"]}},
    }])


def _config(tmp_path: Path, model: str, **data) -> Path:
    lines = ["run_id: t", f"run_dir: {tmp_path / 'run'}", "model:", f"  path: {model}", "data:"]
    for key, files in data.items():
        lines.append(f"  {key}: [{', '.join(str(f) for f in files)}]")
    config = tmp_path / "run.yaml"
    config.write_text("\n".join(lines) + "\n")
    return config


def _forage(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env=ENV)
    return result, time.monotonic() - started


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------ the commands, as processes


@pytest.mark.parametrize("command", [
    ["learner", "train"], ["rollout", "serve"], ["scorer", "serve"],
    ["learner", "sft", "--data", "demos.parquet"],
    # The vLLM engine is chosen before anything imports vllm: the path check comes first.
    ["rollout", "serve", "--set", "rollout.engine=vllm"],
], ids=["learner-train", "rollout-serve", "scorer-serve", "learner-sft", "rollout-serve-vllm"])
def test_missing_model_dir_is_one_line_and_exit_2(tmp_path, command) -> None:
    train = _rl_parquet(tmp_path / "train.parquet")
    config = _config(tmp_path, "missing/model", train_files=[train])
    result, seconds = _forage(tmp_path, *command, "--config", str(config))
    assert result.returncode == 2
    line = _one_line(result)
    assert "model.path: missing/model" in line and str(tmp_path / "missing" / "model") in line
    assert "does not exist" in line
    assert seconds < 20, f"{seconds:.0f}s: something was tried before the path was checked"


def test_learner_checks_its_data_before_loading_the_model(tmp_path, tiny_policy_dir) -> None:
    train = _rl_parquet(tmp_path / "train.parquet")
    bad_test = _write_parquet(tmp_path / "test.parquet", [{"question": "q?"}])
    config = _config(tmp_path, str(tiny_policy_dir), train_files=[train, tmp_path / "gone.pq"],
                     test_files=[bad_test])
    result, _ = _forage(tmp_path, "learner", "train", "--config", str(config))
    assert result.returncode == 2
    assert _one_line(result) == (f"forage learner train: error: data.train_files[1]: "
                                 f"{tmp_path / 'gone.pq'} does not exist (a parquet file of "
                                 "prompts)")

    config = _config(tmp_path, str(tiny_policy_dir), train_files=[train], test_files=[bad_test])
    result, _ = _forage(tmp_path, "learner", "train", "--config", str(config))
    assert result.returncode == 2
    line = _one_line(result)
    assert f"data.test_files[0]: {bad_test} has no column(s) data_source, prompt" in line


def test_learner_loop_fails_on_a_missing_data_file_without_loading_anything(
    tmp_path, tiny_policy_dir
) -> None:
    """The constructor checks; the model is only loaded in run(). The old constructor only
    checked that data.train_files was not empty."""
    from services.common.config import load_config
    from services.learner.loop import LearnerLoop

    config = _config(tmp_path, str(tiny_policy_dir), train_files=[tmp_path / "gone.parquet"])
    with pytest.raises(InputPathError, match=r"data\.train_files\[0\]: .*gone\.parquet"):
        LearnerLoop(load_config(str(config), []))


def test_rollout_engine_names_a_missing_tokenizer(tmp_path, tiny_policy_dir) -> None:
    from services.rollout.transformers_engine import TransformersEngine

    with pytest.raises(InputPathError, match=r"^model\.tokenizer_path: .*/no-tok does not"):
        TransformersEngine.from_pretrained(str(tiny_policy_dir),
                                           tokenizer_path=str(tmp_path / "no-tok"))


def test_scorer_names_the_key_its_tokenizer_came_from(tmp_path) -> None:
    from services.common.config import RunConfig
    from services.scorer.worker import load_tokenizer, tokenizer_key_and_path

    config = RunConfig.model_validate({"model": {"path": str(tmp_path)}})
    assert tokenizer_key_and_path(config) == ("model.path", str(tmp_path))
    config.scorer.tokenizer_path = str(tmp_path / "tok")
    key, path = tokenizer_key_and_path(config)
    assert key == "scorer.tokenizer_path"
    with pytest.raises(InputPathError, match=r"^scorer\.tokenizer_path: .*/tok does not exist"):
        load_tokenizer(path, key)
    with pytest.raises(InputPathError, match="set scorer.tokenizer_path"):
        load_tokenizer(None)


# ------------------------------------------------------------------ the checks themselves


def test_require_model_dir(tmp_path, tiny_policy_dir) -> None:
    assert require_model_dir(str(tiny_policy_dir)) == tiny_policy_dir
    with pytest.raises(InputPathError, match=r"^model\.path is not set"):
        require_model_dir(None)
    with pytest.raises(InputPathError, match=rf"^model\.path: {tmp_path}/x does not exist"):
        require_model_dir(tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(InputPathError, match="is not a directory"):
        require_model_dir(tmp_path / "file")
    with pytest.raises(InputPathError, match="has no config.json"):
        require_model_dir(tmp_path, "learner.model")


def test_require_tokenizer_dir(tmp_path, tiny_policy_dir) -> None:
    assert require_tokenizer_dir(tiny_policy_dir) == tiny_policy_dir
    with pytest.raises(InputPathError, match="has no tokenizer.json or tokenizer_config.json"):
        require_tokenizer_dir(tmp_path)
    assert tokenizer_source(None, "m") == ("model.path", "m")
    assert tokenizer_source("t", "m") == ("model.tokenizer_path", "t")


def test_require_files_names_the_entry(tmp_path) -> None:
    good = tmp_path / "a.parquet"
    good.write_text("")
    assert require_files([str(good)], "data.train_files") == [good]
    with pytest.raises(InputPathError, match=r"^data\.train_files\[1\]: .*b\.parquet does not"):
        require_files([str(good), str(tmp_path / "b.parquet")], "data.train_files")


def test_check_parquet_columns(tmp_path) -> None:
    path = _rl_parquet(tmp_path / "ok.parquet")
    check_parquet_columns(path, "k", ("data_source", "prompt"))
    with pytest.raises(InputPathError, match=r"^k: .* has no column\(s\) segments \(has: "):
        check_parquet_columns(path, "k", ("prompt", "segments"))
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet")
    with pytest.raises(InputPathError, match="is not a readable parquet file"):
        check_parquet_columns(text, "k", ("prompt",))
