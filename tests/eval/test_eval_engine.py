"""`forage eval --engine`: the engine comes from the rollout's factory (services/rollout/engines.py)
with the rollout's config keys; vLLM where it is not installed is one line and exit code 2."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from services.eval.cli import register
from services.eval.evaluate import EvalError, EvalRequest, engine_config, run
from services.eval.runner import EvalSettings
from services.rollout.engines import vllm_engine_kwargs

REPO = Path(__file__).resolve().parents[2]
# `python -m services.cli` where `import vllm` fails (a None entry in sys.modules: find_spec
# answers None and the import raises ImportError), as on a machine without vLLM.
HIDE_VLLM = ("import sys; sys.modules['vllm'] = None; from services.cli import main; "
             "sys.exit(main())")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(["--model", "m", "--data", "d", "--mode", "direct", "--out", "o",
                              *argv])


def test_the_flag_defaults_to_transformers_and_takes_vllm():
    assert parse().engine == "transformers" and parse().engine_set == []
    args = parse("--engine", "vllm", "--set", "rollout.gpu_memory_utilization=0.5")
    assert args.engine == "vllm" and args.engine_set == ["rollout.gpu_memory_utilization=0.5"]
    with pytest.raises(SystemExit):
        parse("--engine", "sglang")


def test_the_engine_config_has_the_rollout_keys_of_the_evaluation(tmp_path):
    request = EvalRequest(models=["m"], data=[], modes=["direct"], out=str(tmp_path),
                          device="cpu", dtype="float32",
                          settings=EvalSettings(batch_size=7, seed=3))
    config = engine_config(request, "models/policy")
    assert config.model.path == "models/policy"
    rollout = config.rollout
    assert (rollout.engine, rollout.device, rollout.dtype, rollout.max_batch_size,
            rollout.seed) == ("transformers", "cpu", "float32", 7, 3)


def test_vllm_gets_the_same_settings_keys_as_a_replica(tmp_path, monkeypatch):
    """The EngineArgs mapping is pure, so it is checked here without vLLM."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not installed, wherever it is
    request = EvalRequest(models=["m"], data=[], modes=["direct"], out=str(tmp_path),
                          dtype="bfloat16", engine="vllm",
                          engine_settings=["rollout.gpu_memory_utilization=0.5",
                                           "rollout.vllm_engine_args.kv_cache_dtype=fp8"],
                          settings=EvalSettings(batch_size=64, seed=1))
    with pytest.raises(EvalError, match="--engine: vllm needs the `vllm` package"):
        engine_config(request, "models/policy")
    config = engine_config(request, "models/policy", check=False)
    kwargs = vllm_engine_kwargs(config.rollout, config.model, config.learner.lora)
    assert kwargs["max_num_seqs"] == 64 and kwargs["seed"] == 1
    assert kwargs["dtype"] == "bfloat16" and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["model"] == "models/policy"


@pytest.mark.parametrize(("item", "message"), [
    ("gpu_memory_utilization=0.5", "expected rollout.KEY=VALUE"),
    ("rollout.max_batch_size=3", "--batch-size"),
    ("rollout.gpu_memory_utilisation=0.5", "not an engine setting"),
    ("rollout.max_turns=2", "not an engine setting"),
    ("rollout.vllm_engine_args=[1]", "rollout.vllm_engine_args"),
    ("rollout.gpu_memory_utilization=2", "rollout.gpu_memory_utilization"),
])
def test_bad_engine_settings_are_one_line(tmp_path, item, message):
    request = EvalRequest(models=["m"], data=[], modes=["direct"], out=str(tmp_path),
                          engine_settings=[item])
    with pytest.raises(EvalError, match=message.replace(".", r"\.")):
        engine_config(request, "m")


def test_a_bad_dtype_names_the_flag(tmp_path):
    request = EvalRequest(models=["m"], data=[], modes=["direct"], out=str(tmp_path),
                          dtype="float8")
    with pytest.raises(EvalError, match="--dtype"):
        engine_config(request, "m")


def test_transformers_path_is_the_factory_s_engine(eval_world, tmp_path):
    """The default builds the TransformersEngine with the evaluation's batch size and seed,
    and an output directory keeps no engine field (older directories still resume)."""
    from services.eval import evaluate
    from services.rollout.transformers_engine import TransformersEngine

    request = EvalRequest(models=[str(eval_world["policy"])], data=[str(eval_world["flashrag"])],
                          modes=["direct"], out=str(tmp_path / "out"), limit=1,
                          settings=EvalSettings(batch_size=2, seed=5, max_tokens_per_turn=4))
    engine = evaluate._engine(str(eval_world["policy"]), request)
    assert isinstance(engine, TransformersEngine) and engine.max_batch_size == 2
    del engine
    doc = run(request)
    assert "engine" not in doc["config"] and doc["rows"][0]["n"]["all"] == 1


def test_the_factory_refuses_vllm_where_it_is_missing(tiny_policy_dir, monkeypatch):
    """A rollout replica gets the same one line (a ConfigError: exit code 2) before loading."""
    from services.common.config import ConfigError, load_config
    from services.rollout.engines import make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not installed, wherever it is

    config = load_config(None, [f"model.path={tiny_policy_dir}", "rollout.engine=vllm"],
                         environ={})
    with pytest.raises(ConfigError, match="rollout.engine: vllm needs the `vllm` package"):
        make_engine(config)


def test_vllm_not_installed_is_one_line_and_exit_code_2(eval_world, tmp_path):
    done = subprocess.run(  # `python -m services.cli` with vLLM not installed, wherever it is
        [sys.executable, "-c", HIDE_VLLM, "eval", "--model", str(eval_world["policy"]),
         "--data", str(eval_world["flashrag"]), "--mode", "direct", "--engine", "vllm",
         "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "vllm" in lines[0] and "not installed" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written
