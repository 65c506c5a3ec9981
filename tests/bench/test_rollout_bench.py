"""bench/rollout.py's model.generate baseline replays the engine's trajectories token for
token: the split of a response into turns (by the trajectory's turn spans) and observations
must be exact."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout import ForceTurn, turn_segments  # noqa: E402

from services.common.trajectory import Trajectory, Turn  # noqa: E402


def _traj(response: list[int], mask: list[int], turns: list[Turn]) -> Trajectory:
    return Trajectory(uid="u", sample_id="s", data_source="nq", policy_version=0,
                      prompt_ids=np.array([1, 2]), response_ids=np.array(response),
                      loss_mask=np.array(mask), rollout_logprobs=np.zeros(len(response)),
                      turns=turns)


def test_turn_segments_pair_each_turn_with_the_observation_after_it():
    turns = [Turn(0, 3, "search", "a"), Turn(5, 7, "search", "b"), Turn(8, 9, "answer")]
    traj = _traj([5, 6, 7, 90, 91, 8, 9, 92, 10], [1, 1, 1, 0, 0, 1, 1, 0, 1], turns)
    assert turn_segments(traj) == [([5, 6, 7], [90, 91]), ([8, 9], [92]), ([10], [])]


def test_force_turn_makes_each_row_play_its_script_then_eos():
    force = ForceTurn([[3, 4], [5]], start=2, eos=0)
    ids = torch.zeros((2, 3), dtype=torch.long)  # one token generated so far
    scores = force(ids, torch.randn(2, 8))
    assert scores.argmax(-1).tolist() == [4, 0]
    assert torch.isinf(scores).sum() == 2 * 8 - 2
