"""The scorer service with real Redis: batch in → same count out, poison → dead letter, a
SIGKILLed scorer's batch finished by a second one, POST /score and `forage score`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import httpx
import msgpack
import pytest
import redis

from services.common.codec import decode_as, encode
from services.common.config import load_config
from services.common.streams import RedisStreams
from services.common.tools import tool_specs
from services.common.trajectory import EvidenceProbe, Probe, ScoredTrajectory, Trajectory
from services.scorer.pool import RewardPool
from services.scorer.rewards.registry import RewardTable
from services.scorer.scoring import Scorer
from services.scorer.worker import ScorerWorker

FORAGE = str(Path(sys.executable).parent / "forage")
QA_GT = {"target": ["Paris"]}


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=10.0) as started:
        yield started


def _worker(redis_url, namespace, tokenizer, pool, **overrides):
    sets = [f"redis.url={redis_url}", f"redis.namespace={namespace}"]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    config = load_config(None, sets)
    streams = RedisStreams.from_config(config.redis)
    return ScorerWorker(config, Scorer(pool=pool, inner_timeout_s=1), tokenizer, streams), streams


def _scored(streams) -> list[ScoredTrajectory]:
    entries = streams.client.xrange(streams.key("scored"))
    return [decode_as(fields[b"payload"], ScoredTrajectory) for _, fields in entries]


def test_batch_in_same_number_out(redis_url, namespace, tokenizer, pool, make_trajectory):
    worker, streams = _worker(redis_url, namespace, tokenizer, pool)
    probe = Probe(fractions=[0.0, 0.5, 1.0],
                  samples=[[" Rome </answer>", " Lyon </answer>"],
                           [" Paris </answer>", " Lyon </answer>"],
                           [" Paris </answer>", " Paris </answer>"]])
    trajectories = [
        make_trajectory("synth_single", "<think>x</think><answer> Paris </answer>",
                        QA_GT, probe=probe),
        make_trajectory("synth_multihop", "<think>x</think><answer> Rome </answer>",
                        QA_GT),
        make_trajectory("nq", "<answer>paris</answer>", QA_GT, kind="eval"),
        make_trajectory("synth_math", "so \\boxed{\\frac{1}{2}}", "0.5"),
        make_trajectory("synth_math", "so \\boxed{3}", "4"),
        make_trajectory("countdown", "<answer>(1 + 2) * 3</answer>",
                        {"target": 9, "numbers": [1, 2, 3]}),
    ]
    # probe.evidence rewrites, scored after the truncation probe's samples (format credit 0)
    trajectories[0].evidence = EvidenceProbe(
        {"none": ["<think> hmm </think>\n<answer> Rome </answer>"],
         "swapped": ["<answer> Paris </answer>", "<answer> Lyon </answer>"]}, donor="g9")
    trajectories[1].evidence = EvidenceProbe({"none": ["<answer> Paris </answer>"]})
    streams.ensure_group("rollouts")
    streams.publish_many("rollouts", [encode(t) for t in trajectories])
    worker.run(max_batches=1)
    scored = {s.trajectory.sample_id: s for s in _scored(streams)}
    assert len(scored) == len(trajectories)
    rewards = [scored[t.sample_id].reward for t in trajectories]
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    first = scored[trajectories[0].sample_id]
    assert first.probe_scores == [0.0, 0.5, 1.0] and first.reward_components == {"qa_em": 1.0}
    assert first.evidence_scores == {"real": 1.0, "none": 0.0, "swapped": 0.5, "gap": 0.5}
    assert first.trajectory.evidence.donor == "g9"
    assert scored[trajectories[1].sample_id].evidence_scores == {"real": 0.0, "none": 1.0}
    assert scored[trajectories[2].sample_id].evidence_scores is None
    assert scored[trajectories[2].sample_id].trajectory.kind == "eval"
    np_equal = scored[trajectories[3].sample_id].trajectory.response_ids.tolist()
    assert np_equal == trajectories[3].response_ids.tolist()
    assert streams.pending("rollouts") == 0 and streams.lag("rollouts") == 0
    assert streams.dead_letters() == []
    streams.close()


def _tool_calls_trajectory(tokenizer, turns: list[tuple[str, str | None]]) -> Trajectory:
    """A tool_calls trajectory as the agent loop builds one with the tiny policy's chat
    template: each turn's ids (mask 1), then the template's inserted ids for its tool result
    (mask 0); the last turn ends on the end-of-turn token."""
    from services.rollout.tools import ChatTurns

    chat = ChatTurns(tokenizer, tool_specs(["search", "calculator"]))
    question = [{"role": "user", "content": "Capital of France?"}]
    response: list[int] = []
    mask: list[int] = []
    for text, result in turns:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if result is None:
            ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        response += ids
        mask += [1] * len(ids)
        if result is not None:
            name = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])["name"]
            inserted = chat.inserted_ids(question, [{"role": "tool", "name": name,
                                                     "content": result}])
            response += inserted
            mask += [0] * len(inserted)
    uid = uuid.uuid4().hex[:8]
    return Trajectory(uid=uid, sample_id=f"{uid}:0:0",
                      data_source="nq", policy_version=1,
                      prompt_ids=chat.prompt_ids(question), response_ids=response,
                      loss_mask=mask, rollout_logprobs=[0.0] * len(response),
                      ground_truth=QA_GT, protocol="tool_calls",
                      probe=Probe(fractions=[0.0, 1.0],
                                  samples=[[" Rome </answer>"], [" Paris </answer>"]]))


def test_tool_calls_trajectories_are_scored_by_their_protocol(redis_url, namespace, tokenizer,
                                                              pool, make_trajectory):
    """Over Redis: the worker decodes a tool_calls response with the template's markers and
    the rewards read its final answer and its turns' format (docs/scorer.md, "Tool calls")."""
    config = load_config(None, [f"redis.url={redis_url}", f"redis.namespace={namespace}"])
    streams = RedisStreams.from_config(config.redis)
    table = RewardTable({"nq": [{"function": "qa_em"},
                                {"function": "qa_em_format", "weight": 0.5}]})
    worker = ScorerWorker(config, Scorer(table, pool=pool, inner_timeout_s=1), tokenizer, streams)

    def search(query):
        return f'<tool_call>\n{json.dumps({"name": "search", "arguments": {"query": query}})}\n</tool_call>'

    passage = 'Doc 1(Title: "France") The capital is Paris. <answer> Lyon </answer>'
    calc = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    trajectories = [
        # well-formed: EM 1 + 0.5 * 1
        _tool_calls_trajectory(tokenizer, [(search("France"), passage),
                                           ("<answer> Paris </answer>", None)]),
        # calculator is not among this run's rollout.tools ([search]): ill-formed, 1 + 0.5 * 0.8
        _tool_calls_trajectory(tokenizer, [(calc, "2"), ("<answer> Paris </answer>", None)]),
        # no final answer; the passage's answer tags are not the policy's: 0 + 0.5 * 0
        _tool_calls_trajectory(tokenizer, [(search("France"), passage), (search("Lyon"), None)]),
        # a tags record beside them, read as before: 1 + 0.5 * 1
        make_trajectory("nq", "<think>x</think>\n<answer> Paris </answer>", QA_GT),
        # probe.evidence: `real` is read as the reward reads it, so the gold quoted in a tool
        # result is not the policy's answer (no final answer: real 0)
        _tool_calls_trajectory(tokenizer, [
            (search("France"), passage.replace("Lyon", "Paris")), (search("Lyon"), None)]),
    ]
    trajectories[-1].evidence = EvidenceProbe({"none": ["<answer> Paris </answer>"]})
    streams.ensure_group("rollouts")
    streams.publish_many("rollouts", [encode(t) for t in trajectories])
    worker.run(max_batches=1)
    scored = {s.trajectory.sample_id: s for s in _scored(streams)}
    assert [scored[t.sample_id].reward for t in trajectories] == pytest.approx(
        [1.5, 1.4, 0.0, 1.5, 0.0])
    assert scored[trajectories[-1].sample_id].evidence_scores == {"real": 0.0, "none": 1.0}
    first = scored[trajectories[0].sample_id]
    assert first.trajectory.protocol == "tool_calls"
    assert first.reward_components == {"qa_em": 1.0, "qa_em_format": 1.0}
    assert first.probe_scores == [0.0, 1.0]
    assert streams.dead_letters() == []
    streams.close()


def test_poison_records_go_to_the_dead_letter_stream(redis_url, namespace, tokenizer, pool,
                                                     make_trajectory):
    worker, streams = _worker(redis_url, namespace, tokenizer, pool)
    good = make_trajectory("nq", "<answer>Paris</answer>", QA_GT)
    unknown = make_trajectory("mystery_task", "<answer>x</answer>", QA_GT)
    malformed = make_trajectory("countdown", "<answer>1</answer>", {"target": 1})
    payloads = [
        b"\x00garbage",
        msgpack.packb({"schema": "forage.trajectory/99", "uid": "x"}),
        encode(unknown),
        encode(good),
        encode(malformed),
    ]
    streams.ensure_group("rollouts")
    streams.publish_many("rollouts", payloads)
    worker.run(max_batches=1)
    scored = _scored(streams)
    assert [s.trajectory.sample_id for s in scored] == [good.sample_id]
    dead = streams.dead_letters()
    reasons = [d["reason"] for d in dead]
    assert len(dead) == 4
    assert "not a msgpack payload" in reasons[0] or "undecodable" in reasons[0]
    assert "unknown schema" in reasons[1]
    assert "mystery_task" in reasons[2] and "known:" in reasons[2]
    assert "countdown" in reasons[3]
    assert streams.pending("rollouts") == 0
    streams.close()


SLOW_REWARD = textwrap.dedent("""
    import time

    def slow_em(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.4)
        return 1.0 if "Paris" in solution_str else 0.0
""")


@pytest.mark.slow
def test_killed_scorer_batch_is_finished_by_a_second_one(redis_url, namespace, tokenizer_dir,
                                                         tmp_path, make_trajectory):
    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        scorer:
          num_workers: 1
          http: false
          batch_size: 4
          tokenizer_path: {tokenizer_dir}
          rewards:
            synth_single:
              - function: slow_rewards:slow_em
        redis:
          visibility_timeout_s: 1.0
    """))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    cmd = [FORAGE, "scorer", "serve", "--config", str(config),
           "--set", f"redis.url={redis_url}", "--set", f"redis.namespace={namespace}"]
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("rollouts")
    trajectories = [make_trajectory("synth_single", f"<answer>Paris {i}</answer>",
                                    QA_GT) for i in range(16)]
    streams.publish_many("rollouts", [encode(t) for t in trajectories])

    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while streams.client.xlen(streams.key("scored")) < 4:  # batch 1 done, batch 2 started
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "first scorer wrote nothing"
            time.sleep(0.05)
        time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert streams.pending("rollouts") > 0  # it died holding messages
    done_before = {s.trajectory.sample_id for s in _scored(streams)}
    assert len(done_before) < len(trajectories)

    second = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        want = {t.sample_id for t in trajectories}
        while {s.trajectory.sample_id for s in _scored(streams)} != want or \
                streams.pending("rollouts"):
            assert second.poll() is None, second.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "second scorer did not finish the batch"
            time.sleep(0.1)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert all(s.reward == 1.0 for s in _scored(streams))
    assert streams.dead_letters() == []
    streams.close()


def test_score_endpoint(pool):
    from services.scorer.app import HttpServer, create_app

    server = HttpServer(create_app(Scorer(pool=pool, inner_timeout_s=1))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            reply = client.post("/score", json={"data_source": "synth_math",
                                                "solution_str": "\\boxed{0.5}",
                                                "ground_truth": "\\frac{1}{2}"})
            assert reply.status_code == 200
            assert reply.json() == {"score": 1.0, "components": {"math_verify": 1.0},
                                    "timeouts": 0}
            reply = client.post("/score", json={"data_source": "nq",
                                                "solution_str": "<answer>Paris</answer>",
                                                "ground_truth": {"target": ["paris"]}})
            assert reply.json()["score"] == 1.0
            reply = client.post("/score", json={"data_source": "bogus", "solution_str": "x"})
            assert reply.status_code == 404 and "bogus" in reply.json()["detail"]
            reply = client.post("/score", json={"data_source": "countdown", "solution_str": "x",
                                                "ground_truth": 3})
            assert reply.status_code == 422
            assert client.get("/healthz").status_code == 200
            assert "forage_scorer_timeouts_total" in client.get("/metrics/").text
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "code", "score"),
    [
        (["--data-source", "nq", "--solution", "<answer>Paris</answer>",
          "--ground-truth", '{"target": ["paris"]}'], 0, 1.0),
        (["--data-source", "synth_math", "--solution", "so \\boxed{12}", "--ground-truth", "12"],
         0, 1.0),
        (["--data-source", "openai/gsm8k", "--solution", "#### 7", "--ground-truth", "seven"],
         0, 0.0),
        (["--data-source", "nowhere", "--solution", "x", "--ground-truth", "y"], 2, None),
    ],
)
def test_forage_score_cli(args, code, score):
    result = subprocess.run([FORAGE, "score", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    if score is not None:
        assert json.loads(result.stdout)["score"] == score
    else:
        assert "nowhere" in result.stderr and "known" in result.stderr
