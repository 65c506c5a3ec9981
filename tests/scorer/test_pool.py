"""The reward worker-process pool: results in order, hung workers killed and replaced,
math_verify timeouts counted, usable from threads (where math_verify itself cannot run)."""

from __future__ import annotations

import threading
import time

import pytest

from services.scorer.pool import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, Job, RewardPool
from services.scorer.rewards.math import math_verify_reward
from services.scorer.scoring import Scorer, ScoreRequest

MATH_REF = "services.scorer.rewards.functions:math_verify"
ITEMS = [
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{3}", "4"), ("x = \\boxed{12}", "12"),
    ("nothing", "1"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("\\boxed{0.25}", "1/4"),
] * 5


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=10.0) as started:
        yield started


def test_results_match_in_process_scoring_and_keep_order(pool):
    jobs = [Job(MATH_REF, ("synth_math", s, g, None), {}) for s, g in ITEMS]
    results = pool.run(jobs)
    assert [r.status for r in results] == [STATUS_OK] * len(ITEMS)
    assert [r.value for r in results] == [math_verify_reward(s, g) for s, g in ITEMS]
    assert sum(r.value for r in results) == 4 * 5


def test_math_verify_timeout_is_reported_not_silent(pool):
    jobs = [Job(MATH_REF, ("synth_math", "\\boxed{9^{9^{9^{9}}}}", "1", None), {"timeout_s": 1}),
            Job(MATH_REF, ("synth_math", "\\boxed{1}", "1", None), {})]
    results = pool.run(jobs)
    assert results[0].status == STATUS_TIMEOUT and results[1].value == 1.0


def test_reward_error_is_reported(pool):
    results = pool.run([Job(MATH_REF, ("synth_math", "\\boxed{1}", None, None), {})])
    assert results[0].status == STATUS_ERROR and "ground truth" in results[0].error


def test_hung_worker_is_killed_and_replaced():
    """`time:sleep` stands in for C-level work SIGALRM cannot interrupt."""
    with RewardPool(num_workers=1, timeout_s=1.0, preload=()) as pool:
        before = pool.pids
        started = time.monotonic()
        results = pool.run([Job("operator:add", (1, 2)), Job("time:sleep", (120,)),
                            Job("operator:mul", (3, 4))])
        elapsed = time.monotonic() - started
        assert [r.status for r in results] == [STATUS_OK, STATUS_TIMEOUT, STATUS_OK]
        assert results[0].value == 3 and results[2].value == 12
        assert elapsed < 30
        assert pool.restarts == 1 and pool.pids != before
        assert pool.run([Job("operator:add", (5, 5))])[0].value == 10


def test_scorer_uses_the_pool_from_a_thread(pool):
    scorer = Scorer(pool=pool, inner_timeout_s=1)
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(scorer.score_many([
        ScoreRequest("synth_math", "\\boxed{\\frac{1}{2}}", "0.5"),
        ScoreRequest("synth_math", "\\boxed{9^{9^{9^{9}}}}", "2"),
        ScoreRequest("nq", "<answer>Paris</answer>", {"target": ["paris"]}),
        ScoreRequest("nope", "x", "y"),
    ])))
    thread.start()
    thread.join()
    assert out[0].score == 1.0 and out[0].components == {"math_verify": 1.0}
    assert out[1].score == 0.0 and out[1].timeouts == 1
    assert out[2].score == 1.0
    assert out[3].error and "nope" in out[3].error
