"""Error attribution of `forage eval` (services/eval/errors.py) on hand-made passages and
rows: each class, the order of the checks, what each dataset layout says about hops, the
per-row counts, and what reaches eval.json from a synthetic-world row."""

from __future__ import annotations

import numpy as np
import pytest

from services.eval import errors
from services.eval.errors import Support, attribute_error, support_of

GOLD = ["Thidrux"]
HIT = "Doc 1(Title: \"Stodru\") Stodru was born in Thidrux."
BRIDGE = "Doc 1(Title: \"Vedre Bonen\") Vedre Bonen founded Stodru."
MISS = "Doc 1(Title: \"Visun\") Visun was born in Matox."
TWO_HOP = Support(2, ("Stodru",))


@pytest.mark.parametrize(("searched", "passages", "support", "expected"), [
    (False, [], TWO_HOP, "never_searched"),
    (False, [HIT], None, "never_searched"),  # searched counts, not passages seen elsewhere
    (True, [MISS, HIT], None, "evidence_misread"),  # needs no hops
    (True, [HIT, BRIDGE], TWO_HOP, "evidence_misread"),  # the answer was there: misread first
    (True, [BRIDGE, MISS], TWO_HOP, "bridge_missed"),
    (True, [MISS], TWO_HOP, "first_hop_missed"),
    (True, [MISS], Support(1), "first_hop_missed"),
    (True, [MISS], None, "other"),  # no hops known: the hop classes cannot be told
    (True, [MISS], Support(2), "other"),  # a comparison question has no bridge
    (True, [], Support(1), "first_hop_missed"),
])
def test_attribute_error(searched, passages, support, expected) -> None:
    assert attribute_error(searched, passages, GOLD, support) == expected


def test_containment_is_normalised_and_whole_word() -> None:
    assert errors.contains("It was THE Eiffel Tower, in Paris.", "eiffel tower")
    assert not errors.contains("Parisian cafés", "Paris")
    assert not errors.contains("anything", "")
    block = "Doc 1(Title: \"A\") one\nDoc 2(Title: \"B\") two\n"
    assert errors.split_passages(block) == ['"A") one\n', '"B") two\n']
    assert errors.split_passages("plain text") == ["plain text"]


def test_support_of_each_layout() -> None:
    synth = {"extra_info": {"hops": np.int64(2), "bridge": "Stodru", "subject": "Vedre"}}
    assert support_of(synth, "q", GOLD) == Support(2, ("Stodru",))
    assert support_of({"extra_info": {"hops": 1, "bridge": ""}}, "q", GOLD) == Support(1)
    musique = {"metadata": {"question_decomposition": [
        {"question": "who founded X", "answer": "Stodru"},
        {"question": "where was #1 born", "answer": "Thidrux"}]}}
    assert support_of(musique, "q", GOLD) == Support(2, ("Stodru",))
    wiki = {"metadata": {"type": "compositional",
                         "evidences": np.array([["X", "founder", "Stodru"],
                                                ["Stodru", "born in", "Thidrux"]])}}
    assert support_of(wiki, "q", GOLD) == Support(2, ("Stodru",))
    compare = {"metadata": {"type": "comparison", "evidences": [["A", "born", "1900"],
                                                                 ["B", "born", "1910"]]}}
    assert support_of(compare, "q", GOLD) == Support(2)
    hotpot = {"metadata": {"type": "bridge", "supporting_facts": {
        "title": ["Vedre Bonen", "Stodru", "Stodru"], "sent_id": [0, 0, 1]}}}
    assert support_of(hotpot, "Where was the founder of Vedre Bonen born?", GOLD) == \
        Support(2, ("Stodru",))
    assert support_of({"metadata": {"type": "comparison", "supporting_facts": {
        "title": ["A", "B"], "sent_id": [0, 0]}}}, "q", GOLD) == Support(2)
    assert support_of({"question": "q"}, "q", GOLD) is None
    assert support_of({"metadata": {"question_decomposition": "garbled"}}, "q", GOLD) is None


def test_summarise_counts_and_fractions() -> None:
    lines = [{"error": None, "support": None}, {"error": "never_searched", "support": None},
             {"error": "bridge_missed", "support": {"hops": 2, "bridges": ["S"]}},
             {"error": "bridge_missed", "support": {"hops": 2, "bridges": ["S"]}},
             {"error": "other", "support": None}]
    found = errors.summarise(lines)
    assert found is not None and found["wrong"] == 4 and found["with_support"] == 2
    assert found["counts"]["bridge_missed"] == 2 and found["fractions"]["bridge_missed"] == 0.5
    assert found["counts"]["evidence_misread"] == 0
    assert set(found["counts"]) == set(errors.ERROR_CLASSES)
    assert errors.summarise([{"em": 1.0}]) is None  # a direct or rag row


def test_synthetic_rows_carry_their_hops_into_questions(tmp_path) -> None:
    from services.common.formats import search_r1_prompt
    from services.eval.data import load_questions
    from services.tasks.datasets import write_rows

    path = write_rows(tmp_path / "test.parquet", [{
        "data_source": "synth_multi",
        "prompt": [{"role": "user", "content": search_r1_prompt("Where was X's founder born")}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Thidrux"]}},
        "extra_info": {"index": 0, "subject": "X", "bridge": "Stodru", "hops": 2,
                       "relation": "founder/born_in"}}])
    (question,) = load_questions([str(path)])
    assert question.support == Support(2, ("Stodru",))
