"""SFT demonstrations in the tool_calls protocol (services/tasks/sft.py, `ToolTurns`).

What must hold: a demonstration is well formed as the scorer reads a tool_calls response
(`well_formed_response`, `turn_format` on each turn), and the ids the SFT reader builds from it
(prompt text, then each segment tokenised on its own: services/learner/sft.py) are exactly the
ids the agent loop builds when the policy writes the demonstration's turns, with the same loss
mask; and the synth-time template (the tiny policy's, before its tokenizer exists) renders the
same texts as the built policy's tokenizer. The tags protocol's rows are unchanged.
"""

from __future__ import annotations

import pytest

from services.common.formats import search_r1_prompt
from services.common.tool_calls import split_response, turn_format, well_formed_response
from services.common.trajectory import PromptGroup
from services.tasks.sft import (
    DemoBuilder,
    ToolTurns,
    build_sft_rows,
    protocol_prompt,
    template_tokenizer,
)

# A two-entity world in the shape of world.metadata(): Brixol was born in Corvale, Tamra
# founded a company whose headquarters are in Dunmore.
CORPUS = {
    "0": '"Brixol"\nBrixol was born in Corvale. Brixol works as a sailor.',
    "1": '"Tamra"\nTamra was born in Dunmore. Tamra founded Quill.',
    "2": '"Quill"\nQuill is a company headquartered in Ashby.',
}
META = {
    "doc_facts": {"0": {"born_in": "Corvale", "occupation": "sailor"},
                  "1": {"born_in": "Dunmore", "founder": "Quill"},
                  "2": {"headquarters": "Ashby"}},
    "entities": {"Brixol": {"kind": "person"}, "Tamra": {"kind": "person"},
                 "Quill": {"kind": "company"}},
    "value_types": {"city": ["Corvale", "Dunmore", "Ashby", "Pellam"],
                    "occupation": ["sailor"], "person": ["Brixol", "Tamra"]},
}
QUESTIONS = [
    {"question": "Where was Brixol born", "answer": "Corvale", "answer_type": "city",
     "subject": "Brixol", "relation": "born_in", "hops": 1},
    {"question": "Where is the company Tamra founded headquartered", "answer": "Ashby",
     "answer_type": "city", "subject": "Tamra", "relation": "founder/headquarters", "hops": 2},
]


def docs_for(query: str, topk: int = 1) -> list[dict]:
    hits = [i for i, text in CORPUS.items() if text.startswith(f'"{query}"')] or ["0"]
    return [{"document": {"id": i, "contents": CORPUS[i]}, "score": 0.9} for i in hits[:topk]]


def search(queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
    return [[(d["document"], d["score"]) for d in docs_for(q, topk)] for q in queries]


class FakeRetriever:
    """The RetrieverClient's `retrieve` over the same corpus (/retrieve's scored shape)."""

    def retrieve(self, queries: list[str]) -> list[list[dict]]:
        return [docs_for(q) for q in queries]


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_policy_dir))


def rows_for(turns: ToolTurns, mix: str = "good=1") -> list[dict]:
    return build_sft_rows(QUESTIONS, search, META, 1, mix, seed=0, turns=turns)


def response_text(row: dict) -> str:
    return "".join(segment["text"] for segment in row["segments"])


def test_demonstrations_are_well_formed(tokenizer):
    for mix in ("good=1", "guess=1", "sloppy=1"):
        for row in rows_for(ToolTurns(tokenizer), mix):
            text = response_text(row)
            assert well_formed_response(text), text
            turns = split_response(text).assistant
            trainable = [s["text"] for s in row["segments"] if s["trainable"]]
            assert len(turns) == len(trainable) == row["extra_info"]["searches"] + 1
            assert [turn_format(t, None) for t in turns] == ["tool"] * (len(turns) - 1) + [
                "answer"]
            assert trainable[-1].endswith("</answer><|im_end|>")
            assert all(t.endswith("</tool_call><|im_end|>") for t in trainable[:-1])
            assert row["extra_info"]["protocol"] == "tool_calls"
            assert row["prompt"].endswith("<|im_start|>assistant\n")


def test_synth_time_template_renders_the_policy_s_texts(tokenizer):
    """Synth runs before `forage model init` builds the tokenizer: the tiny policy's template on
    a placeholder vocabulary must give the texts the built tokenizer's template gives."""
    assert rows_for(ToolTurns(template_tokenizer())) == rows_for(ToolTurns(tokenizer))


@pytest.mark.parametrize("template", ["tiny", "qwen25"])
def test_sft_tokens_equal_the_agent_loop_s(tiny_policy_dir, template):
    """On the tiny policy's ChatML (no tool declarations) and on a Qwen2.5-style Hermes
    template (tools in the system turn, results in a user turn in <tool_response>)."""
    import torch

    from services.learner.sft import encode_row
    from services.rollout.agent import AgentLoop, LoopSettings
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2, seed=0)
    tok = engine.tokenizer
    if template == "qwen25":
        from tests.rollout.test_tool_calls_loop import QWEN25_TEMPLATE

        tok.chat_template = QWEN25_TEMPLATE
    rows = rows_for(ToolTurns(tok))
    if template == "qwen25":
        assert '<tools>\n{"type": "function"' in rows[0]["prompt"]
        assert "<tool_response>" in rows[0]["segments"][1]["text"]
    assert [r["extra_info"]["searches"] for r in rows] == [1, 2]
    for row, question in zip(rows, QUESTIONS, strict=True):
        sample = encode_row(tok, row["prompt"], row["segments"], 10**6)
        # the policy writes the demonstration's turns, each ending on <|im_end|> (EOS)
        scripts = [tok.encode(s["text"], add_special_tokens=False)
                   for s in row["segments"] if s["trainable"]]
        engine.forced_tokens = lambda request, scripts=scripts: (
            scripts[min(len(request.tag[1].turns), len(scripts) - 1)]
            if request.tag[0] == "turn" else None)
        loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=("search",)),
                         FakeRetriever())
        group = PromptGroup(uid="q", data_source="synth_single",
                            ground_truth={"target": [question["answer"]]},
                            prompt=protocol_prompt(question["question"], "tool_calls"), n=1)
        try:
            (trajectory,) = loop.run([group])
        finally:
            loop.close()
            engine.forced_tokens = None
        assert trajectory.finish_reason == "answer" and trajectory.error is None
        assert trajectory.num_searches == row["extra_info"]["searches"]
        prompt = trajectory.prompt_ids.tolist()
        assert sample.prompt_len == len(prompt)
        assert sample.input_ids.tolist() == prompt + trajectory.response_ids.tolist()
        assert sample.loss_mask.tolist()[len(prompt):] == [
            float(m) for m in trajectory.loss_mask.tolist()]


def test_tags_rows_are_unchanged():
    """Without `turns` the rows are Search-R1's, as before the tool_calls protocol."""
    rows = build_sft_rows(QUESTIONS, search, META, 1, "good=1", seed=0)
    assert rows[0]["prompt"] == [{"role": "user",
                                  "content": search_r1_prompt("Where was Brixol born")}]
    assert [s["text"] for s in rows[0]["segments"]] == [
        "<think> I need to find Brixol. </think>\n<search> Brixol </search>",
        "\n\n<information>Doc 1(Title: \"Brixol\") Brixol was born in Corvale. Brixol works "
        "as a sailor.</information>\n\n",
        "<think> The passage says Corvale. </think>\n<answer> Corvale </answer>"]
    assert "protocol" not in rows[0]["extra_info"]
    builder = DemoBuilder(search, META, 1)
    assert builder.turns is None


def test_synth_writes_tool_call_prompts(tmp_path):
    from services.tasks.datasets import load_rows
    from services.tasks.sft import tool_search_prompt
    from services.tasks.synth import synthesize

    summary = synthesize(tmp_path, seed=0, sft=False, show_progress=False, protocol="tool_calls")
    assert summary["protocol"] == "tool_calls"
    for split in ("train", "test"):
        row = load_rows(tmp_path / f"{split}.parquet")[0]
        assert row["prompt"] == [{"role": "user", "content": tool_search_prompt(
            row["extra_info"]["question"])}]
        assert "<tool_call>" in row["prompt"][0]["content"]
    with pytest.raises(ValueError, match="unknown protocol"):
        synthesize(tmp_path, sft=False, protocol="json")


def test_demo_settings_follow_the_protocol():
    """`forage demo --set rollout.protocol=tool_calls`: larger turn budgets (a `--set` wins),
    the protocol in the stamp that decides whether phases 1-3 are reused; tags: nothing
    changes."""
    from services.common.config import load_config
    from services.launch.demo import DEMO_CONFIG, _settings_stamp, protocol_overrides

    tool = ["rollout.protocol=tool_calls"]
    assert protocol_overrides(DEMO_CONFIG, tool) == [
        "rollout.max_tokens_per_turn=48", "rollout.max_response_length=480"]
    assert protocol_overrides(DEMO_CONFIG, [*tool, "rollout.max_tokens_per_turn=40"]) == [
        "rollout.max_response_length=480"]
    assert protocol_overrides(DEMO_CONFIG, []) == []
    cfg = load_config(DEMO_CONFIG, tool)
    assert _settings_stamp(cfg)["protocol"] == "tool_calls"
    tags = load_config(DEMO_CONFIG, [])
    assert "protocol" not in _settings_stamp(tags)
