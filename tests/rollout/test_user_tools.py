"""User tools of `rollout.protocol: tool_calls` (docs/rollout.md, "Tool calls"): loading
`path/to/tools.py:function` entries, and the per-tool limits of services/rollout/tool_runner.py
(timeout, concurrency, retries), alone and through the real agent loop and tiny policy."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from services.common.config.rollout import UserTool
from services.common.tool_calls import ToolCall
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.tool_runner import Toolbox, ToolLoadError, ToolRunner

from .test_agent import spans

TOOLS_PY = '''
import threading, time
from services.common.tools import ToolRetry

CALLS = {"flaky": 0, "broken": 0}
RUNNING = {"now": 0, "most": 0}
LOCK = threading.Lock()

def lookup(key):
    """Look a name up in a small table.

    Second paragraph: not shown to the model."""
    return {"brixol": "Corvale"}.get(key.lower(), "unknown")

def hang(seconds=3600):
    time.sleep(seconds)
    return "woke up"

def busy(seconds):
    with LOCK:
        RUNNING["now"] += 1
        RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    time.sleep(seconds)
    with LOCK:
        RUNNING["now"] -= 1
    return {"slept": seconds}

def flaky():
    CALLS["flaky"] += 1
    if CALLS["flaky"] < 3:
        raise ConnectionError("reset by peer")
    return "ok at last"

def broken():
    CALLS["broken"] += 1
    raise ToolRetry("still down")

def wrong():
    raise KeyError("no such row")
'''

KEY = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"],
       "additionalProperties": False}
EMPTY = {"type": "object", "properties": {}}
SECONDS = {"type": "object", "properties": {"seconds": {"type": "number"}}}


@pytest.fixture()
def tools_py(tmp_path: Path) -> Path:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_PY)
    return path


def entry(path: Path, function: str, parameters: dict, **limits) -> dict:
    return {"function": f"{path}:{function}", "parameters": parameters, **limits}


# --------------------------------------------------------------------------- loading


def test_user_tool_loads_with_its_schema_and_docstring(tools_py):
    box = Toolbox.build(["search", entry(tools_py, "lookup", KEY)])
    assert box.names == ["search", "lookup"]
    spec = box.specs[1]
    assert spec.description == "Look a name up in a small table."
    assert spec.schema()["function"]["parameters"] == KEY
    assert box.runner is not None and "lookup" in box.runner and "search" not in box.runner
    named = Toolbox.build([UserTool.model_validate(
        entry(tools_py, "lookup", KEY, name="facts", description="Facts."))])
    assert named.names == ["facts"] and named.specs[0].description == "Facts."


@pytest.mark.parametrize("make, words", [
    (lambda p: entry(p.parent / "nope.py", "lookup", KEY), "nope.py does not exist"),
    (lambda p: entry(p, "missing", KEY), "has no missing"),
    (lambda p: {"function": "no_such_module_xyz:f", "parameters": KEY}, "cannot import"),
    (lambda p: entry(p, "lookup", {"type": "string"}), '"type": "object"'),
    (lambda p: entry(p, "lookup", KEY, name="search"), "'search' is already declared by "
                                                       "rollout.tools[0] (built-in search)"),
])
def test_bad_entries_are_one_line_errors_naming_the_entry(tools_py, make, words):
    with pytest.raises(ToolLoadError) as caught:
        Toolbox.build(["search", make(tools_py)])
    message = str(caught.value)
    assert message.startswith("rollout.tools[1]") and words in message and "\n" not in message


def test_config_load_checks_user_tool_entries(tools_py):
    from services.common.config import load_config

    good = json.dumps([entry(tools_py, "lookup", KEY, timeout_s=2)])
    config = load_config(None, ["rollout.protocol=tool_calls", f"rollout.tools={good}"])
    [tool] = config.rollout.tools
    assert tool.name == "lookup" and tool.timeout_s == 2 and tool.max_concurrency == 8
    for bad, words in [
        ([f"{tools_py}:lookup"], "needs its JSON schema"),
        ([entry(tools_py, "lookup", {"type": "object", "properties": {"k": {"type": 3}}})],
         "not a valid JSON schema"),
        ([entry(tools_py, "lookup", KEY, name="has space")], "1-64 letters"),
        ([entry(tools_py, "lookup", KEY, timeout_s=0)], "timeout_s"),
    ]:
        with pytest.raises(Exception, match="tools\\[0\\]") as caught:
            load_config(None, [f"rollout.tools={json.dumps(bad)}"])
        assert words in str(caught.value)
    with pytest.raises(Exception, match="exactly one of command"):
        load_config(None, ['rollout.mcp_servers=[{"name": "x"}]'])


def test_mcp_without_the_package_is_a_one_line_error(monkeypatch):
    from services.rollout import mcp_tools

    monkeypatch.setattr(mcp_tools, "_MISSING", "ModuleNotFoundError: No module named 'mcp'")
    with pytest.raises(ToolLoadError, match=r"needs the mcp package: pip install") as caught:
        Toolbox.build([], [{"name": "s", "command": "true"}])
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------- limits


def drain(runner: ToolRunner, limit_s: float = 10.0) -> dict:
    results, deadline = {}, time.monotonic() + limit_s
    while runner.pending and time.monotonic() < deadline:
        runner.wait(0.05)
        for result in runner.poll():
            results[result.key] = result
    assert not runner.pending
    return results


def test_a_hanging_tool_times_out_alone(tools_py):
    box = Toolbox.build([entry(tools_py, "hang", EMPTY, timeout_s=0.3),
                         entry(tools_py, "lookup", KEY)])
    runner = box.runner
    started = time.monotonic()
    runner.submit("hung", ToolCall("hang", {}))
    runner.submit("fine", ToolCall("lookup", {"key": "Brixol"}))
    first = []
    while not first:
        runner.wait(1.0)
        first = runner.poll()
    assert [r.key for r in first] == ["fine"] and first[0].text == "Corvale"
    assert time.monotonic() - started < 0.25  # the neighbour did not wait for the hung call
    results = drain(runner)
    hung = results["hung"]
    assert hung.text == "Error: tool hang timed out after 0.3s" and hung.outcome == "timeout"
    assert 0.3 <= time.monotonic() - started < 1.5


def test_concurrency_limit_and_queue_deadline(tools_py):
    box = Toolbox.build([entry(tools_py, "busy", SECONDS, max_concurrency=2, timeout_s=5)])
    module = box.runner.backends["busy"].function.__globals__
    for key in range(6):
        box.runner.submit(key, ToolCall("busy", {"seconds": 0.1}))
    results = drain(box.runner)
    assert all(r.ok and r.text == '{"slept": 0.1}' for r in results.values())
    assert module["RUNNING"]["most"] == 2
    # a call queued behind a hung one times out in the queue: its timeout counts from submit
    box = Toolbox.build([entry(tools_py, "hang", EMPTY, max_concurrency=1, timeout_s=0.3)])
    box.runner.submit("a", ToolCall("hang", {}))
    box.runner.submit("b", ToolCall("hang", {}))
    results = drain(box.runner)
    assert {r.outcome for r in results.values()} == {"timeout"}
    box.runner.submit("c", ToolCall("hang", {}))  # the hung thread still holds the only slot
    assert drain(box.runner)["c"].outcome == "timeout"


def test_retries_follow_transient_failures_only(tools_py):
    box = Toolbox.build([entry(tools_py, "flaky", EMPTY, retries=2),
                         entry(tools_py, "broken", EMPTY, retries=1),
                         entry(tools_py, "wrong", EMPTY, retries=3)])
    for name in ("flaky", "broken", "wrong"):
        box.runner.submit(name, ToolCall(name, {}))
    results = drain(box.runner)
    assert results["flaky"].ok and results["flaky"].text == "ok at last"
    assert results["flaky"].retries == 2 and results["flaky"].outcome == "ok"
    assert results["broken"].outcome == "error" and results["broken"].retries == 1
    assert results["broken"].text == ("Error: tool broken failed after 2 attempts: "
                                      "ToolRetry: still down")
    assert results["wrong"].outcome == "tool_error" and results["wrong"].retries == 0
    assert results["wrong"].text == "Error: tool wrong failed: KeyError: 'no such row'"


# --------------------------------------------------------------------------- in the loop


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def script(engine, turns_by_sample: dict[int, list[str]]) -> None:
    """Force each sample's turns (by its index in the group); the last ends with EOS."""
    tok = engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    encoded = {i: [tok.encode(t, add_special_tokens=False) + ([] if "</tool_call>" in t else [eos])
                   for t in turns] for i, turns in turns_by_sample.items()}

    def forced(request):
        if request.tag[0] != "turn":
            return None
        state = request.tag[1]
        turns = encoded[state.index]
        return turns[min(len(state.turns), len(turns) - 1)]

    engine.forced_tokens = forced


def observations(engine, traj) -> list[str]:
    tok = engine.tokenizer
    return [tok.decode(traj.response_ids[a:b].tolist()) for a, b in spans(traj.loss_mask, 0)]


def test_loop_hung_tool_costs_only_its_call(engine, tools_py):
    answer = "<answer> Corvale </answer>"
    script(engine, {0: [call_text("hang", {}), answer],
                    1: [call_text("lookup", {"key": "Brixol"}), answer]})
    # No search tool is declared, so no retriever is needed.
    settings = LoopSettings(protocol="tool_calls", max_turns=2,
                            tools=(entry(tools_py, "hang", EMPTY, timeout_s=0.5),
                                   entry(tools_py, "lookup", KEY)))
    loop = AgentLoop(engine, settings, None)
    group = PromptGroup(uid="u", data_source="nq", ground_truth={"target": ["Corvale"]},
                        prompt="Where was Brixol born?", n=2)
    started = time.monotonic()
    try:
        trajectories = loop.run([group])
    finally:
        loop.close()
        engine.forced_tokens = None
    hung, fine = trajectories
    assert hung.finish_reason == fine.finish_reason == "answer"
    assert "<|im_start|>tool\nError: tool hang timed out after 0.5s<|im_end|>" in observations(engine, hung)[0]
    assert "<|im_start|>tool\nCorvale<|im_end|>" in observations(engine, fine)[0]
    assert hung.extra["tools"]["hang"]["timeouts"] == 1 and hung.extra["tools"]["hang"]["failures"] == 1
    assert fine.extra["tools"]["lookup"] == {"calls": 1, "failures": 0, "timeouts": 0, "retries": 0,
                                             "seconds": fine.extra["tools"]["lookup"]["seconds"]}
    assert time.monotonic() - started < 30
    assert threading.active_count() < 50
