"""`forage report RUN_DIR`: summary numbers from a metrics.jsonl, PNG plots, and the CLI."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.launch.report import (
    ReportError,
    load_metrics,
    read_metrics,
    summarize,
    write_report,
)

FORAGE = Path(sys.executable).with_name("forage")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("reward_em.png", "searches.png", "response_length.png", "probe_curve.png")
FRACTIONS = (0.0, 0.5, 1.0)


def _train(step: int, reward: float, probe: bool = True, incorrect: bool = True) -> dict:
    row = {
        "kind": "train", "step": step, "policy_version": step, "time": 1_700_000_000 + step,
        "elapsed_s": 10.0 * step, "reward/mean": reward, "reward/synth/mean": reward,
        "em/mean": step / 20, "searches/mean": 1.0 + step / 10, "turns/mean": 2.0,
        "response_length/mean": 50.0 + step, "staleness/mean": 0.5, "actor/pg_loss": -0.1,
    }
    if probe:
        for f in FRACTIONS:
            row[f"probe_all/score_at_{f:.2f}"] = step / 20 + f / 4
            row[f"probe_correct/score_at_{f:.2f}"] = step / 20 + f / 2
            if incorrect:
                row[f"probe_incorrect/score_at_{f:.2f}"] = step / 20
        row["probe_all/overconf"] = step / 100
        row["probe_all/mean_score"] = step / 20
    return row


def _eval(step: int, em: float, searches: float, elapsed: float) -> dict:
    return {"kind": "eval", "step": step, "policy_version": step, "time": 1_700_000_000 + step,
            "elapsed_s": elapsed, "eval/em": em, "eval/em/mean": em, "eval/em/synth": em, "eval/reward": em,
            "eval/searches/mean": searches, "eval/response_length/mean": 40.0, "eval/n": 8}


def _write_run(run_dir: Path) -> Path:
    """Eval at 0 and 7, train steps 1..7 with the probe on, step 3 logged twice, 3 bad lines.

    Step 1 has no incorrect trajectories; the first line of step 3 is what a learner that was
    killed after step 3 (and resumed from the step-2 checkpoint) left behind.
    """
    lines = [json.dumps(_eval(0, 0.25, 0.5, 2.0))]
    lines.append(json.dumps(_train(1, 0.1, incorrect=False)))
    lines.append(json.dumps(_train(2, 0.2)))
    lines.append(json.dumps({**_train(3, 9.0), "probe_correct/score_at_0.00": 9.0}))
    lines.append(json.dumps(_train(3, 0.3)))  # the resumed run's step 3 replaces the first
    lines.append("this is not json {")
    for step in range(4, 8):
        lines.append(json.dumps(_train(step, step / 10)))
    lines.append(json.dumps(_eval(7, 0.75, 1.5, 75.0)))
    lines.append(json.dumps({"kind": "histogram", "step": 7}))
    lines.append("")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("\n".join(lines) + '\n{"kind": "train", "step": 8, "rew')  # half-written
    return path


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    _write_run(tmp_path / "run")
    return tmp_path / "run"


def test_read_metrics_skips_and_counts_malformed_lines(run_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="forage.report"):
        parsed = load_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in parsed.train] == [1, 2, 3, 4, 5, 6, 7]
    assert [row["step"] for row in parsed.eval] == [0, 7]
    assert parsed.train[2]["reward/mean"] == 0.3  # the later line of a repeated step wins
    assert parsed.malformed == 3
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "line 6: not JSON" in warned
    assert "line 12: unknown kind 'histogram'" in warned
    assert "line 14: not JSON" in warned
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    assert train == parsed.train and evals == parsed.eval


def test_summary_numbers(run_dir: Path) -> None:
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(train, evals, None)
    assert summary["em_before"] == 0.25
    assert summary["em_after"] == 0.75
    assert summary["em_delta"] == 0.5
    assert (summary["em_before_step"], summary["em_after_step"]) == (0, 7)
    assert summary["em_after_by_source"] == {"synth": 0.75}
    assert (summary["searches_before"], summary["searches_after"]) == (0.5, 1.5)
    assert summary["steps"] == 7
    assert summary["policy_version"] == 7
    assert summary["wall_seconds"] == 75.0  # the largest elapsed_s of any line
    assert summary["reward_first"] == pytest.approx(0.3)  # steps 1..5
    assert summary["reward_last"] == pytest.approx(0.5)  # steps 3..7
    assert summary["train_em_first"] == pytest.approx(0.15)
    assert summary["train_em_last"] == pytest.approx(0.25)

    start, end = summary["probe_start"], summary["probe_end"]
    assert start["fractions"] == end["fractions"] == [0.0, 0.5, 1.0]
    # steps 1..5: mean step/20 = 0.15; correct adds f/2, all adds f/4
    assert start["correct"] == pytest.approx([0.15, 0.4, 0.65])
    assert start["all"] == pytest.approx([0.15, 0.275, 0.4])
    # step 1 logged no incorrect trajectories: the start averages steps 2..5 (3.5/20)
    assert start["incorrect"] == pytest.approx([0.175, 0.175, 0.175])
    # steps 3..7: mean step/20 = 0.25
    assert end["correct"] == pytest.approx([0.25, 0.5, 0.75])
    assert end["incorrect"] == pytest.approx([0.25, 0.25, 0.25])
    assert summary["probe_overconf_start"] == pytest.approx(0.03)
    assert summary["probe_overconf_end"] == pytest.approx(0.05)


def test_demo_wall_seconds_wins_and_missing_parts_are_none() -> None:
    train = [_train(1, 0.5, probe=False)]
    summary = summarize(train, [], {"wall_seconds": 123.5, "quick": True})
    assert summary["wall_seconds"] == 123.5
    assert summary["em_before"] is None and summary["em_after"] is None
    assert summary["em_delta"] is None and summary["searches_before"] is None
    assert summary["probe_start"] is None and summary["probe_end"] is None
    assert summary["steps"] == 1 and summary["reward_first"] == summary["reward_last"] == 0.5
    empty = summarize([], [_eval(0, 0.1, 0.2, 3.0)], None)
    assert empty["steps"] == 0 and empty["reward_first"] is None
    assert empty["em_before"] == empty["em_after"] == 0.1 and empty["em_delta"] == 0.0
    assert empty["wall_seconds"] == 3.0


def test_write_report_writes_summary_and_pngs(run_dir: Path) -> None:
    (run_dir / "demo.json").write_text(json.dumps({"wall_seconds": 300.25}))
    summary = write_report(run_dir)
    out = run_dir / "report"
    assert summary["files"][:5] == ["summary.json", *PLOTS]
    assert summary["files"][5:] == ["per_source.png", "rl_health.png", "probe_heatmap.png",
                                    "retrieval.png", "index.html"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["wall_seconds"] == 300.25 and on_disk["malformed_lines"] == 3
    assert on_disk["em_delta"] == 0.5
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 5_000, name  # axes, lines and text, not an empty canvas


def test_plots_are_written_without_probe_or_eval_data(tmp_path: Path) -> None:
    run = tmp_path / "noprobe"
    run.mkdir()
    rows = [_train(step, 0.1 * step, probe=False) for step in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = write_report(run, tmp_path / "elsewhere")
    assert summary["probe_start"] is None and summary["em_before"] is None
    for name in ("summary.json", *PLOTS):
        assert (tmp_path / "elsewhere" / name).is_file(), name
    assert not (run / "report").exists()
    assert (tmp_path / "elsewhere" / "probe_curve.png").read_bytes().startswith(PNG_SIGNATURE)


def test_missing_or_empty_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=re.escape(str(tmp_path / "nope"))):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=re.escape(str(tmp_path / "empty" / "metrics.jsonl"))):
        write_report(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text('garbage\n{"step": 1}\n[1, 2]\n')
    with pytest.raises(ReportError, match=r"no valid train or eval line \(3 malformed"):
        write_report(tmp_path / "empty")


def test_cli_prints_the_table_and_the_paths(run_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run([str(FORAGE), "report", str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"EM \(eval\)\s+0\.250 -> 0\.750\s+\(delta \+0\.500\)", out), out
    assert re.search(r"RL steps\s+7\n", out), out
    assert re.search(r"wall time\s+1m 15\.0s \(75\.0 s\)", out), out
    assert re.search(r"searches \(eval\)\s+0\.50 -> 1\.50", out), out
    assert re.search(r"skipped lines\s+3", out), out
    for name in ("summary.json", *PLOTS):
        assert str(run_dir / "report" / name) in out
        assert (run_dir / "report" / name).is_file()
    assert "line 6: not JSON" in result.stderr  # the warning reaches the user

    other = tmp_path / "custom_out"
    result = subprocess.run([str(FORAGE), "report", str(run_dir), "--out", str(other)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (other / "summary.json").is_file() and str(other / "probe_curve.png") in result.stdout


def test_cli_missing_run_dir_exits_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_run"
    result = subprocess.run([str(FORAGE), "report", str(missing)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert str(missing) in result.stderr and "error" in result.stderr
    assert result.stdout == ""


def test_evidence_probe_in_the_summary_only_when_it_ran(tmp_path: Path) -> None:
    from services.launch.cli_report import format_table
    from services.launch.report_html import summary_table

    rows = [_train(step, 0.1, probe=False) for step in range(1, 8)]
    plain = summarize(rows, [], None)
    assert not any(key.startswith("evidence_") for key in plain)
    assert "evidence" not in summary_table(plain, [])
    for step, row in enumerate(rows, start=1):
        if step >= 2:  # probe.evidence.every_k_versions: step 1 did not probe
            row.update({"probe/evidence_count": 4.0, "probe/evidence_real_em": 0.5,
                        "probe/evidence_none_em": 0.1, "probe/evidence_swapped_em": 0.1 * step,
                        "probe/evidence_gap": 0.6 - 0.1 * step})
    summary = summarize(rows, [], None)
    assert summary["evidence_real_em_start"] == 0.5
    assert summary["evidence_swapped_em_start"] == pytest.approx(0.4)  # steps 2..6
    assert summary["evidence_gap_end"] == pytest.approx(0.1)  # steps 3..7
    assert "evidence gap (real - swapped EM)" in summary_table(summary, [])
    assert re.search(r"evidence gap\s+0\.200 -> 0\.100", format_table(summary))


def test_retrieval_health_in_the_summary_table_and_page_only_when_logged() -> None:
    """retrieval/* train keys (and eval/retrieval/*): first and last 5 steps, per source,
    held-out before and after, in summary.json, the CLI table and the page's own table."""
    from services.launch.cli_report import format_table
    from services.launch.report_html import retrieval_table, summary_table

    rows = [_train(step, 0.5, probe=False) for step in range(1, 8)]
    plain = summarize(rows, [], None)
    assert "retrieval" not in plain and "gold in passages" not in format_table(plain)
    assert "No retrieval health logged" in retrieval_table(plain.get("retrieval"))
    for step, row in enumerate(rows, start=1):
        for source, gold in (("synth", 0.1 * step), ("hotpotqa", 0.5)):
            row.update({f"retrieval/gold_hit_rate/{source}": gold,
                        f"retrieval/search_turns/{source}": 4.0})
        row.update({"retrieval/gold_hit_rate": 0.1 * step, "retrieval/empty_rate": 0.25,
                    "retrieval/repeated_passage_rate": 0.0, "retrieval/repeated_query_rate": 0.5,
                    "retrieval/latency_p50_ms": 10.0 * step, "retrieval/latency_p99_ms": 90.0,
                    "retrieval/cache_hit_rate": 0.0, "retrieval/search_turns": 8.0})
    evals = [{**_eval(0, 0.25, 1.0, 1.0), "eval/retrieval/gold_hit_rate": 0.4},
             {**_eval(7, 0.5, 1.0, 9.0), "eval/retrieval/gold_hit_rate": 0.6}]
    found = summarize(rows, evals, None)["retrieval"]
    assert found["first"]["gold_hit_rate"] == pytest.approx(0.3)  # steps 1..5
    assert found["last"]["gold_hit_rate"] == pytest.approx(0.5)  # steps 3..7
    assert found["last"]["latency_p50_ms"] == pytest.approx(50.0)
    assert found["by_source"]["hotpotqa"]["last"]["gold_hit_rate"] == 0.5
    assert sorted(found["by_source"]) == ["hotpotqa", "synth"]
    assert (found["eval_before"]["gold_hit_rate"], found["eval_after"]["gold_hit_rate"]) == (
        0.4, 0.6)
    assert found["eval_after"]["empty_rate"] is None  # not logged: n/a, never 0
    table = format_table({**summarize(rows, evals, None)})
    assert re.search(r"gold in passages\s+0\.300 -> 0\.500", table), table
    assert re.search(r"retrieval p50/p99 ms\s+30\.0 / 90\.0 -> 50\.0 / 90\.0", table), table
    page = retrieval_table(found)
    assert "<th>last 5 steps &middot; hotpotqa</th>" in page
    assert "gold answer in a passage" in page and "<td class=num>30.0%</td>" in page
    assert "<td class=num>60.0%</td>" in page  # held-out after
    assert "retrieval" not in summary_table(plain, [])  # its own section, not the summary


def test_played_reward_in_the_summary_only_with_the_group_filter() -> None:
    """With algorithm.filter_groups the train lines carry generated/* (every group played);
    the report shows that reward beside the kept batch's, and only then."""
    from services.launch.cli_report import format_table
    from services.launch.report_html import summary_table

    rows = [_train(step, 0.5, probe=False) for step in range(1, 8)]
    plain = summarize(rows, [], None)
    assert not any(key.startswith("played_") for key in plain)
    assert "played" not in format_table(plain) and "played" not in summary_table(plain, [])
    for step, row in enumerate(rows, start=1):
        row.update({"generated/reward/mean": 0.1 * step, "generated/em/mean": 0.05 * step})
    summary = summarize(rows, [], None)
    assert summary["reward_first"] == summary["reward_last"] == 0.5  # the kept batches'
    assert summary["played_reward_first"] == pytest.approx(0.3)  # steps 1..5
    assert summary["played_reward_last"] == pytest.approx(0.5)  # steps 3..7
    assert summary["played_em_last"] == pytest.approx(0.25)
    assert re.search(r"reward \(played\)\s+0\.300 -> 0\.500", format_table(summary))
    assert "played reward / EM" in summary_table(summary, [])


def test_sampled_evaluation_is_named_in_the_summary() -> None:
    """Eval lines of learner.eval_samples > 1: EM is mean@k, and pass@k sits beside it; a
    greedy run's report says greedy and shows no pass@k."""
    from services.launch.cli_report import format_table
    from services.launch.report_html import summary_table

    rows = [_train(step, 0.5, probe=False) for step in range(1, 4)]
    evals = [_eval(0, 0.25, 1.0, 1.0), _eval(3, 0.5, 1.2, 9.0)]
    plain = summarize(rows, evals, None)
    assert plain["eval_mode"] == "greedy" and plain["pass_after"] is None
    assert "held-out EM (greedy)" in summary_table(plain, evals)
    assert "pass@" not in format_table(plain)
    for row, hit in zip(evals, (0.5, 0.875), strict=True):
        row.update({"eval/samples_per_question": 4, "eval/temperature": 1.0,
                    "eval/pass@4": hit})
    summary = summarize(rows, evals, None)
    assert summary["eval_mode"] == "mean@4, temperature 1" and summary["eval_samples"] == 4
    assert (summary["pass_before"], summary["pass_after"]) == (0.5, 0.875)
    assert "held-out EM (mean@4, temperature 1), 95% CI" in summary_table(summary, evals)
    assert "held-out pass@4" in summary_table(summary, evals)
    assert re.search(r"pass@4 \(eval\)\s+0\.500 -> 0\.875", format_table(summary))
