"""The agent loop with a real pretrained tokenizer and chat template (SmolLM2-135M-Instruct,
imported from its GGUF file): Search-R1's tags are several BPE tokens each, the prompt goes
through a ChatML template, `<|im_end|>` ends a generation. What must hold: stops on the tag
strings, and the tokens trained on are exactly the tokens generated plus the observation tokens
inserted (no decode/re-encode drift at the joins)."""

from __future__ import annotations

import pytest
import torch

from services.common.formats import CORRECTIVE_MESSAGE, search_r1_prompt
from services.common.trajectory import PromptGroup

from .test_agent import TURN_ANSWER, TURN_SEARCH, loop, scripted, spans

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_engine(smollm2_dir):
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(2)
    return TransformersEngine.from_pretrained(str(smollm2_dir), max_batch_size=4, seed=0)


def recording(engine) -> dict[tuple[str, int], list[list[int]]]:
    """Every turn's generated tokens, per (group uid, sample), as the engine returned them."""
    seen: dict[tuple[str, int], list[list[int]]] = {}
    step = engine.step

    def recorded_step():
        outputs = step()
        for out in outputs:
            kind, state = out.request.tag[0], out.request.tag[1]
            if kind == "turn":
                seen.setdefault((state.group.uid, state.index), []).append(list(out.token_ids))
        return outputs

    engine.step = recorded_step
    return seen


def test_tags_are_several_tokens_and_scripted_turns_keep_their_exact_tokens(
        real_engine, retriever_url):
    tok = real_engine.tokenizer
    assert len(tok.encode("</search>", add_special_tokens=False)) > 1
    assert len(tok.encode("<answer>", add_special_tokens=False)) > 1
    # the first turn runs on past its tag: the engine must stop on the string "</search>"
    scripted(real_engine, [[TURN_SEARCH + " and then I keep on writing", TURN_ANSWER]])
    seen = recording(real_engine)
    group = PromptGroup(uid="s", data_source="nq", ground_truth={"target": ["Corvale"]}, n=1,
                        prompt=[{"role": "user", "content": search_r1_prompt("Where was Brixol born?")}])
    try:
        [traj] = loop(real_engine, retriever_url).run([group])
    finally:
        real_engine.forced_tokens = None
        del real_engine.step
    assert traj.finish_reason == "answer" and traj.num_searches == 1
    policy = [traj.response_ids[a:b].tolist() for a, b in spans(traj.loss_mask, 1)]
    assert policy == seen[("s", 0)]  # the trained tokens are the generated ones, exactly
    first, second = (tok.decode(p) for p in policy)
    assert first.startswith(TURN_SEARCH) and "keep" not in first  # cut at the tag's last token
    assert "</search>" not in tok.decode(policy[0][:-1]) and second == TURN_ANSWER
    # the prompt is the chat template applied once: system turn, user turn, assistant header
    text = tok.decode(traj.prompt_ids.tolist())
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_sampled_turns_stop_on_multi_token_tags_without_drift(real_engine, retriever_url):
    check_sampled_turns(real_engine, retriever_url)


def check_sampled_turns(real_engine, retriever_url) -> None:
    """Sampled multi-turn search on `real_engine` (either engine): every turn stops at its tag
    and the trained tokens are exactly those generated plus the observations inserted."""
    seen = recording(real_engine)
    question = "Where was Brixol born? Search for Brixol first."
    groups = [PromptGroup(uid=f"g{i}", data_source="nq", ground_truth={"target": ["Corvale"]},
                          n=2, prompt=[{"role": "user", "content": search_r1_prompt(question)}])
              for i in range(2)]
    try:
        trajectories = loop(real_engine, retriever_url, max_turns=2, max_tokens_per_turn=48,
                            max_response_length=400, temperature=1.0).run(groups)
    finally:
        del real_engine.step
    tok = real_engine.tokenizer
    observations = 0
    # run() returns each group's samples in order, groups in input order
    keys = [(group.uid, i) for group in groups for i in range(group.n)]
    for key, traj in zip(keys, trajectories, strict=True):
        assert traj.uid == key[0]
        policy = [traj.response_ids[a:b].tolist() for a, b in spans(traj.loss_mask, 1)]
        assert policy == seen[key]  # exactly the tokens generated, turn by turn
        for a, b in spans(traj.loss_mask, 0):
            text = tok.decode(traj.response_ids[a:b].tolist())
            assert text == CORRECTIVE_MESSAGE or text.startswith("\n\n<information>"), text
            observations += 1
        for turn, tokens in zip(traj.turns, policy, strict=False):
            text = tok.decode(tokens)
            if turn.action == "search":  # stopped at the tag, within its last token
                assert "</search>" in text and "</search>" not in tok.decode(tokens[:-1])
    assert sum(len(t.turns) for t in trajectories) >= 4
    print(f"sampled: {[(t.finish_reason, t.num_searches) for t in trajectories]}, "
          f"{observations} observations")
