"""When held-out EM has stopped improving: the RL loop's early stop (`learner.early_stop_*`).

Why: a fixed `total_steps` either stops a run that is still learning or spends steps on one
that has stopped; on the demo's worlds most of RL's held-out gain comes in its first 50 steps.
A noisy evaluation makes the rule cut some runs at a dip, so it is off unless a config sets it
(bench/README.md, "Efficacy": a trial where it stopped three of four worlds at step 50).

The rule, checked after each evaluation: once the run is at least `min_steps` steps in, stop
when none of the last `patience` evaluations beat the best evaluation before them (the one
before training included) by more than `min_delta`. A run that is still learning sets a new
best at least once every `patience` evaluations and so is never cut; one that only holds its
level, or falls back, is. The EM a stopped run reports is its last evaluation, not its best, so
stopping on the held-out set does not pick the luckiest point of the curve.
"""

from __future__ import annotations

from collections.abc import Sequence


def plateau_reached(history: Sequence[tuple[int, float]], min_steps: int, patience: int,
                    min_delta: float = 0.0) -> bool:
    """True when the run should stop. `history`: (step, held-out EM) of every evaluation so
    far, oldest first, the latest last. `patience` 0 never stops."""
    if patience <= 0 or len(history) <= patience:
        return False
    step = history[-1][0]
    if step < min_steps:
        return False
    earlier = max(em for _, em in history[:-patience])
    recent = max(em for _, em in history[-patience:])
    return recent <= earlier + min_delta


def plateau_message(history: Sequence[tuple[int, float]], patience: int) -> str:
    """One line saying why the run stopped (for the log and the console)."""
    best_step, best = max(history[:-patience], key=lambda point: point[1])
    step, em = history[-1]
    return (f"held-out EM {em:.3f} at step {step}: no evaluation of the last {patience} beat "
            f"the best before them ({best:.3f} at step {best_step}); stopping early "
            "(learner.early_stop_patience)")
