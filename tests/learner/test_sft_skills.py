"""Skill measurement on held-out demonstrations (services/learner/sft_skills.py, issue 15)."""

from __future__ import annotations

import pytest

from services.common.skill_gate import describe, reached, shortfall
from services.learner.sft_skills import (
    SkillItem,
    aggregate,
    build_items,
    continued_query,
    is_well_formed_turn,
    measure,
    normalize_answer,
    score_item,
)

PROMPT = [{"role": "user", "content": "Where was the founder of Tamra Works born?"}]
SEGMENTS = [
    {"text": "<think> I need to find Tamra Works. </think>\n<search> Tamra Works </search>",
     "trainable": True},
    {"text": "\n\n<information>Doc 1(Title: \"Tamra Works\") founded by Brixol Velden."
             "</information>\n\n", "trainable": False},
    {"text": "<think> Now I need to search for Brixol Velden. </think>\n<search> Brixol Velden "
             "</search>", "trainable": True},
    {"text": "\n\n<information>Doc 1(Title: \"Brixol Velden\") born in Ashby.</information>\n\n",
     "trainable": False},
    {"text": "<think> The passage says Ashby. </think>\n<answer> Ashby </answer>",
     "trainable": True},
]


def tool_demo(tok) -> tuple[str, list[dict]]:
    """The same demonstration in the tool_calls protocol, rendered as `forage data synth`
    renders it (services/tasks/sft.py: the template's prompt text, Hermes calls, the
    template's tool turns, the answer with its end of turn)."""
    from services.tasks.sft import ToolTurns, search_call

    turns = ToolTurns(tok)
    calls = [("I need to find Tamra Works.", "Tamra Works",
              'Doc 1(Title: "Tamra Works") founded by Brixol Velden.'),
             ("Now I need to search for Brixol Velden.", "Brixol Velden",
              'Doc 1(Title: "Brixol Velden") born in Ashby.')]
    segments = []
    for thought, query, passage in calls:
        segments.append({"text": f"<think> {thought} </think>\n{search_call(query)}",
                         "trainable": True})
        segments.append({"text": turns.tool_turn(PROMPT, passage), "trainable": False})
    segments.append({"text": "<think> The passage says Ashby. </think>\n<answer> Ashby "
                             "</answer>" + turns.end_of_turn, "trainable": True})
    return turns.prompt_text(PROMPT), segments


@pytest.mark.parametrize(("text", "ok"), [
    ("<think> find X </think>\n<search> X </search>", True),
    ("<think> so </think>\n<answer> Ashby </answer> trailing", True),  # cut at the stop
    ("<think> a </think><search> X </search><answer> b </answer>", True),  # first action only
    ("<search> X </search>", False),  # no think block
    ("<think> find X </think>\n<search> X", False),  # never closed
    ("<think> find X </think>\n<search>  </search>", False),  # empty action
    ("<think> find <search> X </search>", False),  # the action inside the think
    ("words <think> a </think> <search> X </search>", False),  # text before the think
    ("<think> a </think> <search> X </answer>", False),  # mismatched tags
    ("", False),
])
def test_well_formed_turn(text: str, ok: bool) -> None:
    assert is_well_formed_turn(text) is ok


def test_scoring_each_kind() -> None:
    assert continued_query(" Brixol Velden </search>") == "Brixol Velden"
    assert continued_query(" Brixol Velden") is None
    assert score_item("query", " Brixol Velden </search>", "Brixol Velden") == {"query": True}
    assert score_item("query", " Brixol </search>", "Brixol Velden") == {"query": False}
    assert score_item("answer", "<think> x </think>\n<answer> the ASHBY. </answer>", "Ashby") == {
        "answer": True}
    assert score_item("answer", "<think> x </think>\n<search> Ashby </search>", "Ashby") == {
        "answer": False}
    assert score_item("prompt", "<think> a </think>\n<search> Tamra Works </search>",
                      "Tamra Works") == {"format": True, "first_query": True}
    assert score_item("prompt", "<think> a </think>\n<answer> Ashby </answer>",
                      "Tamra Works") == {"format": True, "first_query": False}
    with pytest.raises(ValueError, match="unknown skill item kind"):
        score_item("other", "", "")


def test_scoring_tool_call_items() -> None:
    """The tool_calls protocol's skills read Hermes calls as the rollout and the format reward
    read them."""
    from services.learner.sft_skills import called_query, score_tool_item

    call = '<tool_call>\n{"name": "search", "arguments": {"query": "Tamra Works"}}\n</tool_call>'
    assert called_query(f"<think> a </think>\n{call} trailing") == "Tamra Works"
    assert called_query('<tool_call>{"name": "search", "arguments": {}}</tool_call>') is None
    assert called_query('<tool_call>{"name": "search", "arguments": {"query": "X"</tool_call>'
                        ) is None  # malformed JSON
    assert called_query("<think> a </think>\n<answer> X </answer>") is None
    assert score_tool_item("prompt", f"<think> a </think>\n{call}<|im_end|>", "Tamra Works") == {
        "format": True, "first_query": True}
    assert score_tool_item("prompt", f"I will search. {call}", "Tamra Works") == {
        "format": False, "first_query": False}  # text before the call: ill-formed, as rewarded
    assert score_tool_item("prompt", "<think> a </think>\n<answer> Ashby </answer>",
                           "Tamra Works") == {"format": True, "first_query": False}
    assert score_tool_item("prompt", '<think> a </think>\n<tool_call>{"name": "serch", '
                           '"arguments": {"query": "X"}}</tool_call>', "X") == {
        "format": False, "first_query": False}  # unknown tool
    head = '<think> a </think>\n<tool_call>\n{"name": "search", "arguments": {"query": "'
    assert score_tool_item("query", 'Brixol Velden"}}\n</tool_call>', "Brixol Velden",
                           head) == {"query": True}
    assert score_tool_item("query", 'Brixol"}}\n</tool_call>', "Brixol Velden", head) == {
        "query": False}
    assert score_tool_item("query", 'Brixol Velden"}}', "Brixol Velden", head) == {
        "query": False}  # never closed
    assert score_tool_item("answer", "<think> x </think>\n<answer> the ASHBY. </answer>",
                           "Ashby") == {"answer": True}
    assert score_tool_item("answer", f"{call}\n<answer> Ashby </answer>", "Ashby") == {
        "answer": False}  # a call first: the answer is not read


def test_aggregate_gate_and_messages() -> None:
    skills = aggregate([{"format": True, "first_query": False}, {"format": False},
                        {"query": True}, {"query": True}, {"query": False}])
    assert skills == {"format": 0.5, "first_query": 0.0, "query": pytest.approx(2 / 3)}
    assert reached(skills, {"format": 0.5})
    assert not reached(skills, {"format": 0.5, "query": 0.7})
    assert not reached(skills, {"answer": 0.0})  # never measured: not reached
    assert shortfall(skills, {"format": 0.5, "query": 0.7, "answer": 0.1}) == (
        "query 0.67 < 0.70, answer not measured")
    assert describe({"format": 1.0, "query": 0.875, "answer": 0.84},
                    {"format": 0.95, "query": 0.8, "answer": 0.8}) == (
        "format 1.00, query 0.88, answer 0.84 (thresholds 0.95 / 0.80 / 0.80)")


def test_normalisation_is_the_scorers() -> None:
    from services.scorer.rewards.text import normalize_answer as scorer_normalize

    for text in ["The Ashby!", "  an  apple  ", "A.B.C", "Zodo-Kival", "the", "Ünïcode, the end"]:
        assert normalize_answer(text) == scorer_normalize(text)


def test_items_are_the_tokens_sft_trains_on(tiny_policy) -> None:
    """Each prefix is exactly the start of the demonstration's SFT token sequence."""
    from transformers import AutoTokenizer

    from services.learner.sft import encode_prompt, encode_row

    tok = AutoTokenizer.from_pretrained(str(tiny_policy))
    items, mismatches = build_items(tok, PROMPT, SEGMENTS, "Ashby")
    full = encode_row(tok, PROMPT, SEGMENTS, 4096).input_ids.tolist()
    assert mismatches == 0
    assert [(i.kind, i.target) for i in items] == [
        ("prompt", "Tamra Works"), ("query", "Tamra Works"), ("query", "Brixol Velden"),
        ("answer", "Ashby")]
    for item in items:
        assert full[: len(item.prefix)] == list(item.prefix)
    search_id = tok("<search>", add_special_tokens=False)["input_ids"]
    assert list(items[1].prefix[-len(search_id):]) == search_id
    assert "Now I need to search for Brixol Velden" in tok.decode(list(items[2].prefix))
    assert tok.decode(list(items[3].prefix)).endswith("born in Ashby.</information>\n\n")
    assert list(items[0].prefix) == encode_prompt(tok, PROMPT)
    # a guessed answer is no reading skill: no answer item
    assert [i.kind for i in build_items(tok, PROMPT, SEGMENTS, None)[0]] == [
        "prompt", "query", "query"]


def test_tool_call_items_are_the_tokens_sft_trains_on(tiny_policy) -> None:
    """The tool_calls demonstration gives the same items as the tags one, each prefix the start
    of its SFT token sequence, a query prefix ending at the query's opening quote."""
    from transformers import AutoTokenizer

    from services.learner.sft import encode_row

    tok = AutoTokenizer.from_pretrained(str(tiny_policy))
    prompt, segments = tool_demo(tok)
    items, mismatches = build_items(tok, prompt, segments, "Ashby", "tool_calls")
    full = encode_row(tok, prompt, segments, 4096).input_ids.tolist()
    assert mismatches == 0
    assert [(i.kind, i.target, i.protocol) for i in items] == [
        ("prompt", "Tamra Works", "tool_calls"), ("query", "Tamra Works", "tool_calls"),
        ("query", "Brixol Velden", "tool_calls"), ("answer", "Ashby", "tool_calls")]
    for item in items:
        assert full[: len(item.prefix)] == list(item.prefix)
    assert tok.decode(list(items[2].prefix)).endswith(items[2].head)
    assert items[2].head.endswith('{"query": "')
    assert "born in Ashby." in tok.decode(list(items[3].prefix))
    with pytest.raises(ValueError, match="unknown protocol"):
        build_items(tok, prompt, segments, "Ashby", "json")


@pytest.mark.parametrize("protocol", ["tags", "tool_calls"])
def test_a_model_that_learnt_the_demonstration_scores_one(tiny_policy, protocol: str) -> None:
    """A real tiny model scores 0 before and 1 after it has memorised the demonstration (so the
    prefixes, the greedy generation, the stops and the scoring agree end to end), in both
    protocols."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.learner.sft import encode_row

    tok = AutoTokenizer.from_pretrained(str(tiny_policy))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy))
    prompt, segments = (PROMPT, SEGMENTS) if protocol == "tags" else tool_demo(tok)
    items, _ = build_items(tok, prompt, segments, "Ashby", protocol)
    # uneven lengths: left padding
    items += build_items(tok, prompt, segments[:3], None, protocol)[0][1:]
    before = measure(model, tok, items, max_new_tokens=16)
    assert before["format"] == 0 and before["query"] == 0 and before["answer"] == 0

    sample = encode_row(tok, prompt, segments, 4096)
    ids = torch.tensor(sample.input_ids).unsqueeze(0)
    labels = ids.clone()
    labels[0, torch.tensor(sample.loss_mask) == 0] = -100
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    after = measure(model, tok, items, max_new_tokens=96)  # the fixture spells <tool_call> out
    assert model.training  # restored
    assert {k: after[k] for k in ("format", "first_query", "query", "answer")} == {
        "format": 1.0, "first_query": 1.0, "query": 1.0, "answer": 1.0}
    assert after["seconds"] < 10
    # not vacuous: the same generations scored against other targets fail
    wrong = measure(model, tok, [SkillItem(i.kind, i.prefix, "Corvale", i.protocol, i.head)
                                 for i in items], 96)
    assert wrong["query"] == wrong["answer"] == wrong["first_query"] == 0
    assert wrong["format"] == 1.0

