"""The report a researcher reads: smoothing, Wilson intervals, per-source and RL-health panels,
the probe heatmap, titles with the run's settings, a wall-clock axis, and report/index.html
opened in a real headless Chromium (rendered, images loaded, no console errors).

The metrics come from tests/launch/data/metrics_real.jsonl, six lines a real learner wrote
(tests/learner/test_samples.py; FORAGE_KEEP_METRICS=PATH refreshes it): a longer synthetic run
is made from its train and eval lines, so every key the plots read is one the loop writes.
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.launch.report import (
    eval_ci,
    load_metrics,
    probe_matrix,
    run_title,
    smooth,
    wilson_interval,
    write_report,
)
from tests.browser import launch, needs_chromium, watched_page
from tests.suite_rules import import_or_skip

REAL = Path(__file__).with_name("data") / "metrics_real.jsonl"
FORAGE = Path(sys.executable).with_name("forage")
STEPS = 40
SOURCES = {"synth_single": 80, "synth_multihop": 60}  # eval n per source: 140 in all


def real_lines() -> tuple[dict, dict]:
    rows = [json.loads(line) for line in REAL.read_text().splitlines()]
    train = next(r for r in rows if r["kind"] == "train")
    evals = next(r for r in rows if r["kind"] == "eval")
    return train, evals


def synthetic_run(run_dir: Path, steps: int = STEPS, seed: int = 0) -> None:
    """A run in the loop's format: the real lines' keys, values that trend and jitter."""
    train_template, eval_template = real_lines()
    rng = random.Random(seed)
    lines = []
    for step in range(steps + 1):
        if step % 20 == 0:
            row = dict(eval_template, step=step, policy_version=step + 1,
                       elapsed_s=30.0 * step + 5)
            total = 0.0
            for source, n in SOURCES.items():
                em = round((0.2 + step / 100 + (0.1 if source == "synth_single" else 0)) * n) / n
                row[f"eval/em/{source}"], row[f"eval/n/{source}"] = em, n
                row[f"eval/reward/{source}/mean"] = em
                total += em * n
            row["eval/n"] = sum(SOURCES.values())
            row["eval/em"] = row["eval/em/mean"] = total / row["eval/n"]
            lines.append(row)
        if step == 0:
            continue
        row = dict(train_template, step=step, policy_version=step + 1,
                   elapsed_s=30.0 * step, time=1.7e9 + 30 * step)
        for key, value in train_template.items():
            counted = "/n_" in key or key.startswith(("groups/", "throughput/trajectories"))
            if isinstance(value, float) and key not in ("time", "elapsed_s") and not counted:
                row[key] = value * (1 + 0.3 * rng.uniform(-1, 1)) + 0.01 * step
                if "/score_at_" in key or "_rate" in key:
                    row[key] = min(1.0, max(0.0, row[key]))
        row["reward/mean"] = min(1.0, 0.2 + step / 80 + rng.uniform(-0.15, 0.15))
        for source in SOURCES:
            row[f"em/{source}"] = min(1.0, 0.15 + step / 90 + rng.uniform(-0.2, 0.2))
            row[f"reward/{source}/mean"] = row[f"em/{source}"]
        if step % 3 == 0:  # the probe ran on some steps only (probe.every_k_versions)
            for key in [k for k in row if k.startswith("probe_")]:
                del row[key]
        lines.append(row)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = {"run_id": "html-test", "learner": {"adv_estimator": "grpo", "lr": 1e-4,
                                                 "train_batch_size": 8, "max_staleness": 1,
                                                 "total_steps": steps},
              "data": {"n_samples": 4}, "probe": {"enable": True},
              "redis": {"url": "redis://:hunter2@127.0.0.1:6379/0"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def write_samples(run_dir: Path, policy: Path) -> None:
    """samples.jsonl through the learner's own writer, with a question that is markup."""
    from transformers import AutoTokenizer

    from services.common.trajectory import ScoredTrajectory, Trajectory, Turn
    from services.learner.samples import SampleLog

    tokenizer = AutoTokenizer.from_pretrained(str(policy))

    def item(uid: str, answer: str, kind: str) -> ScoredTrajectory:
        search = tokenizer.encode("<search> Mekar </search>", add_special_tokens=False)
        final = tokenizer.encode(f"<answer> {answer} </answer>", add_special_tokens=False)
        response = search + final
        traj = Trajectory(uid=uid, sample_id=f"{uid}:0:0", data_source="synth_multihop",
                          policy_version=9, prompt_ids=[1], response_ids=response,
                          loss_mask=[1] * len(response), rollout_logprobs=[-1.0] * len(response),
                          turns=[Turn(0, len(search), "search", "Mekar", 9,
                                      docs=[{"id": "154", "title": "Mekar Stebrul"}]),
                                 Turn(len(search), len(response), "answer", answer, 9)],
                          num_searches=1, ground_truth={"target": ["Zikax"]}, kind=kind,
                          extra={"question": "Where was <b>Mekar</b> born? <script>x()</script>"})
        reward = float(answer == "Zikax")
        return ScoredTrajectory(traj, reward, {"em": reward})

    log = SampleLog(run_dir, tokenizer, n=3)
    log.write([item("e1", "Zikax", "eval"), item("e2", "Pigir", "eval")], STEPS, "eval")
    log.write([item("t1", "Pigir", "train")], STEPS, "train")


# ---------------------------------------------------------------- the statistics


def test_smoothing_is_tensorboards_debiased_ema():
    assert smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # no pull to 0
    assert smooth([0.0, 1.0], 0.0) == [0.0, 1.0]
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])
    with pytest.raises(ValueError):
        smooth([1.0], 1.0)


def test_wilson_interval_matches_the_formula_and_the_issue_figure():
    low, high = wilson_interval(0.3, 140)
    # Wilson 1927 by hand: centre (p + z^2/2n)/(1 + z^2/n), half-width as below.
    z, n, p = 1.96, 140, 0.3
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (low, high) == pytest.approx((centre - half, centre + half))
    assert 0.07 < (high - low) / 2 < 0.08  # about +-7.5 points at 30% of 140
    assert wilson_interval(0.0, 140)[0] == 0.0 and wilson_interval(1.0, 140)[1] == 1.0
    assert wilson_interval(0.5, 0) == (0.0, 1.0)


def test_eval_ci_probe_matrix_and_title(tmp_path):
    synthetic_run(tmp_path)
    parsed = load_metrics(tmp_path / "metrics.jsonl")
    em, low, high, n = eval_ci(parsed.eval[-1])
    assert n == 140 and low < em < high
    assert eval_ci(parsed.eval[-1], "synth_multihop")[3] == 60
    assert eval_ci({"eval/em": 0.5}) is None  # no n, no interval
    matrix = probe_matrix(parsed.train, "all")
    assert matrix["fractions"] == [0.0, 0.5, 1.0]
    assert len(matrix["steps"]) == STEPS - STEPS // 3 and 3.0 not in matrix["steps"]
    template, _ = real_lines()
    expected_n = int(template["probe_all/n_correct"] + template["probe_all/n_incorrect"])
    assert set(matrix["n"]) == {expected_n}
    assert len(matrix["accuracy"]) == 3 and len(matrix["accuracy"][0]) == len(matrix["steps"])
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert run_title(tmp_path, config) == \
        "html-test | grpo, lr 1e-04, 8 groups x 4, staleness 1, 40 steps"
    assert run_title(tmp_path, None) == tmp_path.name


def test_report_writes_every_plot_and_the_page(tmp_path, tiny_policy_dir):
    run = tmp_path / "run"
    synthetic_run(run)
    write_samples(run, tiny_policy_dir)
    summary = write_report(run)
    out = run / "report"
    assert summary["files"][-1] == "index.html"
    for name in ("reward_em.png", "per_source.png", "rl_health.png", "probe_heatmap.png",
                 "retrieval.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (out / name).stat().st_size > 20_000, name
    assert summary["title"].startswith("html-test | grpo")
    assert summary["em_after_ci"][0] < summary["em_after"] < summary["em_after_ci"][1]
    page = (out / "index.html").read_text()
    assert "n=140" in page and "html-test | grpo" in page
    assert "<script>" not in page and "&lt;script&gt;x()&lt;/script&gt;" in page  # escaped
    assert "Mekar Stebrul" in page and "adv_estimator: grpo" in page
    assert "hunter2" not in page and "redis://:***@127.0.0.1" in page  # a shareable page
    assert "quick-note" not in page
    # retrieval health from the real learner's keys: a table with the source's column
    assert "<h2>Retrieval health</h2><table id=retrieval>" in page
    assert "last 5 steps &middot; synth_single" in page and "gold answer in a passage" in page
    wall = write_report(run, tmp_path / "wall", x_axis="wall", smoothing=0.0)
    assert (tmp_path / "wall" / "reward_em.png").stat().st_size > 10_000
    assert wall["files"] == summary["files"]


def test_cli_options_and_quick_note(tmp_path):
    run = tmp_path / "run"
    synthetic_run(run, steps=4)
    (run / "demo.json").write_text(json.dumps({"wall_seconds": 99.0, "quick": True}))
    result = subprocess.run([str(FORAGE), "report", str(run), "--x", "wall", "--smoothing",
                             "0.3"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "EM 95% CI" in result.stdout and "n = 140" in result.stdout
    assert "does not learn" in result.stdout
    assert re.search(r"gold in passages\s+[01]\.\d{3} -> [01]\.\d{3}", result.stdout), result.stdout
    assert str(run / "report" / "index.html") in result.stdout
    assert 'id=quick-note' in (run / "report" / "index.html").read_text()
    bad = subprocess.run([str(FORAGE), "report", str(run), "--smoothing", "1.5"],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and "smoothing must be in [0, 1), got 1.5" in bad.stderr


def test_demo_summary_says_quick_does_not_learn(tmp_path, capsys):
    from services.launch.demo import print_summary

    summary = {"em_before": 0.0, "em_after": 0.0, "em_delta": 0.0, "steps": 4,
               "wall_seconds": 100.0}
    print_summary(summary, tmp_path, quick=True)
    quick = capsys.readouterr().out
    assert "checks the plumbing at toy size" in quick and "does not learn" in quick
    print_summary(summary, tmp_path, quick=False)
    assert "does not learn" not in capsys.readouterr().out


# ---------------------------------------------------------------- a real browser


@needs_chromium
def test_index_html_renders_in_headless_chromium(tmp_path, tiny_policy_dir):
    playwright = import_or_skip("playwright.sync_api", "playwright (dev extra) drives the browser")
    from PIL import Image

    run = tmp_path / "run"
    synthetic_run(run)
    write_samples(run, tiny_policy_dir)
    write_report(run)
    page_path = run / "report" / "index.html"
    problems: list[str] = []
    with playwright.sync_playwright() as driver:
        browser = launch(driver)
        page = watched_page(browser, problems, "file://")
        page.goto(page_path.as_uri(), wait_until="load")
        images = page.eval_on_selector_all(
            "img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
        heading = page.inner_text("h1")
        summary_text = page.inner_text("#summary")
        retrieval_text = page.inner_text("#retrieval")
        samples_open = page.eval_on_selector_all("details[open]", "d => d.length")
        shot = tmp_path / "page.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert problems == []
    assert len(images) == 8 and all(done and width > 300 for _, done, width in images), images
    assert "gold answer in a passage" in retrieval_text and "latency p99 (ms)" in retrieval_text
    assert heading.startswith("html-test | grpo")
    assert "n=140" in summary_text and "EM change" in summary_text
    assert samples_open == 1
    picture = Image.open(shot).convert("RGB")
    assert picture.width == 1280 and picture.height > 2000  # the whole page, plots included
    colours = picture.resize((320, picture.height // 4)).getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200  # plots and text, not a blank page
