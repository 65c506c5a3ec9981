"""`compute_score` gives the same score from any thread (docs/scorer.md, "From any thread"):
math_verify needs the main thread for its SIGALRM limits, so off it the isolated rewards run in
the shared worker-process pool — never a silent 0, never an error for the caller's threading."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.scorer.pool import RewardFailed
from services.scorer.rewards import compute_score
from services.scorer.scoring import Scorer, ScoreRequest

# (data source, response, ground truth, score): math_verify, and QA in the same calls.
ITEMS = [
    ("synth_math", "so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("synth_math", "\\boxed{3}", "4", 0.0),
    ("math", "x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("math", "no box at all", "1", 0.0),
    ("nq", "<answer> Paris </answer>", {"target": ["paris"]}, 1.0),
]


def score(item) -> float:
    source, response, gold, _ = item
    return compute_score(source, response, gold)


def test_main_thread_reference():
    assert [score(item) for item in ITEMS] == [item[3] for item in ITEMS]


def test_from_a_thread():
    out: list = []
    errors: list = []

    def run() -> None:
        try:
            out.extend(score(item) for item in ITEMS)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == []
    assert out == [item[3] for item in ITEMS]


def test_from_a_thread_pool_executor():
    with ThreadPoolExecutor(max_workers=4) as executor:
        assert list(executor.map(score, ITEMS * 3)) == [item[3] for item in ITEMS] * 3


def test_from_asyncio_to_thread():
    async def main() -> list[float]:
        return list(await asyncio.gather(*(asyncio.to_thread(score, item) for item in ITEMS)))

    assert asyncio.run(main()) == [item[3] for item in ITEMS]


def test_a_reward_error_off_the_main_thread_raises_naming_it():
    with ThreadPoolExecutor(max_workers=1) as executor:
        future = executor.submit(compute_score, "synth_math", "\\boxed{1}", None)
        with pytest.raises(RewardFailed, match="math_verify: ValueError: math ground truth"):
            future.result()


def test_scorer_without_a_pool_from_a_thread():
    scorer = Scorer(pool=None)
    requests = [ScoreRequest(source, response, gold) for source, response, gold, _ in ITEMS]
    with ThreadPoolExecutor(max_workers=1) as executor:
        results = executor.submit(scorer.score_many, requests).result()
    assert [r.error for r in results] == [None] * len(ITEMS)
    assert [r.score for r in results] == [item[3] for item in ITEMS]
