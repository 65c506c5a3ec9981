"""`forage eval --run RUN_DIR` on a run directory laid out as `forage up` writes one (the
tiny policy as its checkpoints, the eval world's index and questions at paths relative to
where `forage` ran), `--model` pointing into a run, and where in-process retrieval runs
(`--device`, `--retriever-device`, `--index-device`, `--query-dtype`).

The real reproduction (a quick demo's last in-run evaluation, EM and n and the very turns) is
tests/launch/test_demo.py::test_eval_run_reproduces_the_runs_last_evaluation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from services.eval.evaluate import EvalError, EvalRequest, run
from services.eval.from_run import RunError, RunInfo, select_questions
from services.eval.runner import EvalSettings

from .conftest import forage

RUN_SETTINGS = {"max_turns": 1, "max_tokens_per_turn": 6, "max_obs_length": 40,
                "max_response_length": 48, "max_prompt_length": 384}


def make_run(tmp_path: Path, world: dict[str, Path], steps=(2, 4), **sections) -> Path:
    """launch/runs/r1 as `forage up` leaves it when run from launch/ with relative paths;
    its config carries redacted secrets, as every saved config.yaml does."""
    launch = tmp_path / "launch"
    run_dir = launch / "runs" / "r1"
    (launch / "data").mkdir(parents=True)
    shutil.copy(world["search_r1"], launch / "data" / "test.parquet")
    (launch / "indexes").mkdir()
    (launch / "indexes" / "world").symlink_to(world["index"], target_is_directory=True)
    for step in steps:
        shutil.copytree(world["policy"], run_dir / "checkpoints" / f"step_{step:08d}" / "policy")
    if steps:
        (run_dir / "checkpoints" / "latest").write_text(f"step_{max(steps):08d}")
    config = {
        "run_id": "r1", "run_dir": "runs/r1",
        "redis": {"url": "redis://forage:***@127.0.0.1:6379/0", "namespace": "r1"},
        "retriever": {"topk": 1, "index_dir": "indexes/world", "query_dtype": "float32"},
        "rollout": {"engine": "transformers", "device": "cpu", "dtype": "auto",
                    **RUN_SETTINGS},
        "learner": {"weight_sync_token": "***", "eval_max_questions": 3,
                    "eval_temperature": 0.0},
        "data": {"test_files": ["data/test.parquet"], "max_test_items": 5},
        "model": {"path": str(world["policy"])},
    }
    for section, values in sections.items():
        config[section].update(values)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def test_a_saved_config_with_redacted_secrets_is_read_for_what_eval_needs(eval_world, tmp_path,
                                                                          monkeypatch):
    from services.common.config import ConfigError, load_config

    run_dir = make_run(tmp_path, eval_world)
    with pytest.raises(ConfigError, match=r"\*\*\*"):  # what --run must not trip over
        load_config(run_dir / "config.yaml", environ={})
    monkeypatch.chdir(tmp_path)  # not where forage ran: paths resolve from launch/
    info = RunInfo.read(run_dir)
    assert info.settings() == {"topk": 1, **RUN_SETTINGS, "temperature": 0.0,
                               "protocol": "tags", "stop_strings": ("</search>", "</answer>")}
    assert info.test_files() == [str(tmp_path / "launch" / "data" / "test.parquet")]
    assert info.index_dir() == str(tmp_path / "launch" / "indexes" / "world")
    assert info.checkpoint(None) == (4, run_dir / "checkpoints" / "step_00000004" / "policy")
    assert info.checkpoint(2)[0] == 2
    assert info.checkpoint(0) == (0, Path(str(eval_world["policy"])))  # the starting policy


def test_run_inputs_that_are_missing_are_one_line_naming_the_key(eval_world, tmp_path,
                                                                 monkeypatch):
    run_dir = make_run(tmp_path, eval_world, data={"test_files": ["data/gone.parquet"]})
    monkeypatch.chdir(tmp_path)
    info = RunInfo.read(run_dir)
    with pytest.raises(RunError, match=r"data.test_files\[0\] data/gone.parquet does not "
                                       r"exist \(looked in .*\); pass --data FILE"):
        info.test_files()
    with pytest.raises(RunError, match=r"no checkpoint of step 3 \(steps saved: 2, 4"):
        info.checkpoint(3)
    for args, message in [
        (["--run", str(run_dir)], "data.test_files[0] data/gone.parquet does not exist"),
        (["--run", str(run_dir), "--step", "3"], "no checkpoint of step 3"),
        (["--run", str(tmp_path)], "no config.yaml in it"),
        (["--step", "2", "--model", "m", "--data", "d", "--mode", "agent", "--out", "o"],
         "--step needs --run"),
        (["--mode", "agent"], "--model, --data, --out required (or --run RUN_DIR"),
    ]:
        done = forage("eval", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_questions_are_the_learners_evaluation_subset(eval_world):
    from services.eval.data import load_questions
    from services.learner.prompts import eval_subset, load_dataset

    files = [str(eval_world["search_r1"])]
    rows = load_dataset(files, 5)
    picked = [rows[i]["id"] for i in eval_subset(rows, 3)]
    chosen = select_questions(load_questions(files), 5, 3)
    assert [q.qid for q in chosen] == [f"hotpotqa/{ident}" for ident in picked]
    assert len(chosen) == 3


def test_a_tool_calls_run_is_asked_with_the_test_files_prompt(eval_world):
    from services.eval.data import load_questions
    from services.eval.prompts import tool_agent_prompt
    from services.eval.runner import agent_prompt

    question = load_questions([str(eval_world["search_r1"])])[0]
    tools = EvalSettings(protocol="tool_calls")
    assert agent_prompt(tools, question) == tool_agent_prompt(question.question)
    run_like = EvalSettings(protocol="tool_calls", data_prompt=True)
    assert agent_prompt(run_like, question) == question.agent_prompt
    assert run_like.as_dict()["data_prompt"] is True
    # tags rows ask the data's prompt either way; the field stays out of their config
    assert agent_prompt(EvalSettings(data_prompt=True), question) == question.agent_prompt
    assert "data_prompt" not in EvalSettings(data_prompt=True).as_dict()
    assert "data_prompt" not in tools.as_dict()


def test_eval_run_takes_the_runs_checkpoint_questions_index_and_settings(eval_world, tmp_path):
    run_dir = make_run(tmp_path, eval_world)
    done = forage("eval", "--run", str(run_dir), "--batch-size", "3", one_thread=True)
    assert done.returncode == 0, done.stderr
    out = run_dir / "eval" / "step_00000004"
    config = json.loads((out / "config.json").read_text())
    assert config["models"][0]["path"].endswith("step_00000004/policy")
    assert config["modes"] == ["agent"] and config["questions"] == 3
    assert config["run_questions"] == {"max_test_items": 5, "eval_max_questions": 3}
    assert config["settings"] == {"topk": 1, **RUN_SETTINGS, "temperature": 0.0, "top_p": 1.0,
                                  "top_k": 0, "seed": 0, "batch_size": 3}
    assert config["data"][0]["path"] == str(tmp_path / "launch" / "data" / "test.parquet")
    assert "not as the run evaluated" not in done.stderr  # nothing was changed
    assert "the run has no evaluation of step 4" in done.stdout  # no metrics.jsonl here
    # a flag still wins, and is named against the run's value
    done = forage("eval", "--run", str(run_dir), "--step", "2", "--topk", "2", "--limit", "1",
                  "--out", str(tmp_path / "o2"), one_thread=True)
    assert done.returncode == 0, done.stderr
    assert "not as the run evaluated (the flags given win):" in done.stderr
    assert "  --topk: 2 here, 1 in the run (retriever.topk)" in done.stderr
    config = json.loads((tmp_path / "o2" / "config.json").read_text())
    assert config["settings"]["topk"] == 2 and config["questions"] == 1
    assert config["models"][0]["path"].endswith("step_00000002/policy")


def test_a_model_inside_a_run_says_which_settings_differ_from_the_runs(eval_world, tmp_path):
    run_dir = make_run(tmp_path, eval_world)
    model = run_dir / "checkpoints" / "step_00000002" / "policy"
    done = forage("eval", "--model", str(model), "--data", str(eval_world["search_r1"]),
                  "--index", str(eval_world["index"]), "--mode", "agent", "--limit", "1",
                  "--max-turns", "1", "--max-tokens-per-turn", "6", "--max-response-length",
                  "48", "--out", str(tmp_path / "out"), one_thread=True)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert f"--model is a checkpoint of run {run_dir}" in err
    for line in ("  --topk: 3 here, 1 in the run (retriever.topk)",
                 "  --max-obs-length: 500 here, 40 in the run (rollout.max_obs_length)",
                 "  --max-prompt-length: 4096 here, 384 in the run (rollout.max_prompt_length)",
                 f"  --data: [{eval_world['search_r1']}] here, "
                 f"[{tmp_path / 'launch' / 'data' / 'test.parquet'}] in the run "
                 "(data.test_files)"):
        assert line in err, err
    # the flags given that match the run's are not listed
    assert "--max-turns:" not in err and "--max-tokens-per-turn:" not in err
    assert "--max-response-length:" not in err
    # a model outside any run: nothing is said
    done = forage("eval", "--model", str(eval_world["policy"]), "--data",
                  str(eval_world["search_r1"]), "--mode", "direct", "--limit", "1",
                  "--max-tokens-per-turn", "4", "--out", str(tmp_path / "plain"),
                  one_thread=True)
    assert done.returncode == 0 and "checkpoint of run" not in done.stderr, done.stderr


# ---------------------------------------------------------------- in-process retrieval device


@pytest.fixture()
def loads(monkeypatch):
    """Every Searcher.load call's keyword arguments; the load then stops the evaluation (no
    model is loaded: the searcher comes before the engine)."""
    from services.retriever.manifest import IndexLoadError
    from services.retriever.searcher import Searcher

    calls: list[dict] = []

    def load(index_dir, **kwargs):
        calls.append(kwargs)
        raise IndexLoadError("stopped by the test")

    monkeypatch.setattr(Searcher, "load", staticmethod(load))
    return calls


def _request(world, tmp_path, **kwargs) -> EvalRequest:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"  # each its own config
    return EvalRequest(models=[str(world["policy"])], data=[str(world["search_r1"])],
                       modes=["agent"], out=str(out), index=str(world["index"]),
                       settings=EvalSettings(max_tokens_per_turn=4), **kwargs)


def test_the_device_and_query_precision_reach_the_in_process_searcher(eval_world, tmp_path,
                                                                      loads, monkeypatch):
    from services.retriever.encoder import resolve_query_dtype

    for kwargs, device, index_device, dtype in [
        ({}, "cpu", None, resolve_query_dtype("auto", "cpu")),  # the server's `auto` on cpu
        ({"retriever_device": "cpu", "query_dtype": "float32"}, "cpu", None, "float32"),
        ({"query_dtype": "bfloat16"}, "cpu", None, "bfloat16"),
    ]:
        with pytest.raises(EvalError, match="stopped by the test"):
            run(_request(eval_world, tmp_path, **kwargs))
        call = loads.pop()
        assert (call["device"], call["index_device"], call["query_dtype"]) == (
            device, index_device, dtype), kwargs
    # On a CUDA machine (its checks passed here): the engine's --device places the searcher
    # too, queries in float16 as the retriever server encodes them there; --index-device and
    # --retriever-device place it otherwise.
    monkeypatch.setattr("services.retriever.searcher.check_placement", lambda *a, **k: None)
    for kwargs, device, index_device, dtype in [
        ({"device": "cuda"}, "cuda", None, "float16"),
        ({"device": "cuda", "index_device": "cpu"}, "cuda", "cpu", "float16"),
        ({"device": "cuda", "retriever_device": "cpu"}, "cpu", None,
         resolve_query_dtype("auto", "cpu")),
    ]:
        with pytest.raises(EvalError, match="stopped by the test"):
            run(_request(eval_world, tmp_path, **kwargs))
        call = loads.pop()
        assert (call["device"], call["index_device"], call["query_dtype"]) == (
            device, index_device, dtype), kwargs
    # a run's search overrides reach it, and key the results
    with pytest.raises(EvalError, match="stopped by the test"):
        run(_request(eval_world, tmp_path, search_params={"k_factor": 4}))
    assert loads.pop()["search_params"] == {"k_factor": 4}


def test_a_device_the_searcher_cannot_use_is_one_line_before_anything_loads(eval_world,
                                                                            tmp_path):
    base = ["eval", "--model", str(eval_world["policy"]), "--data", str(eval_world["search_r1"]),
            "--mode", "agent", "--index", str(eval_world["index"]), "--out",
            str(tmp_path / "out")]
    for extra, message in [
        (["--device", "cuda:99"], "--device cuda:99 cannot be used"),
        (["--retriever-device", "cuda:99"], "--retriever-device cuda:99 cannot be used"),
        (["--index-device", "cuda:99"], "--index-device cuda:99 cannot be used"),
        (["--device", "gpu"], "--device: unknown device 'gpu'"),
        (["--retriever-url", "http://127.0.0.1:9/retrieve", "--retriever-device", "cpu"],
         "--retriever-device, --index-device and --query-dtype place the index searched in "
         "this process"),
    ]:
        done = forage(*base, *extra)
        assert done.returncode == 2, (extra, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "out" / "samples.jsonl").exists()
