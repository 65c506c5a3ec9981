"""learner.logger: each tracker writes its real files, which are read back with the library's own
reader (TensorBoard's EventAccumulator, the offline wandb run file, MLflow's client), and a
resumed run continues the same tracker run."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from services.common.config import load_config
from services.learner.trackers import (
    STATE_FILE,
    TrackerError,
    console_line,
    mlflow_key,
    numeric_metrics,
    open_trackers,
    redact,
    sample_table,
)
from tests.suite_rules import import_or_skip

CONFIG = {"run_id": "tracked", "learner": {"lr": 1e-5, "algorithm": {"clip_ratio_high": 0.28},
                                           "weight_sync_token": "s3cret"},
          "redis": {"url": "redis://:hunter2@10.0.0.5:6379/0"}}


def _train(step: int) -> dict:
    # The loop's real line shape: kind/step/time fields, metrics, a null (NaN) metric.
    return {"kind": "train", "step": step, "policy_version": step + 1, "time": 1.7e9 + step,
            "elapsed_s": 3.0 * step, "reward/mean": 0.1 * step, "em/synth_single": 0.05 * step,
            "actor/grad_norm": 1.0 + step, "actor/entropy": None, "probe_all/score_at_0.50": 0.5}


def _eval(step: int) -> dict:
    return {"kind": "eval", "step": step, "policy_version": step + 1, "time": 1.7e9,
            "eval/em": 0.25 + step / 100, "eval/n": 8, "eval/n/synth_single": 8}


ROWS = [{"step": 2, "kind": "train", "policy_version": 3, "data_source": "synth_single",
         "question": "Where was Ada born?",
         "turns": [{"action": "search", "text": "<search> Ada </search>", "query": "Ada",
                    "docs": [{"id": "7", "title": "Ada Vel"}]},
                   {"action": "answer", "text": "<answer> Pigir </answer>", "query": None,
                    "docs": []}],
         "answer": "Pigir", "ground_truth": {"target": ["Pigir"]}, "reward": 1.0,
         "reward_components": {"em": 1.0}, "probe_scores": [0.0, 1.0], "correct": True}]


def wandb_records(run_dir: Path) -> list:
    """Every record of the offline runs' `.wandb` files (LevelDB log format: 7-byte file
    header, 32 KiB blocks, 7-byte record headers; records are wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, buffer = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            buffer += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                record = pb.Record()
                record.ParseFromString(buffer)
                records.append((path, record))
                buffer = b""
    return records


def wandb_history(run_dir: Path) -> tuple[set[str], dict[int, dict[str, float]]]:
    run_ids, history = set(), {}
    for _, record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_ids.add(record.run.run_id)
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
    return run_ids, history


def test_pure_helpers():
    metrics = numeric_metrics(_train(3))
    assert "kind" not in metrics and "step" not in metrics and "time" not in metrics
    assert "actor/entropy" not in metrics  # null (NaN at the source) is not a number to log
    assert metrics["reward/mean"] == pytest.approx(0.3)
    line = console_line({"b": 2.0, "a": 0.5}, 3, "train")
    assert line == "train step:3 - a:0.5 - b:2"
    assert mlflow_key("reward/nq:dev/mean") == "reward/nq_dev/mean"
    columns, data = sample_table(ROWS)
    row = dict(zip(columns, data[0], strict=True))
    assert "[1] search: Ada  -> 7 Ada Vel" in row["turns"]
    assert json.loads(row["ground_truth"]) == {"target": ["Pigir"]}
    assert redact({"a": {"weight_sync_token": "x", "n": 1}, "u": ["redis://u:p@h/0"]}) == \
        {"a": {"weight_sync_token": "***", "n": 1}, "u": ["redis://u:***@h/0"]}
    assert redact({"weight_sync_token": None}) == {"weight_sync_token": None}
    server = {"name": "kb", "url": "http://kb:8000/mcp",
              "headers": {"Authorization": "Bearer literal-secret", "X-Tenant": "t1"}}
    assert redact({"rollout": {"mcp_servers": [server]}}) == {"rollout": {"mcp_servers": [
        {"name": "kb", "url": "http://kb:8000/mcp",
         "headers": {"Authorization": "***", "X-Tenant": "***"}}]}}


def test_every_tracker_writes_real_files_and_resume_continues(tmp_path, caplog):
    for module in ("tensorboard", "wandb", "mlflow"):
        import_or_skip(module, "the trackers extra (make install: the dev extra brings it)")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    names = ["console", "jsonl", "tensorboard", "wandb", "mlflow", "console"]
    caplog.set_level(logging.INFO, logger="forage.learner.metrics")
    trackers = open_trackers(names, run_dir, "tracked", CONFIG)
    assert trackers.names == ["console", "tensorboard", "wandb", "mlflow"]
    trackers.log_metrics(_eval(0))
    for step in (1, 2, 3):
        trackers.log_metrics(_train(step))
        if step == 2:  # as the loop does: right after the step's metrics line
            trackers.log_samples(ROWS, 2, "train")
    trackers.close()
    assert "train step:2 - actor/grad_norm:3" in caplog.text
    state = json.loads((run_dir / STATE_FILE).read_text())

    # TensorBoard: scalars per key and step, the sample table as text.
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")] == \
        [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.step for e in events.Scalars("eval/em")] == [0]
    assert "actor/entropy" not in events.Tags()["scalars"]
    assert "samples/train/text_summary" in events.Tags()["tensors"]

    # wandb (offline: no key in the test environment): the run file holds the history.
    run_ids, history = wandb_history(run_dir)
    assert run_ids == {state["wandb"]["id"]} and state["wandb"]["mode"] == "offline"
    assert history[2]["reward/mean"] == pytest.approx(0.2)
    assert history[0]["eval/em"] == pytest.approx(0.25)
    assert history[2]["samples/train/_type"] == "table-file"
    [table] = run_dir.glob("wandb/offline-run-*/files/" + history[2]["samples/train/path"])
    body = json.loads(table.read_text())
    assert body["data"][0][body["columns"].index("answer")] == "Pigir"

    # MLflow: the SQLite store in RUN_DIR, metrics by step, params, the sample artifact.
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = state["mlflow"]["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "actor/grad_norm")] \
        == [(1, 2.0), (2, 3.0), (3, 4.0)]
    run = client.get_run(run_id)
    assert run.data.params["learner.lr"] == "1e-05"
    # secrets never leave the run: the token and the Redis password are redacted
    assert run.data.params["learner.weight_sync_token"] == "***"
    assert run.data.params["redis.url"] == "redis://:***@10.0.0.5:6379/0"
    assert not any("s3cret" in v or "hunter2" in v for v in run.data.params.values())
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    [artifact] = client.list_artifacts(run_id, "samples")
    assert artifact.path == "samples/train_step_00000002.json"
    assert (run_dir / "mlflow-artifacts").is_dir()

    # Resume from a step-2 checkpoint: step 3 runs again (new values), then step 4.
    trackers = open_trackers(names, run_dir, "tracked", CONFIG, resumed_step=2)
    for step in (3, 4):
        trackers.log_metrics({**_train(step), "reward/mean": 1.0 + step})
    trackers.close()
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")][-2:] == \
        [(3, 4.0), (4, 5.0)]
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]  # old 3 purged
    run_ids, history = wandb_history(run_dir)
    assert run_ids == {state["wandb"]["id"]}  # the same wandb run, continued
    assert history[4]["reward/mean"] == pytest.approx(5.0)
    resumed = json.loads((run_dir / STATE_FILE).read_text())
    assert resumed["mlflow"]["run_id"] == run_id
    steps = [m.step for m in client.get_metric_history(run_id, "reward/mean")]
    assert 4 in steps and len(client.search_runs([run.info.experiment_id])) == 1

    # A fresh (not resumed) run in the same directory starts new tracker runs.
    trackers = open_trackers(["wandb", "mlflow"], run_dir, "tracked", CONFIG)
    trackers.close()
    fresh = json.loads((run_dir / STATE_FILE).read_text())
    assert fresh["wandb"]["id"] != state["wandb"]["id"]
    assert fresh["mlflow"]["run_id"] != run_id


@pytest.mark.parametrize("name,module", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                         ("mlflow", "mlflow")])
def test_chosen_tracker_not_installed_is_one_clear_error(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is absent
    with pytest.raises(TrackerError) as info:
        open_trackers(["console", name], tmp_path, "x", {})
    message = str(info.value)
    assert "\n" not in message
    assert f"'{name}'" in message and f"forage[{name}]" in message
    assert not (tmp_path / STATE_FILE).exists()


def test_logger_key_validated_at_config_load(tmp_path):
    from services.common.config import ConfigError

    cfg = load_config(None, ["learner.logger=[console,tensorboard]"])
    assert cfg.learner.logger == ["console", "tensorboard"]
    assert load_config(None, []).learner.logger == ["console", "jsonl"]
    with pytest.raises(ConfigError, match="tensorbored"):
        load_config(None, ["learner.logger=[tensorbored]"])


def test_learner_refuses_a_missing_tracker_before_loading_the_model(tmp_path, tiny_policy):
    """`forage learner train` with logger [wandb] and no wandb: exit 2, one line, no run."""
    import os
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "synth_single", "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["a"]}},
        "extra_info": {"index": 0}}]), data)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(tiny_policy)},
        "data": {"train_files": [str(data)]}, "learner": {"logger": ["console", "wandb"]}}))
    code = ("import sys; sys.modules['wandb'] = None; from services.cli import main; "
            f"sys.exit(main(['learner', 'train', '--config', {str(config)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode == 2, out.stdout + out.stderr
    [line] = [text for text in out.stderr.splitlines() if text.strip()]
    assert line.startswith("forage learner train: error: learner.logger has 'wandb'")
    assert "forage[wandb]" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
