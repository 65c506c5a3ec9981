"""`forage eval --protocol tool_calls` in process on the tiny policy: agent rows play the
rollout's tool-call protocol, their EM/sub-EM/F1 read the last assistant turn's answer (never
an `<answer>` quoted in a tool result), and the evidence probe replaces each search result by
the chat template's rendering of an empty or swapped tool message."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from services.eval.evaluate import EvalRequest, run
from services.eval.runner import EvalSettings, Row, play_row
from services.eval.stats import score_response

from .conftest import PEOPLE

SETTINGS = EvalSettings(topk=2, max_turns=1, max_tokens_per_turn=80, max_obs_length=120,
                        max_response_length=400, batch_size=6, protocol="tool_calls")
BORN = re.compile(r"born in (\w+)")
TOOL_MESSAGE = re.compile(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", re.DOTALL)


def call(name: str) -> str:
    return f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{name}"}}}}\n</tool_call>'


def person(text: str) -> int:
    return next(i for i, (name, _) in enumerate(PEOPLE) if name in text)


def script(engine, final: str, probe: str | None = None, seen: dict | None = None) -> None:
    """Turn 0 searches the person's name (the turn ends on its end-of-turn token), except the
    last person, who answers at once. The final turn answers right for
    even persons; odd persons call a tool again (not executed: max_turns) when `final` is
    "call". `probe`: how the evidence rewrites answer ("copier": the city of the last tool
    message; "memory": the question's)."""
    tok = engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def encode(text: str, end: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + ([eos] if end else [])

    def forced(request):
        if request.tag[0] == "turn":
            state = request.tag[1]
            number = person(state.group.extra["question"])
            name, city = PEOPLE[number]
            if not state.turns:
                if number == len(PEOPLE) - 1:
                    return encode(f"<answer> {city} </answer>")
                return encode(f"<think> look up {name} </think>\n{call(name)}")
            if number % 2 == 0 or final == "answer":
                return encode(f"<answer> {city} </answer>")
            return encode(call(city))
        if request.tag[0] != "evidence" or probe is None:
            return None
        _, qid, variant, _ = request.tag
        text = tok.decode(request.prompt_ids, skip_special_tokens=False)
        if seen is not None:
            seen.setdefault(variant, {})[qid] = text
        if probe == "memory":
            answer = PEOPLE[person(text.rsplit("Question:", 1)[1].split("\n", 1)[0])][1]
        else:
            found = BORN.search(TOOL_MESSAGE.findall(text)[-1])
            answer = found.group(1) if found else "nothing"
        return encode(f"<answer> {answer} </answer>")

    engine.forced_tokens = forced


class QuotingBackend:
    """A retriever whose passage quotes the gold answer in answer tags: a tool result the
    policy did not write."""

    def retrieve(self, queries):
        return [[{"document": {"id": str(i), "contents":
                               f'"{q}"\n{q} was born in <answer> {dict(PEOPLE).get(q, q)} '
                               "</answer>."}, "score": 1.0}] for i, q in enumerate(queries)]


def test_answers_are_read_from_the_last_turn_never_a_tool_result(eval_world, tmp_path):
    from services.eval.data import load_questions
    from services.rollout.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(str(eval_world["policy"]), max_batch_size=6,
                                                seed=0)
    script(engine, final="call")
    questions = load_questions([str(eval_world["flashrag"])], None, None)
    written: list[dict] = []
    row = Row(0, "tiny · agent", str(eval_world["policy"]), "agent")
    play_row(engine, row, questions, len(questions), SETTINGS, QuotingBackend(), "idx",
             written.extend)
    by_qid = {line["qid"]: line for line in written}
    assert len(by_qid) == len(PEOPLE)
    for number, (name, _) in enumerate(PEOPLE):
        line = by_qid[f"nq/test_{number}"]
        first = line["turns"][0]
        if number == len(PEOPLE) - 1:  # answered at once
            assert (line["em"], line["num_searches"], first["action"]) == (1.0, 0, "answer")
            assert line["error"] is None
            continue
        assert (first["action"], first["query"]) == ("search", name)
        assert line["num_searches"] == 1
        if number % 2 == 0:
            assert (line["em"], line["subem"], line["f1"]) == (1.0, 1.0, 1.0)
            assert line["finish_reason"] == "answer"
        else:  # the last turn called a tool: no answer, whatever the tool result quoted
            assert (line["em"], line["subem"], line["f1"]) == (0.0, 0.0, 0.0)
            assert line["finish_reason"] == "max_turns" and line["answer"] is None
            # the passages of the error attribution are the tool message, markers dropped
            assert line["error"] == "evidence_misread"
    # the teeth: read as a tags response (special tokens dropped), the quoted answer counts
    odd = by_qid["nq/test_1"]
    text = "".join(turn["text"] + turn["observation"] for turn in odd["turns"])
    assert "<answer> Dunmore </answer>" in odd["turns"][0]["observation"]
    assert score_response(text, {"target": ["Dunmore"]})["em"] == 1.0
    engine.forced_tokens = None


def probe_run(world: dict[str, Path], out: Path, probe: str, seen: dict | None = None,
              **kwargs) -> dict:
    settings = replace(SETTINGS, evidence_probe=True, evidence_samples=2)
    fields = {"models": [str(world["policy"])], "data": [str(world["flashrag"])],
              "modes": ["agent"], "out": str(out), "index": str(world["index"]),
              "settings": settings,
              "prepare_engine": lambda engine: script(engine, "answer", probe, seen), **kwargs}
    return run(EvalRequest(**fields))


def test_evidence_probe_replaces_tool_messages(eval_world, tmp_path):
    seen: dict = {}
    doc = probe_run(eval_world, tmp_path / "copier", "copier", seen)
    row = doc["rows"][0]
    assert doc["config"]["settings"]["protocol"] == "tool_calls"
    assert row["em"]["all"] == pytest.approx(1.0)  # every final turn answers right
    copier = row["evidence"]
    assert copier["probed"] == 5 and copier["skipped_no_search"] == 1
    assert copier["accuracy"] == {"real": 1.0, "none": 0.0, "swapped": 0.0}
    assert copier["gap"] == {"real_minus_none": 1.0, "real_minus_swapped": 1.0}
    # the three prompts differ only in the tool message's content, rendered by the template
    qid = "nq/test_0"
    real, none, swapped = (seen[v][qid] for v in ("real", "none", "swapped"))
    head = real.split("<|im_start|>tool\n")[0]
    assert none.split("<|im_start|>tool\n")[0] == head == swapped.split("<|im_start|>tool\n")[0]
    assert head.endswith("</tool_call><|im_end|>\n")
    assert none == head + "<|im_start|>tool\n<|im_end|>\n<|im_start|>assistant\n"
    assert "Brixol was born in Corvale" in real and "Corvale" not in swapped.split(head)[1]
    assert swapped.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "Doc 1(Title: " in TOOL_MESSAGE.findall(swapped)[-1]
    assert "<information>" not in real + none + swapped

    ignorer = probe_run(eval_world, tmp_path / "ignorer", "memory")["rows"][0]["evidence"]
    assert ignorer["accuracy"] == {"real": 1.0, "none": 1.0, "swapped": 1.0}


def test_protocol_setting_in_config_and_cli(tmp_path):
    from services.cli import build_parser

    assert "protocol" not in EvalSettings().as_dict()  # older OUT directories still resume
    assert EvalSettings(protocol="tool_calls").as_dict()["protocol"] == "tool_calls"
    parser = build_parser("eval")
    base = ["--model", "m", "--data", "d", "--mode", "agent", "--out", str(tmp_path)]
    assert parser.parse_args([*base, "--protocol", "tool_calls"]).protocol == "tool_calls"
    # not given: None, so a run through replicas can tell it from a choice; in process the
    # evaluation's default, tags
    assert parser.parse_args(base).protocol is None and EvalSettings().protocol == "tags"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--protocol", "json"])
    assert json.dumps(EvalSettings(protocol="tool_calls").as_dict())


def test_a_model_without_a_chat_template_is_a_user_error(eval_world, tmp_path):
    import shutil

    from services.eval.evaluate import EvalError

    model = tmp_path / "no-template"
    shutil.copytree(eval_world["policy"], model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(EvalError, match=r"^--protocol tool_calls with --model .*chat template"):
        run(EvalRequest(models=[str(model)], data=[str(eval_world["flashrag"])],
                        modes=["agent"], out=str(tmp_path / "out"),
                        index=str(eval_world["index"]), limit=1, settings=SETTINGS))
