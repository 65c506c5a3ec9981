"""Agent loop: Search-R1 semantics, token-in/token-out, loss mask, limits, failures, probe."""

from __future__ import annotations

import dataclasses
import time

import httpx

from services.common.codec import decode_as, encode
from services.common.formats import (
    CORRECTIVE_MESSAGE,
    PROBE_SUFFIX_TAGGED,
    doc_refs,
    information_block,
)
from services.common.retrieval_store import retrieval_tag
from services.common.trajectory import PromptGroup, Trajectory
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.probe import ProbeSettings, cut_points
from services.rollout.retrieval import RetrieverClient

TURN_SEARCH = "<think> I need Brixol </think>\n<search> Brixol </search>"
TURN_ANSWER = "<think> Brixol was born in Corvale </think>\n<answer> Corvale </answer>"
TURN_INVALID = "<think> hmm </think> Corvale"


def scripted(engine, scripts: list[list[str]]):
    """Force each sample's turns: sample i plays scripts[i % len], turn t its t-th text."""
    eos = [min(engine.eos_ids)]  # turns without a stop string end with EOS, as a policy would
    encoded = [[engine.tokenizer.encode(t, add_special_tokens=False)
                + ([] if t.endswith(">") else eos) for t in s] for s in scripts]

    def forced(request):
        if request.tag[0] != "turn":
            return None
        state = request.tag[1]
        texts = encoded[state.index % len(encoded)]
        return texts[min(len(state.turns), len(texts) - 1)]

    engine.forced_tokens = forced


def group(n: int = 1, uid: str = "g1", **sampling) -> PromptGroup:
    return PromptGroup(uid=uid, data_source="nq", ground_truth={"target": ["Corvale"]}, n=n,
                       prompt=[{"role": "user", "content": "Where was Brixol born?"}],
                       sampling=sampling)


def loop(engine, url=None, **settings) -> AgentLoop:
    retriever = RetrieverClient(url, topk=2, timeout_s=2, retries=1, backoff_s=0.01) if url else None
    return AgentLoop(engine, LoopSettings(**settings), retriever)


def spans(mask, value):
    out, start = [], None
    for i, m in enumerate(list(mask) + [255]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def test_scripted_trajectory_exact_observation_bytes_and_mask(engine, retriever_url):
    scripted(engine, [[TURN_SEARCH, TURN_ANSWER]])
    [traj] = loop(engine, retriever_url).run([group()])
    docs = httpx.post(retriever_url, json={"queries": ["Brixol"], "topk": 2,
                                           "return_scores": True}).json()["result"][0]
    observation = information_block(docs)
    decode = engine.tokenizer.decode
    assert traj.finish_reason == "answer" and traj.num_searches == 1
    assert decode(traj.response_ids.tolist()) == TURN_SEARCH + observation + TURN_ANSWER
    masked = spans(traj.loss_mask, 0)
    assert len(masked) == 1
    assert decode(traj.response_ids[slice(*masked[0])].tolist()) == observation
    policy = [decode(traj.response_ids[a:b].tolist()) for a, b in spans(traj.loss_mask, 1)]
    assert policy == [TURN_SEARCH, TURN_ANSWER]
    assert [(t.action, t.query) for t in traj.turns] == [("search", "Brixol"), ("answer", "Corvale")]
    assert [(t.start, t.end) for t in traj.turns] == spans(traj.loss_mask, 1)
    # the search turn keeps the ids/titles of what it retrieved (samples.jsonl shows them)
    assert traj.turns[0].docs == doc_refs(docs) and len(traj.turns[0].docs) == 2
    assert traj.turns[1].docs is None
    # ...and who answered it: the index identity and settings the retriever's /healthz reports
    health = httpx.get(retriever_url.replace("/retrieve", "/healthz")).json()
    assert traj.turns[0].index == retrieval_tag(health["index_id"], health["search_settings"], 2)
    assert traj.turns[1].index is None
    # ...and its retrieval health: two passages, none empty, the gold "Corvale" in Brixol's,
    # the /retrieve call's latency, no cache (services/common/retrieval_health.py)
    found = traj.turns[0].retrieval
    assert (found.passages, found.empty, found.gold, found.cached) == (2, 0, True, False)
    assert 0 < found.ms < 20_000 and traj.turns[1].retrieval is None
    assert decode_as(encode(traj), Trajectory).turns == traj.turns  # it travels to the learner
    # behaviour log-probs: real on policy tokens, 0 on observation tokens
    lp = traj.rollout_logprobs
    assert all(lp[i] == 0.0 for a, b in masked for i in range(a, b))
    assert all(lp[i] < 0 for a, b in spans(traj.loss_mask, 1) for i in range(a, b))
    # token-in/token-out: the prompt is the chat template applied once
    assert traj.prompt_ids.tolist() == loop(engine).prompt_ids(group())


def test_invalid_action_gets_corrective_message_and_max_turns_final_turn(engine, retriever_url):
    scripted(engine, [[TURN_INVALID, TURN_SEARCH, TURN_SEARCH]])
    [traj] = loop(engine, retriever_url, max_turns=2).run([group()])
    decode = engine.tokenizer.decode
    observations = [decode(traj.response_ids[a:b].tolist()) for a, b in spans(traj.loss_mask, 0)]
    assert observations[0] == CORRECTIVE_MESSAGE
    assert observations[1].startswith("\n\n<information>Doc 1(Title: ")
    # 2 rounds (invalid, search) then one final turn whose search is not executed
    assert [t.action for t in traj.turns] == ["invalid", "search", "search"]
    assert traj.num_searches == 1 and traj.num_invalid == 1
    assert traj.finish_reason == "max_turns" and len(observations) == 2


def test_response_and_observation_length_limits(engine, retriever_url):
    scripted(engine, [[TURN_SEARCH, TURN_SEARCH, TURN_SEARCH, TURN_ANSWER]])
    [short_obs] = loop(engine, retriever_url, max_obs_length=5).run([group()])
    assert [b - a for a, b in spans(short_obs.loss_mask, 0)] == [5, 5, 5]
    assert short_obs.finish_reason == "answer"
    [cut] = loop(engine, retriever_url, max_response_length=40).run([group()])
    assert len(cut.response_ids) == 40 and cut.finish_reason == "length"
    engine.forced_tokens = None
    [per_turn] = loop(engine, retriever_url, max_tokens_per_turn=6, max_turns=1,
                      max_response_length=100).run([group()])
    assert all(t.end - t.start <= 6 for t in per_turn.turns)


def test_retriever_down_gives_error_records_not_a_hang(engine, dead_retriever_url):
    scripted(engine, [[TURN_SEARCH, TURN_ANSWER], [TURN_ANSWER]])
    started = time.perf_counter()
    trajs = loop(engine, dead_retriever_url).run([group(n=2)])
    assert time.perf_counter() - started < 20
    assert [t.finish_reason for t in trajs] == ["error", "answer"]
    assert "failed after 2 attempts" in trajs[0].error
    assert trajs[0].turns[-1].action == "search" and trajs[0].num_searches == 0


def test_group_samples_share_uid_and_lockstep_equals_continuous(engine, retriever_url):
    scripts = [[TURN_ANSWER], [TURN_SEARCH, TURN_ANSWER], [TURN_SEARCH, TURN_SEARCH, TURN_ANSWER],
               [TURN_INVALID, TURN_SEARCH, TURN_ANSWER]]
    scripted(engine, scripts)
    groups = [group(n=4, uid="a"), dataclasses.replace(group(n=3, uid="b"), namespace="run-1")]
    done = []
    continuous = loop(engine, retriever_url).run(groups, on_group_done=lambda g, t: done.append(
        (g.uid, len(t))))
    scripted(engine, scripts)
    lockstep = loop(engine, retriever_url, scheduling="lockstep").run(groups)
    assert sorted(done) == [("a", 4), ("b", 3)]
    assert [t.uid for t in continuous] == ["a"] * 4 + ["b"] * 3
    assert [t.namespace for t in continuous] == [""] * 4 + ["run-1"] * 3  # the issuing run's
    assert len({t.sample_id for t in continuous}) == 7
    for a, b in zip(continuous, lockstep, strict=True):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
    assert [t.num_searches for t in continuous[:4]] == [0, 1, 2, 1]


def test_single_turn_task_without_tool(engine):
    scripted(engine, [["He has 3 + 4 = 7 apples. The answer is \\boxed{7}."]])
    g = PromptGroup(uid="m", data_source="gsm8k", prompt="Tom has 3 apples", ground_truth="7", n=2)
    trajs = loop(engine, None, use_search=False, stop_strings=()).run([g])
    for traj in trajs:
        assert len(traj.turns) == 1 and traj.turns[0].action == "none"
        assert traj.loss_mask.all() and traj.finish_reason in ("answer", "length")


def test_probe_prompts_have_the_right_prefixes(engine, retriever_url):
    seen = []
    scripts = [engine.tokenizer.encode(t, add_special_tokens=False)
               for t in (TURN_SEARCH, TURN_ANSWER)]

    def forced(request):
        if request.tag[0] == "probe":
            seen.append(list(request.prompt_ids))
            return None
        return scripts[min(len(request.tag[1].turns), 1)]

    engine.forced_tokens = forced
    settings = ProbeSettings(enable=True, num_truncations=4, mc_samples=3, mc_max_tokens=5,
                             num_splits=2)
    agent = AgentLoop(engine, LoopSettings(), RetrieverClient(retriever_url, topk=2), settings)
    [traj] = agent.run([group()])
    response, mask = traj.response_ids.tolist(), traj.loss_mask.tolist()
    answer_id = engine.tokenizer.convert_tokens_to_ids("<answer>")
    end = response.index(answer_id)  # the policy's first <answer> (docs/probe.md, search rule)
    policy = [i for i in range(end) if mask[i]]  # k/N counts policy tokens, not <information>
    assert 0 < len(policy) < end
    cuts = [0] + [policy[m - 1] + 1 for m in cut_points(len(policy), 4)[1:]]
    tok = engine.tokenizer

    def closed_by(cut: int) -> str:  # the block the prefix ends inside, closed as the policy does
        text = tok.decode(response[:cut])
        if text.rfind("<think>") > text.rfind("</think>"):
            return "</think>\n"
        return "</search>\n" if text.rfind("<search>") > text.rfind("</search>") else ""

    prompt = traj.prompt_ids.tolist()
    expected = [prompt + response[:cut]
                + tok.encode(closed_by(cut) + PROBE_SUFFIX_TAGGED, add_special_tokens=False)
                for cut in cuts]
    # 0%: the answer forced at once; 100%: after the answer turn's closed thought, no closer.
    assert closed_by(cuts[0]) == "" and closed_by(cuts[-1]) == ""
    assert tok.decode(expected[-1][len(prompt):]).endswith("</think>\n<answer>")
    assert cuts[-1] == policy[-1] + 1 and all(mask[c - 1] for c in cuts[1:])
    assert sorted(seen) == sorted(p for p in expected for _ in range(3))
    assert traj.probe.fractions == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [len(s) for s in traj.probe.samples] == [3] * 5
    assert all(isinstance(x, str) for s in traj.probe.samples for x in s)


def test_weights_swapped_mid_run_are_recorded_per_turn(engine, retriever_url):
    import torch

    scripted(engine, [[TURN_SEARCH, TURN_SEARCH, TURN_ANSWER]])
    new = {k: v + 0.1 for k, v in engine.model.state_dict().items()}
    steps = {"n": 0}

    def on_step():
        steps["n"] += 1
        if steps["n"] == 3:  # during the first turn
            engine.load_weights(new, version=5)

    agent = AgentLoop(engine, LoopSettings(), RetrieverClient(retriever_url, topk=2),
                      on_step=on_step)
    [traj] = agent.run([group()])
    versions = [turn.policy_version for turn in traj.turns]
    assert versions[0] == 0 and versions[-1] == 5, versions
    assert traj.policy_version == 0  # the oldest weights that produced any of its tokens
    with torch.no_grad():
        assert engine.policy_version == 5
