"""Search-R1's text formats, byte for byte (reference/search_r1.md sections 2-3)."""

from __future__ import annotations

from services.common.formats import (
    CORRECTIVE_MESSAGE,
    corpus_contents,
    cut_at_first_stop,
    information_block,
    normalize_question,
    parse_action,
    passages_to_string,
    search_r1_prompt,
)

DOCS = [
    {"id": "0", "contents": '"Evan Morris"\nEvan Morris Evan L. Morris was a lobbyist.'},
    {"id": "1", "contents": '"Two Lines"\nfirst line\nsecond line'},
]


def test_information_block_matches_search_r1() -> None:
    scored = [{"document": doc, "score": 0.5} for doc in DOCS]
    expected = (
        '\n\n<information>Doc 1(Title: "Evan Morris") Evan Morris Evan L. Morris was a lobbyist.\n'
        'Doc 2(Title: "Two Lines") first line\nsecond line</information>\n\n'
    )
    assert information_block(scored) == expected
    # Both /retrieve response shapes format identically.
    assert passages_to_string(DOCS) == passages_to_string(scored)


def test_corpus_contents_and_prompt() -> None:
    assert corpus_contents("Brixol Corp", "A company.") == '"Brixol Corp"\nA company.'
    assert normalize_question("  who founded Brixol Corp ") == "who founded Brixol Corp?"
    prompt = search_r1_prompt("who founded Brixol Corp")
    assert prompt.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert prompt.endswith("For example, <answer> Beijing </answer>. Question: who founded Brixol Corp?\n")


def test_parse_action_takes_first_match_and_strips() -> None:
    assert parse_action("<think>x</think><search> Brixol </search>") == ("search", "Brixol")
    assert parse_action("<answer> Paris </answer><search>q</search>") == ("answer", "Paris")
    assert parse_action("<search>a\nb</search>") == ("search", "a\nb")
    assert parse_action("<search>unclosed") is None
    assert parse_action("<search>mismatch</answer>") is None


def test_cut_at_first_stop_prefers_search() -> None:
    assert cut_at_first_stop("a<answer>x</answer> b<search>q</search> c") == (
        "a<answer>x</answer> b<search>q</search>"
    )
    assert cut_at_first_stop("a<answer>x</answer> tail") == "a<answer>x</answer>"
    assert cut_at_first_stop("no stop") == "no stop"


def test_corrective_message_verbatim() -> None:
    assert CORRECTIVE_MESSAGE.startswith("\nMy previous action is invalid.")
    assert CORRECTIVE_MESSAGE.endswith("Let me try again.\n")
