"""`forage eval --namespace NS`: mode agent played by a running `forage rollout serve` replica
over real Redis streams, against the same questions played in process with greedy decoding;
and the errors a user meets (no replica, a mode or a flag the replicas cannot take).

Real parts: the session's Redis (`redis_url`), a replica process on the tiny policy, the CLI
as a user runs it. The tiny untrained policy never searches, so the replica's retriever URL has
nobody behind it (a search would fail its trajectory and the test would say so)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest
import yaml

from services.eval.evaluate import EvalError, EvalRequest, run
from services.eval.replicas import Target
from services.eval.runner import EvalSettings

from .conftest import FORAGE, REPO
from .conftest import forage as run_forage

TOKENS = 8  # the replica's rollout.max_tokens_per_turn (not the eval's default, 500)


def forage(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_forage(*args, timeout=timeout, one_thread=True)


@pytest.fixture(scope="module")
def replica(redis_url, eval_world, tmp_path_factory):
    """One `forage rollout serve` process on its own namespace; yields (namespace, log)."""
    import redis

    from services.common.ports import free_port

    work = tmp_path_factory.mktemp("replica")
    namespace = f"test-eval-{uuid.uuid4().hex[:8]}"
    config = work / "replica.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_url, "namespace": namespace},
        "model": {"path": str(eval_world["policy"])},
        "retriever": {"url": f"http://127.0.0.1:{free_port()}/retrieve"},
        "data": {"n_samples": 1},
        "rollout": {"weight_sync": False, "max_batch_size": 4, "heartbeat_s": 0.2,
                    "heartbeat_ttl_s": 5, "max_tokens_per_turn": TOKENS, "name": "eval-r1",
                    "metrics_port": 0}}))
    log = work / "replica.log"
    proc = subprocess.Popen([*FORAGE, "rollout", "serve", "--config", str(config)], cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 120
        while client.get(f"{namespace}:heartbeat:rollout:eval-r1") is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield namespace, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        keys = list(client.scan_iter(match=f"{namespace}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def data_args(eval_world) -> list[str]:
    return ["--model", str(eval_world["policy"]), "--data", str(eval_world["flashrag"]),
            "--limit", "3", "--mode", "agent"]


@pytest.mark.slow
def test_replicas_play_what_the_engine_here_plays(eval_world, replica, redis_url, tmp_path):
    import redis

    from services.common.codec import decode_as
    from services.common.trajectory import Trajectory

    namespace, log = replica
    out = tmp_path / "replicas"
    done = forage("eval", *data_args(eval_world), "--namespace", namespace, "--redis",
                  redis_url, "--out", str(out))
    assert done.returncode == 0, done.stderr + log.read_text()[-2000:]
    assert "3/3 questions" in done.stderr
    assert f"played by the replicas of namespace {namespace}" in done.stdout
    doc = json.loads((out / "eval.json").read_text())
    # The replica's own settings are adopted (it plays 8 tokens a turn, not the default 500).
    assert doc["config"]["settings"]["max_tokens_per_turn"] == TOKENS
    assert doc["rows"][0]["replicas"] == {
        "namespace": namespace, "models": [str(eval_world["policy"])],
        "engines": ["transformers"], "policy_versions": [0]}

    # The same questions in process, greedy, with the replica's settings.
    here = tmp_path / "here"
    done = forage("eval", *data_args(eval_world), "--retriever-url",
                  "http://127.0.0.1:9/retrieve", "--max-tokens-per-turn", str(TOKENS),
                  "--out", str(here))
    assert done.returncode == 0, done.stderr
    # The same lines (written in the order the answers arrive), the same figures.
    assert sorted((out / "samples.jsonl").read_text().splitlines()) == \
        sorted((here / "samples.jsonl").read_text().splitlines())
    for key in ("em", "subem", "f1", "n", "turns", "response_tokens", "finish_reasons"):
        assert doc["rows"][0][key] == json.loads((here / "eval.json").read_text())["rows"][0][
            key], key

    # Marked for no training: every trajectory the replica published is an eval one of ours,
    # and our consumer group is gone once the run completed.
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(f"{namespace}:rollouts")
    kinds = {(decode_as(f[b"payload"], Trajectory).kind,
              decode_as(f[b"payload"], Trajectory).uid.startswith("forage-eval:"))
             for _, f in entries}
    assert kinds == {("eval", True)}
    groups = [g["name"] for g in client.xinfo_groups(f"{namespace}:rollouts")]
    assert not [g for g in groups if str(g).find("forage-eval-") >= 0]
    client.close()

    # A rerun finds every question done: nothing is published, the same figures.
    before = (out / "eval.json").read_bytes()
    done = forage("eval", *data_args(eval_world), "--namespace", namespace, "--redis",
                  redis_url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "eval.json").read_bytes() == before
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(f"{namespace}:prompts") == 3

    # Resuming an interrupted run plays only what is missing, to the same figures.
    samples = (out / "samples.jsonl").read_text().splitlines()
    (out / "samples.jsonl").write_text(samples[0] + "\n" + samples[1][:40])  # a torn line
    done = forage("eval", *data_args(eval_world), "--namespace", namespace, "--redis",
                  redis_url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "3/3 questions" in done.stderr and client.xlen(f"{namespace}:prompts") == 5
    assert (out / "eval.json").read_bytes() == before
    client.close()


@pytest.mark.slow
def test_a_flag_the_replicas_disagree_with_is_refused(eval_world, replica, redis_url,
                                                      tmp_path):
    namespace, _ = replica
    request = EvalRequest(models=[str(eval_world["policy"])], data=[str(eval_world["flashrag"])],
                          modes=["agent"], out=str(tmp_path / "out"), limit=1,
                          settings=EvalSettings(max_tokens_per_turn=16),
                          given={"max_tokens_per_turn"},
                          replicas=Target(redis_url, namespace, timeout_s=5))
    with pytest.raises(EvalError, match=r"--max-tokens-per-turn 16, but the replicas play "
                                        rf"rollout.max_tokens_per_turn={TOKENS}"):
        run(request)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["no replica", "no redis"])
def test_no_replica_is_one_line_and_exit_code_75(eval_world, redis_url, tmp_path, case):
    namespace = f"test-nobody-{uuid.uuid4().hex[:8]}"
    url = redis_url if case == "no replica" else "redis://127.0.0.1:9/0"
    done = forage("eval", *data_args(eval_world), "--namespace", namespace, "--redis",
                  url, "--replica-timeout", "0.5", "--out", str(tmp_path / "out"))
    assert done.returncode == 75, done.stderr
    assert (f"no rollout replica serves namespace '{namespace}'" if case == "no replica"
            else "--redis redis://127.0.0.1:9/0 does not answer") in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("fields", "message"), [
    ({"modes": ["direct", "agent"]}, "mode(s) direct run in this process"),
    ({"index": "somewhere"}, "--namespace does not take --index: for an evaluation in this "
                             "process only"),
    ({"engine": "vllm", "retrieval": "record"},
     "--namespace does not take --retrieval record, --engine vllm"),
])
def test_what_only_runs_in_process_is_refused_before_connecting(eval_world, tmp_path, fields,
                                                                message):
    base = {"models": [str(eval_world["policy"])], "data": [str(eval_world["flashrag"])],
            "modes": ["agent"], "out": str(tmp_path / "out"),
            # nothing listens there: the refusal must come before any connection
            "replicas": Target("redis://127.0.0.1:9/0", "nobody", timeout_s=0.1)}
    with pytest.raises(EvalError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(EvalRequest(**{**base, **fields}))
