"""Tool calls in each family's own format, chosen from its chat template: Hermes (Qwen2.5 /
Qwen3), Llama 3.1's JSON calls and Mistral's `[TOOL_CALLS]`; several calls in one turn all run
(concurrently), and their results come back in call order.

The templates are the model repositories' own (tests/data/chat_templates/README.md says where
each comes from); Mistral's runs on the real v3 tokenizer the mistral-common package ships,
Llama's on the tiny tokenizer with Llama 3's special tokens added (no Llama 3 tokenizer is
installable here). A one-layer random model of each vocabulary stands for the policy: the
engine's `forced_tokens` hook scripts its turns, and what is tested is the tokens."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from services.common.formats import passages_to_string
from services.common.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCall,
    ToolCallError,
    detect_format,
    parse_turn,
)
from services.common.tools import tool_specs
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.retrieval import RetrieverClient
from tests.rollout.scripted_turns import record_generated_turns

from .test_agent import spans
from .test_tool_calls_loop import QWEN25_TEMPLATE, httpx_docs

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
SPECS = tool_specs(("search", "calculator"))
QUESTION = [{"role": "user", "content": "Where was Brixol born, and 1907 - 1900?"}]
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"]


# --------------------------------------------------------------------------- parsing


def test_the_format_is_read_from_the_template():
    assert detect_format(QWEN25_TEMPLATE) is HERMES
    assert detect_format((TEMPLATES / "llama3.1.jinja").read_text()) is LLAMA3_JSON
    assert detect_format((TEMPLATES / "mistral-v0.3.jinja").read_text()) is MISTRAL
    assert detect_format(None) is HERMES  # a template that shows no format: Hermes


def calls(text: str, fmt) -> list:
    parsed = parse_turn(text, SPECS, fmt)
    assert parsed.answer is None
    return [(c.name, c.arguments, c.id) if isinstance(c, ToolCall) else c.kind
            for c in parsed.calls]


def test_each_format_parses_several_calls_in_order():
    search, calc = {"query": "Brixol"}, {"expression": "1 + 1"}
    hermes = ('<tool_call>\n{"name": "search", "arguments": {"query": "Brixol"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n'
              "</tool_call>")
    assert calls(hermes, HERMES) == [("search", search, None), ("calculator", calc, None)]
    llama = ('<|python_tag|>{"name": "search", "parameters": {"query": "Brixol"}}; '
             '{"name": "calculator", "parameters": {"expression": "1 + 1"}}')
    assert calls(llama, LLAMA3_JSON) == [("search", search, None), ("calculator", calc, None)]
    assert calls(llama.removeprefix("<|python_tag|>"), LLAMA3_JSON) == calls(llama, LLAMA3_JSON)
    assert calls('[{"name": "search", "parameters": {"query": "Brixol"}}]', LLAMA3_JSON) == [
        ("search", search, None)]
    mistral = ('[TOOL_CALLS] [{"name": "search", "arguments": {"query": "Brixol"}, "id": '
               '"a1b2c3d4e"}, {"name": "calculator", "arguments": {"expression": "1 + 1"}}]')
    assert calls(mistral, MISTRAL) == [("search", search, "a1b2c3d4e"),
                                       ("calculator", calc, None)]
    newer = ('[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "Brixol"}'
             '[TOOL_CALLS]calculator[ARGS]{"expression": "1 + 1"}')
    assert calls(newer, MISTRAL) == calls(mistral, MISTRAL)


def test_bad_calls_and_answers_in_the_other_formats():
    assert calls('{"name": "search", "parameters": {"query": "x"}} and then', LLAMA3_JSON) == [
        ("search", {"query": "x"}, None), "malformed_json"]
    assert calls('{"name": "browse", "parameters": {}}', LLAMA3_JSON) == ["unknown_tool"]
    [error] = parse_turn('[TOOL_CALLS] [{"name": "search", "arguments": {"query": }]', SPECS,
                         MISTRAL).calls
    assert isinstance(error, ToolCallError) and "Write [TOOL_CALLS] [{" in error.message
    for text, fmt in (("<answer> Corvale </answer>", LLAMA3_JSON),
                      ("<answer> Corvale </answer>[TOOL_CALLS] []", MISTRAL)):
        assert parse_turn(text, SPECS, fmt).answer == "Corvale"
    assert parse_turn("It is Corvale.", SPECS, LLAMA3_JSON).action == "invalid"
    assert "[TOOL_CALLS]" in MISTRAL.corrective and "<tool_call>" not in MISTRAL.corrective


# --------------------------------------------------------------------------- the loop


def small_engine(tokenizer, tiny_policy_dir):
    """The transformers engine over a one-layer random model of `tokenizer`'s vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.rollout.transformers_engine import TransformersEngine

    config = AutoConfig.from_pretrained(tiny_policy_dir)
    config.update({"vocab_size": len(tokenizer), "num_hidden_layers": 1,
                   "eos_token_id": tokenizer.eos_token_id,
                   "bos_token_id": tokenizer.bos_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return TransformersEngine(model, tokenizer, max_batch_size=2)


def play(engine, url, turns: list[list[int]], **settings):
    """Script the policy's turns (token ids); returns the trajectory and the generated ids."""
    engine.forced_tokens = lambda r: turns[min(len(r.tag[1].turns), len(turns) - 1)]
    seen = record_generated_turns(engine)
    retriever = RetrieverClient(url, topk=2, timeout_s=5, retries=1, backoff_s=0.01)
    loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=("search", "calculator"),
                                          max_tokens_per_turn=200, **settings), retriever)
    try:
        [traj] = loop.run([PromptGroup(uid="t", data_source="nq", prompt=QUESTION,
                                       ground_truth={"target": ["Corvale"]})])
    finally:
        loop.close()
        engine.forced_tokens = None
        del engine.step
    return traj, seen, loop


def check_ids(traj, seen) -> list[list[int]]:
    """Token-in/token-out: response = generated + inserted, alternating; only generated ids are
    trained on. Returns the inserted runs."""
    response = traj.response_ids.tolist()
    assert [response[a:b] for a, b in spans(traj.loss_mask, 1)] == seen
    inserted = [response[a:b] for a, b in spans(traj.loss_mask, 0)]
    rebuilt = [ids for pair in zip(seen, [*inserted, []], strict=True) for ids in pair]
    assert response == sum(rebuilt, [])
    return inserted


def search_text(url: str) -> str:
    return passages_to_string(httpx_docs(url, "Brixol")).strip()


def test_hermes_several_calls_in_one_turn_qwen25(engine, retriever_url):
    """Two calls in one turn both run and answer in call order; the turn ran past the first
    `</tool_call>`, and stopped where the model began writing a result itself."""
    tok = engine.tokenizer
    tok.chat_template = QWEN25_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    both = ('<tool_call>\n{"name": "search", "arguments": {"query": "Brixol"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1907 - 1900"}}\n'
            "</tool_call>\n")
    turns = [tok.encode(both + "<tool_response>\nmade up", add_special_tokens=False) + [end],
             tok.encode("<answer> Corvale </answer>", add_special_tokens=False) + [end]]
    traj, seen, loop = play(engine, retriever_url, turns)
    assert loop.tool_format is HERMES and "</tool_call>" not in loop.tool_stops
    assert traj.finish_reason == "answer" and traj.num_searches == 1
    assert tok.decode(seen[0]) == both + "<tool_response>"  # stopped there
    [inserted] = check_ids(traj, seen)
    assert tok.decode(inserted) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + search_text(retriever_url)
        + "\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert traj.extra["tools"]["calculator"]["calls"] == 1


def test_llama31_json_calls(tiny_policy_dir, retriever_url):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA_TOKENS,
                            "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    tok.chat_template = (TEMPLATES / "llama3.1.jinja").read_text()
    engine = small_engine(tok, tiny_policy_dir)
    calls = ('{"name": "search", "parameters": {"query": "Brixol"}}; '
             '{"name": "calculator", "parameters": {"expression": "1907 - 1900"}}')
    ids = tok.convert_tokens_to_ids
    turns = [[ids("<|python_tag|>"), *tok.encode(calls, add_special_tokens=False),
              ids("<|eom_id|>")],
             tok.encode("<answer> Corvale </answer>", add_special_tokens=False)
             + [ids("<|eot_id|>")]]
    traj, seen, loop = play(engine, retriever_url, turns)
    assert loop.tool_format is LLAMA3_JSON and ids("<|eom_id|>") in loop.tool_stop_ids
    assert traj.finish_reason == "answer" and traj.num_searches == 1
    assert [t.action for t in traj.turns] == ["search", "answer"]
    assert tok.decode(traj.prompt_ids.tolist()).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython")
    [inserted] = check_ids(traj, seen)
    # the turn ended on <|eom_id|>: the template's <|eot_id|> is not inserted after it; each
    # result is its own ipython turn (the template writes a text result as a JSON string)
    header = "<|start_header_id|>ipython<|end_header_id|>\n\n"
    assert tok.decode(inserted) == (
        header + json.dumps(search_text(retriever_url)) + "<|eot_id|>" + header + '"7"'
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    """The real v3 tokenizer (Mistral-7B-Instruct-v0.3's) mistral-common ships."""
    import mistral_common
    from transformers import LlamaTokenizer

    where = tmp_path_factory.mktemp("mistral-v3")
    shutil.copy(Path(mistral_common.__file__).parent / "data"
                / "mistral_instruct_tokenizer_240323.model.v3", where / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(where, legacy=False)
    tok.chat_template = (TEMPLATES / "mistral-v0.3.jinja").read_text()
    return tok


def test_mistral_tool_calls_on_its_v3_tokenizer(mistral_tokenizer, tiny_policy_dir,
                                                retriever_url):
    tok = mistral_tokenizer
    engine = small_engine(tok, tiny_policy_dir)
    calls = ('[TOOL_CALLS] [{"name": "search", "arguments": {"query": "Brixol"}, "id": '
             '"a1b2c3d4e"}, {"name": "calculator", "arguments": {"expression": "1907 - 1900"}, '
             '"id": "f5g6h7i8j"}]')
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    turns = [encode(calls) + [tok.eos_token_id], encode("It is Corvale.") + [tok.eos_token_id],
             encode("<answer> Corvale </answer>") + [tok.eos_token_id]]
    assert turns[0][0] == tok.convert_tokens_to_ids("[TOOL_CALLS]")  # one control token
    traj, seen, loop = play(engine, retriever_url, turns)
    assert loop.tool_format is MISTRAL
    assert tok.convert_tokens_to_ids("[TOOL_RESULTS]") in loop.tool_stop_ids
    assert traj.finish_reason == "answer" and traj.num_searches == 1
    assert [t.action for t in traj.turns] == ["search", "invalid", "answer"]
    assert tok.decode(traj.prompt_ids.tolist()).startswith("<s>[AVAILABLE_TOOLS] [")
    results, corrective = check_ids(traj, seen)
    # the results name the calls' own ids, in call order; the policy's </s> closed its turn
    assert results == encode(
        '[TOOL_RESULTS] {"content": ' + search_text(retriever_url) + ', "call_id": "a1b2c3d4e"}'
        '[/TOOL_RESULTS][TOOL_RESULTS] {"content": 7, "call_id": "f5g6h7i8j"}[/TOOL_RESULTS]')
    # the template moves the tool list to the last user message: the corrective turn is
    # rendered without it (the prompt keeps it), never re-rendering what came before
    assert corrective == encode("[INST] " + MISTRAL.corrective + "[/INST]")


def test_calls_of_one_turn_run_concurrently_and_answer_in_order(engine, tmp_path):
    """Two slow user-tool calls of one turn run at once (their times overlap), and the slower,
    first call's result still comes first."""
    tools = tmp_path / "slow.py"
    tools.write_text("import time\n\ndef nap(seconds: float) -> str:\n"
                     "    start = time.time()\n    time.sleep(seconds)\n"
                     "    return f'slept {seconds} from {start} to {time.time()}'\n")
    tok = engine.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{{"name": "nap", "arguments": {{"seconds": {}}}}}\n</tool_call>'
    turns = [tok.encode(call.format(0.4) + "\n" + call.format(0.2), add_special_tokens=False)
             + [end], tok.encode("<answer> Corvale </answer>", add_special_tokens=False) + [end]]
    engine.forced_tokens = lambda r: turns[min(len(r.tag[1].turns), 1)]
    schema = {"type": "object", "required": ["seconds"],
              "properties": {"seconds": {"type": "number"}}}
    loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=(
        {"function": f"{tools}:nap", "parameters": schema},)))
    try:
        [traj] = loop.run([PromptGroup(uid="t", data_source="nq", prompt=QUESTION,
                                       ground_truth="x")])
    finally:
        loop.close()
        engine.forced_tokens = None
    [inserted] = [traj.response_ids[a:b].tolist() for a, b in spans(traj.loss_mask, 0)]
    text = tok.decode(inserted)
    (first, *one), (second, *two) = [tuple(map(float, found)) for found in re.findall(
        r"slept ([\d.]+) from ([\d.]+) to ([\d.]+)", text)]
    assert (first, second) == (0.4, 0.2)  # call order
    assert two[0] < one[1] and one[0] < two[1]  # the two naps overlapped
    assert traj.extra["tools"]["nap"]["calls"] == 2
