"""Tool-call protocol, pure parts: the calculator, the Hermes parser and its validation, the
registry and the config keys (docs/rollout.md, "Tool calls")."""

from __future__ import annotations

import json
import math
import time

import pytest

from services.common import tool_calls as tc
from services.common.calculator import MAX_EXPONENT, CalculatorError, evaluate, format_result
from services.common.config import load_config
from services.common.tools import CALCULATOR, SEARCH, TOOL_REGISTRY, tool_specs

SPECS = [SEARCH, CALCULATOR]


# --------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
    ("2 ** 10", 1024), ("-2 ** 2", -4), ("+(3)", 3), ("1.5 * 4", 6.0), ("2 ** -1", 0.5),
    ("  1907 - 1900 ", 7), ("1e3 + 1", 1001.0), ("0 ** 1000", 0), ("(-1) ** 999", -1), ("2 ** 1000", 2 ** 1000),
    ("+".join(["1"] * 150), 150),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, words", [
    ("__import__('os').system('true')", "not allowed"),
    ("x + 1", "'x' is not allowed"),
    ("abs(-1)", "not allowed"),
    ("(1).real", "not allowed"),
    ("[1, 2]", "not allowed"),
    ("1 if 1 else 2", "not allowed"),
    ("1 < 2", "not allowed"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 1j", "only numbers"),
    ("1 +", "not a valid arithmetic expression"),
    ("", "empty"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1 // 0.0", "division by zero"),
    (f"2 ** {MAX_EXPONENT + 1}", "exponents are limited"),
    ("9 ** 9 ** 9", "exponents are limited"),
    ("99 ** 999", "too large"),
    ("1e308 * 10", "not a finite number"),
    ("10.0 ** 400", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1" * 600, "longer than"),
    ("-" * 300 + "1", "nested"),
    ("1\x00", "not a valid"),
])
def test_calculator_refuses_with_clear_text(expression, words):
    started = time.perf_counter()
    with pytest.raises(CalculatorError) as refused:
        evaluate(expression)
    assert words in str(refused.value)
    assert time.perf_counter() - started < 1.0  # bounded work, even for 9**9**9


def test_calculator_never_calls_eval(monkeypatch):
    import builtins

    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert evaluate("(2 + 3) * 4") == 20


def test_calculator_result_text():
    assert format_result(7) == "7" and format_result(6.0) == "6" and format_result(3.5) == "3.5"
    assert format_result(2 ** 100) == str(2 ** 100) and format_result(1e300) == "1e+300"
    assert not math.isnan(evaluate("0.1 + 0.2"))


# --------------------------------------------------------------------------- registry / config


def test_registry_declarations_are_chat_template_tools():
    assert set(TOOL_REGISTRY) == {"search", "calculator"}
    declared = SEARCH.schema()
    assert declared["type"] == "function" and declared["function"]["name"] == "search"
    assert declared["function"]["parameters"]["required"] == ["query"]
    json.dumps([spec.schema() for spec in SPECS])  # plain JSON, as templates need
    assert tool_specs(["calculator", "search"]) == [CALCULATOR, SEARCH]
    with pytest.raises(KeyError, match="unknown tools"):
        tool_specs(["search", "browser"])
    with pytest.raises(KeyError, match="twice"):
        tool_specs(["search", "search"])


def test_config_keys_default_to_tags_and_refuse_unknown_tools():
    config = load_config(None)
    assert config.rollout.protocol == "tags" and config.rollout.tools == ["search"]
    config = load_config(None, ["rollout.protocol=tool_calls",
                                "rollout.tools=[search, calculator]"])
    assert config.rollout.protocol == "tool_calls"
    assert config.rollout.tools == ["search", "calculator"]
    with pytest.raises(Exception, match="unknown tool .browser."):
        load_config(None, ["rollout.tools=[browser]"])
    with pytest.raises(Exception, match="protocol"):
        load_config(None, ["rollout.protocol=json"])


# --------------------------------------------------------------------------- parser


def call(name, arguments, spacing="\n"):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{spacing}{body}{spacing}</tool_call>"


def test_parses_hermes_calls_in_order():
    text = "<think> two lookups </think>\n" + call("search", {"query": "Brixol"}) + \
        call("calculator", {"expression": "1 + 1"}, spacing="")
    parsed = tc.parse_turn(text, SPECS)
    assert parsed.action == "tool" and parsed.answer is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("search", {"query": "Brixol"}), ("calculator", {"expression": "1 + 1"})]
    assert all(isinstance(c, tc.ToolCall) for c in parsed.calls)


def test_arguments_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    [parsed] = tc.parse_tool_calls(text, SPECS)
    assert parsed == tc.ToolCall("search", {"query": "x"}, parsed.raw)


def test_answer_before_a_call_wins_and_after_a_call_does_not():
    assert tc.parse_turn("<answer> Corvale </answer>", SPECS).answer == "Corvale"
    first = tc.parse_turn("<answer>A</answer>" + call("search", {"query": "q"}), SPECS)
    assert first.action == "answer" and first.answer == "A"
    later = tc.parse_turn(call("search", {"query": "q"}) + "<answer>A</answer>", SPECS)
    assert later.action == "tool" and later.answer is None
    assert tc.parse_turn("I think it is Corvale.", SPECS).action == "invalid"


@pytest.mark.parametrize("body, kind, words", [
    ('{"name": "search", "arguments": {"query": "x"}', "malformed_json", "not valid JSON"),
    ("search(query='x')", "malformed_json", "not valid JSON"),
    ("", "malformed_json", "not valid JSON"),
    ('["search", {"query": "x"}]', "not_a_call", '"name" string'),
    ('{"arguments": {"query": "x"}}', "not_a_call", '"name" string'),
    ('{"name": "browser", "arguments": {"url": "x"}}', "unknown_tool",
     "unknown tool 'browser'. Available tools: calculator, search"),
    ('{"name": "search", "arguments": {}}', "bad_arguments", "'query' is a required property"),
    ('{"name": "search", "arguments": {"query": 3}}', "bad_arguments", "is not of type 'string'"),
    ('{"name": "search", "arguments": {"query": "x", "k": 3}}', "bad_arguments",
     "Additional properties are not allowed"),
    ('{"name": "search", "arguments": [1]}', "bad_arguments", "must be a JSON object"),
    ('{"name": "calculator", "arguments": {"expression": null}}', "bad_arguments",
     "is not of type 'string'"),
])
def test_bad_calls_become_typed_errors_with_clear_text(body, kind, words):
    [parsed] = tc.parse_tool_calls(f"<tool_call>{body}</tool_call>", SPECS)
    assert isinstance(parsed, tc.ToolCallError) and parsed.kind == kind
    assert parsed.message.startswith("Error: ") and words in parsed.message


def test_unterminated_call_and_deep_nesting():
    [parsed] = tc.parse_tool_calls('<tool_call>{"name": "search", "argu', SPECS)
    assert parsed.kind == "unterminated" and "</tool_call>" in parsed.message
    deep = "[" * 100_000 + "]" * 100_000
    [parsed] = tc.parse_tool_calls(f"<tool_call>{deep}</tool_call>", SPECS)
    assert isinstance(parsed, tc.ToolCallError)
    assert len(parsed.message) < 400  # the raw text is quoted, cut


def test_the_small_validator_says_what_jsonschema_says():
    schema = SEARCH.parameters
    for value in ({"query": "x"}, {}, {"query": 3}, {"query": "x", "k": 1}, {"query": True}):
        small = tc.validate_small(value, schema)
        full = tc.validate(value, schema)
        assert (small is None) == (full is None), value
        if full is not None:
            assert small.split(": ")[-1].split(" ")[-1] == full.split(": ")[-1].split(" ")[-1]
    assert tc.validate_small(3, {"type": "integer"}) is None
    assert tc.validate_small(True, {"type": "integer"}) is not None
    assert tc.validate_small("b", {"enum": ["a"]}) is not None
    assert tc.validate_small([1, "x"], {"type": "array", "items": {"type": "number"}}) == \
        '1: "x" is not of type \'number\''


def test_without_jsonschema_the_small_validator_is_used(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    [parsed] = tc.parse_tool_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                                   SPECS)
    assert parsed.kind == "bad_arguments" and "'query' is a required property" in parsed.message
