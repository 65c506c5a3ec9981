"""Retrieval health (services/common/retrieval_health.py) on hand-made results and trajectories:
each definition, its denominator, the per-source split and what is left out."""

from __future__ import annotations

import pytest

from services.common.formats import contains_answer
from services.common.retrieval_health import (
    TrajectoryHealth,
    golds_of,
    health_metrics,
    is_empty,
    merge,
    pooled,
    trajectory_health,
    turn_retrieval,
)
from services.common.trajectory import Trajectory, Turn, TurnRetrieval


def doc(doc_id: str, contents: str, scored: bool = True) -> dict:
    item = {"id": doc_id, "contents": contents}
    return {"document": item, "score": 0.5} if scored else item


def search(query: str, ids: list[str], ms: float = 10.0, *, cached: bool = False,
           empty: int = 0, gold: bool | None = False) -> Turn:
    return Turn(0, 1, "search", query, docs=[{"id": i, "title": i} for i in ids],
                retrieval=TurnRetrieval(ms, cached, len(ids), empty, gold))


def trajectory(turns: list[Turn], source: str = "nq") -> Trajectory:
    turns = [*turns, Turn(1, 2, "answer", "x")]
    return Trajectory(uid="u", sample_id="u:0:0", data_source=source, policy_version=0,
                      prompt_ids=[1], response_ids=[1, 2], loss_mask=[1, 1],
                      rollout_logprobs=[0.0, 0.0], turns=turns)


def test_gold_is_whole_words_after_normalisation_in_either_result_shape():
    golds = golds_of({"target": ["The Corvale", "1900"]})
    assert golds == ["corvale", "1900"]
    hit = [doc("0", '"Brixol"\nBrixol was born in corvale.'), doc("1", '"X"\nNothing.')]
    found = turn_retrieval(hit, golds, ms=3.5, cached=False)
    assert (found.passages, found.empty, found.gold, found.ms, found.cached) == (2, 0, True, 3.5,
                                                                                 False)
    # "1900" is not in "19001", nor "corvale" in "corvales": whole words, as eval's attribution
    miss = [doc("2", '"Y"\nIn 19001 corvales grew.', scored=False)]
    assert turn_retrieval(miss, golds, 1.0, True).gold is False
    for text in ('"Brixol"\nBrixol was born in corvale.', "In 19001 corvales grew."):
        assert turn_retrieval([doc("9", text)], golds, 0, False).gold == any(
            contains_answer(text, g) for g in ("The Corvale", "1900"))


def test_a_ground_truth_without_gold_answers_judges_nothing():
    assert golds_of({"numbers": [1, 2], "target_sum": 3}) is None  # no "target"
    assert golds_of({"target": ["", " the "]}) is None  # nothing left after normalising
    assert golds_of(None) is None
    assert turn_retrieval([doc("0", "text")], None, 1.0, False).gold is None


def test_empty_passages_and_empty_results():
    assert is_empty("") and is_empty('""\n') and is_empty('  "" \n ')
    assert not is_empty('"Title"\n') and not is_empty("x")
    found = turn_retrieval([doc("0", '""\n'), doc("1", '"T"\ntext')], ["x"], 1.0, False)
    assert (found.passages, found.empty) == (2, 1)
    nothing = turn_retrieval([], ["x"], 1.0, False)
    assert (nothing.passages, nothing.empty, nothing.gold) == (0, 0, False)


def test_merge_of_a_turns_several_search_calls():
    a = TurnRetrieval(5.0, True, 2, 1, None)
    b = TurnRetrieval(9.0, False, 3, 0, True)
    assert merge(None, a) == a
    assert merge(a, b) == TurnRetrieval(9.0, False, 5, 1, True)
    assert merge(a, TurnRetrieval(1.0, True, 1, 1, None)).gold is None


def test_trajectory_counts_repeats_against_earlier_turns_only():
    health = trajectory_health(trajectory([
        search("Who is Brixol?", ["a", "b"], 10, gold=False),
        search("who is brixol", ["b", "c"], 20, gold=True),  # same normalised query, b again
        search("Corvale", ["a", "b", "c"], 30, cached=True, empty=3, gold=False),  # all seen
        Turn(0, 1, "search", "final, never executed"),  # no retrieval: not a search turn here
    ]))
    assert health == TrajectoryHealth("nq", searches=3, gold=True, empty_turns=1, passages=7,
                                      repeated_passages=4, repeated_queries=1, cached_turns=1,
                                      latencies_ms=[10, 20, 30])
    assert trajectory_health(trajectory([])).searches == 0


def test_step_metrics_pool_trajectories_per_source():
    step = [
        trajectory([search("q1", ["a"], 10, gold=True), search("q1", ["a"], 30)], "nq"),
        trajectory([search("q2", [], 20, gold=False)], "nq"),  # an empty result
        trajectory([search("q3", ["d", "e"], 40, cached=True, gold=None)], "hotpotqa"),
        trajectory([], "hotpotqa"),  # answered without searching: in no denominator
    ]
    m = health_metrics(step)
    assert m["retrieval/search_turns"] == 4
    assert m["retrieval/gold_hit_rate"] == pytest.approx(1 / 2)  # hotpotqa's had no gold
    assert m["retrieval/empty_rate"] == pytest.approx(1 / 4)
    assert m["retrieval/repeated_passage_rate"] == pytest.approx(1 / 4)  # "a" again, of 4
    assert m["retrieval/repeated_query_rate"] == pytest.approx(1 / 4)
    assert m["retrieval/cache_hit_rate"] == pytest.approx(1 / 4)
    assert m["retrieval/latency_p50_ms"] == pytest.approx(25.0)
    assert m["retrieval/latency_p99_ms"] == pytest.approx(39.7)
    assert m["retrieval/gold_hit_rate/nq"] == pytest.approx(1 / 2)
    assert m["retrieval/empty_rate/nq"] == pytest.approx(1 / 3)
    assert m["retrieval/latency_p50_ms/hotpotqa"] == 40.0
    assert "retrieval/gold_hit_rate/hotpotqa" not in m  # nothing to judge, not a 0
    assert m["retrieval/cache_hit_rate/hotpotqa"] == 1.0
    assert health_metrics([trajectory([])]) == {}  # no search: no retrieval/* keys at all


def test_reproducible_counts_leave_the_clock_and_the_cache_out():
    health = trajectory_health(trajectory([search("q", ["a"], 12.0, cached=True, gold=True)]))
    counts = health.counts()
    assert counts == {"searches": 1, "gold_hit": True, "empty_turns": 0, "passages": 1,
                      "repeated_passages": 0, "repeated_queries": 0}
    back = TrajectoryHealth.from_counts("nq", counts)
    table = pooled([back], prefix="", timed=False)
    assert table["gold_hit_rate"] == 1.0 and "latency_p50_ms" not in table
    assert "cache_hit_rate" not in table and table["gold_hit_rate/nq"] == 1.0
