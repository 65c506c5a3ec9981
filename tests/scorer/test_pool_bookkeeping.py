"""The pool's bookkeeping stays exact whatever fails: an item that cannot cross the pipe is
rejected alone, and a replacement worker that sat idle is used, not reported as failed."""

from __future__ import annotations

import time

from services.scorer.pool import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, Job, RewardPool
from services.scorer.scoring import Scorer, ScoreRequest


def test_unpackable_item_is_rejected_alone_and_the_next_run_is_exact():
    with RewardPool(num_workers=1, timeout_s=10.0, preload=()) as pool:
        results = pool.run([Job("operator:add", (1, 2)), Job("operator:add", (2**64, 1)),
                            Job("operator:add", ("\ud800", "x")), Job("operator:mul", (3, 4))])
        assert [r.status for r in results] == [STATUS_OK, STATUS_ERROR, STATUS_ERROR, STATUS_OK]
        assert results[0].value == 3 and results[3].value == 12
        assert "OverflowError" in results[1].error and "cannot send" in results[1].error
        assert "UnicodeEncodeError" in results[2].error
        # nothing stale is left in flight: a one-item run gets its own answer
        assert [(r.status, r.value) for r in pool.run([Job("operator:add", (5, 5))])] == [
            (STATUS_OK, 10)]


def test_scorer_fails_only_the_unpackable_math_item():
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        scorer = Scorer(pool=pool, inner_timeout_s=2)
        results = scorer.score_many([
            ScoreRequest("synth_math", "\\boxed{2}", "2"),
            ScoreRequest("synth_math", "\\boxed{2}", "2", extra_info={"big": 2**64}),
            ScoreRequest("synth_math", "\\boxed{3}", "3"),
        ])
        assert [r.score for r in (results[0], results[2])] == [1.0, 1.0]
        assert results[1].error and "OverflowError" in results[1].error
        assert scorer.score_one("synth_math", "\\boxed{7}", "7").score == 1.0


def test_replacement_worker_idle_past_the_start_timeout_is_used():
    """A replacement's "ready" message arrives while no run reads it; a later run must read
    it then instead of counting the idle time as a failed start."""
    with RewardPool(num_workers=1, timeout_s=1.0, preload=(), start_timeout_s=3.0) as pool:
        [hung] = pool.run([Job("time:sleep", (120,))])
        assert hung.status == STATUS_TIMEOUT and pool.restarts == 1
        time.sleep(4.0)  # idle, longer than start_timeout_s
        assert [(r.status, r.value) for r in pool.run([Job("operator:add", (1, 2))])] == [
            (STATUS_OK, 3)]
        assert pool.restarts == 1
