"""bench/demo_errors.py: the error buckets, their aggregation and the command on a real world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from demo_errors import Played, bucket, error_class, golds_of, summarise  # noqa: E402


@pytest.mark.parametrize(("played", "hops", "expected"), [
    (Played(("Vedre Bonen", "Stodru"), " THIDRUX."), 2, "correct"),  # scorer's normalisation
    (Played((), "Neston"), 1, "no search"),
    (Played((), None), 1, "no search"),
    (Played(("Vedre Tromax",), "Visun"), 1, "hop-1 query wrong"),
    (Played(("Vedre Bonen",), "Brimel"), 2, "stopped after hop 1"),
    (Played(("Vedre Bonen", "Visun"), "Brimel"), 2, "bridge query wrong"),
    (Played(("Vedre Bonen", "Stodru"), "Brimel"), 2, "answer misread"),
    (Played(("Vedre Bonen",), "poet"), 1, "answer misread"),
    (Played(("Vedre Bonen",), None), 1, "answer misread"),  # right passage, no answer
])
def test_bucket(played: Played, hops: int, expected: str) -> None:
    assert bucket(played, "Vedre Bonen", "Stodru", hops, "Thidrux") == expected


def _row(subject: str, relation: str, gold: str, bridge: str = "") -> dict:
    return {"extra_info": {"subject": subject, "relation": relation, "bridge": bridge,
                           "hops": 2 if bridge else 1},
            "reward_model": {"ground_truth": {"target": [gold]}}}


def test_summarise_counts_and_reading() -> None:
    rows = [_row("A B", "occupation", "poet"), _row("A B", "occupation", "poet"),
            _row("C D", "born_in", "Zenas"), _row("E F", "founder/born_in", "Zenas", "C D")]
    played = [Played(("A B",), "poet"), Played(("A B",), "farmer"),
              Played(("C E",), "Visun"), Played(("E F",), "Zenas")]
    summary = summarise(rows, played)
    assert summary["questions"] == 4 and summary["em"] == 0.5
    assert summary["buckets"][1]["correct"] == 1
    assert summary["buckets"][1]["answer misread"] == 1
    assert summary["buckets"][1]["hop-1 query wrong"] == 1
    assert summary["buckets"][2]["correct"] == 1
    # reading counts only single-hop questions whose query was right
    assert summary["reading"] == {"occupation": (1, 2)}


def test_error_classes_are_forage_evals() -> None:
    """Wrong answers get services/eval/errors.py's classes, from the same function and
    inputs `forage eval` uses, so the two tools agree on a trajectory."""
    from services.eval.errors import ERROR_CLASSES, attribute_error, support_of

    rows = [_row("A B", "occupation", "poet"), _row("C D", "born_in", "Zenas"),
            _row("E F", "founder/born_in", "Zenas", "C D"), _row("G H", "born_in", "Visun"),
            _row("I J", "born_in", "Visun")]
    played = [Played(("A B",), "farmer", ("A B was a poet.",)), Played((), None),
              Played(("E F", "C D"), "Brimel", ("E F was founded by C D.", "C D met Tira.")),
              Played(("G H",), "Neston", ("G H is a person.",)),
              Played(("I J",), "visun", ("I J was born in Visun.",))]
    summary = summarise(rows, played)
    assert summary["errors"] == {"wrong": 4, "counts": {
        "never_searched": 1, "first_hop_missed": 1, "bridge_missed": 1, "evidence_misread": 1,
        "other": 0}}
    assert list(summary["errors"]["counts"]) == list(ERROR_CLASSES)
    for row, outcome in zip(rows, played, strict=True):
        golds = golds_of(row)
        expected = None if outcome.answer == "visun" else attribute_error(
            bool(outcome.queries), outcome.passages, golds, support_of(row, "", golds))
        assert error_class(outcome, row) == expected


def test_not_a_run_directory(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "demo_errors.py"), str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert "is not a demo run directory" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_runs_on_a_real_world_and_policy(tmp_path: Path) -> None:
    """A synthetic world with its index and an untrained tiny policy: every question lands in
    exactly one bucket, and the JSON agrees with the printed table."""
    from services.tasks.cli_model import init_policy
    from services.tasks.synth import synthesize

    run = tmp_path / "run"
    synthesize(run / "world", seed=3, size="small", show_progress=False)
    init_policy(run / "world", run / "sft" / "policy")
    out = tmp_path / "errors.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "demo_errors.py"), str(run),
                           "--limit", "12", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| hops | correct | no search |" in done.stdout
    summary = json.loads(out.read_text())[str(run / "sft" / "policy")]
    assert summary["questions"] == 12
    assert sum(sum(c.values()) for c in summary["buckets"].values()) == 12
