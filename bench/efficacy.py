"""Does the demo learn on any world? `forage demo` on several worlds in sequence.

    .venv/bin/python bench/efficacy.py [--seeds 1,2,3,4,5] [--out DIR] [--set key=value ...]
        [--busy] [--resume] [--table-only] [--readme]

For each seed: `forage demo --fresh --out OUT/seed-<s> --set data.seed=<s>` (a new synthetic
world, tokenizer, tiny policy, SFT warm start, RL, report), run as shipped: the thread variables
of the calling shell are removed so the demo's own thread policy decides. Seeds run one after
another, never at once (each would slow the other). With `--busy` a `while True: pass` process
runs beside every demo (started and stopped here), for the "graceful under load" measurement.

Per seed, from the demo's own files (report/summary.json, metrics.jsonl, sft/sft_result.json,
demo.json): held-out greedy EM before and after RL, overall and per data source; searches per
question before and after; the probe curve of correct trajectories at the 0% and 100% cuts
(averaged over every step that probed); what the warm start reached; wall time, and per phase
(world, policy, SFT, RL; from demo.json). Then the
target check (EM gain >= +30 points on every world, searches up, probe
rising from 0% to 100%, each demo <= 10 minutes) and, last line, `ratio: median gain / 30`.

`--readme` writes the table into bench/README.md between the efficacy markers. `--table-only`
rebuilds the table from OUT without running anything; `--resume` skips seeds whose demo
finished. About 10-15 minutes per seed on the 2-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.threads import without_thread_settings  # noqa: E402
from services.launch.report import has_probe, probe_curve, read_metrics  # noqa: E402

README = REPO / "bench" / "README.md"
BEGIN, END = "<!-- efficacy:begin -->", "<!-- efficacy:end -->"
TARGET_MEDIAN, TARGET_MIN, TARGET_WALL_S = 0.30, 0.30, 10 * 60


def clean_env() -> dict[str, str]:
    env = without_thread_settings(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_demo(seed: int, out: Path, overrides: list[str], busy: bool) -> float:
    """One `forage demo` to completion, its console in out/bench-console.log; wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    sets = [arg for item in [f"data.seed={seed}", *overrides] for arg in ("--set", item)]
    argv = [sys.executable, "-m", "services.cli", "demo", "--fresh", "--out", str(out), *sets]
    competitor = None
    if busy:
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    started = time.monotonic()
    try:
        with (out / "bench-console.log").open("w") as console:
            process = subprocess.Popen(argv, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            assert process.stdout is not None
            for line in process.stdout:
                console.write(line)
                console.flush()
                if line.startswith("[") or "warm start" in line or "EM change" in line:
                    print(f"  seed {seed}: {line.rstrip()}", flush=True)
            code = process.wait()
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    wall = time.monotonic() - started
    (out / "bench-run.json").write_text(json.dumps(
        {"seed": seed, "exit": code, "wall_s": wall, "busy": busy, "overrides": overrides}))
    if code != 0:
        print(f"  seed {seed}: forage demo exited {code}; console in {out}/bench-console.log",
              flush=True)
    return wall


def _at(curve: dict[str, Any] | None, split: str, fraction: float) -> float | None:
    if not curve or split not in curve:
        return None
    for f, value in zip(curve["fractions"], curve[split], strict=True):
        if abs(f - fraction) < 1e-9:
            return value
    return None


def seed_row(seed: int, out: Path) -> dict[str, Any] | None:
    """The table's figures for one finished demo, or None if it did not finish."""
    summary_path = out / "report" / "summary.json"
    run_path = out / "bench-run.json"
    if not summary_path.exists() or not run_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    run = json.loads(run_path.read_text())
    train, _evals = read_metrics(out / "metrics.jsonl")
    curve = probe_curve([row for row in train if has_probe(row)])
    warm: dict[str, Any] = {}
    result = out / "sft" / "sft_result.json"
    if result.exists():
        warm = json.loads(result.read_text())
    phases: dict[str, float] = {}
    demo = out / "demo.json"
    if demo.exists():
        phases = json.loads(demo.read_text()).get("phases") or {}
    return {
        "seed": seed,
        "exit": run.get("exit"),
        "busy": run.get("busy", False),
        "em_before": summary.get("em_before"),
        "em_after": summary.get("em_after"),
        "em_delta": summary.get("em_delta"),
        "by_source_before": summary.get("em_before_by_source") or {},
        "by_source_after": summary.get("em_after_by_source") or {},
        "searches_before": summary.get("searches_before"),
        "searches_after": summary.get("searches_after"),
        "probe_correct_0": _at(curve, "correct", 0.0),
        "probe_correct_100": _at(curve, "correct", 1.0),
        "warm_steps": warm.get("steps"),
        "warm_stopped": warm.get("stopped"),
        "warm_skills": warm.get("skills"),
        "wall_s": run.get("wall_s"),
        "phases_s": phases,
    }


# demo.json's phases, in the order the demo runs them, as the table names them.
PHASES = (("world_s", "world"), ("policy_s", "policy"), ("sft_s", "SFT"), ("rl_s", "RL"))


def wall_cell(wall_s: float | None, phases: dict[str, float]) -> str:
    """`11.2 min (world 0.4, policy 0.1, SFT 6.1, RL 4.5)`: where a demo's time went."""
    if wall_s is None:
        return "n/a"
    parts = [f"{label} {phases[key] / 60:.1f}" for key, label in PHASES if key in phases]
    return f"{wall_s / 60:.1f} min" + (f" ({', '.join(parts)})" if parts else "")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _short(source: str) -> str:
    return source.removeprefix("synth_")


def table(rows: list[dict[str, Any]]) -> list[str]:
    sources = sorted({s for r in rows for s in (*r["by_source_before"], *r["by_source_after"])})
    head = (["world (seed)", "EM before → after (gain)"]
            + [f"{_short(s)} before → after" for s in sources]
            + ["searches/question", "probe, correct: 0% → 100%", "warm start",
                  "wall (phases, min)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        gain = r["em_delta"]
        cells = [str(r["seed"]) + (" (busy)" if r["busy"] else ""),
                 f"{_pct(r['em_before'])} → {_pct(r['em_after'])} "
                 f"(**{'n/a' if gain is None else f'{100 * gain:+.1f}'}**)"]
        cells += [f"{_pct(r['by_source_before'].get(s))} → {_pct(r['by_source_after'].get(s))}"
                  for s in sources]
        cells.append(f"{_num(r['searches_before'])} → {_num(r['searches_after'])}")
        cells.append(f"{_num(r['probe_correct_0'])} → {_num(r['probe_correct_100'])}")
        skills = r["warm_skills"] or {}
        skill_text = ", ".join(f"{k} {v:.2f}" for k, v in skills.items())
        cells.append(f"{r['warm_steps']} steps, {r['warm_stopped']}"
                     + (f" ({skill_text})" if skill_text else "") if r["warm_steps"] else "n/a")
        cells.append(wall_cell(r["wall_s"], r.get("phases_s") or {}))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict(rows: list[dict[str, Any]]) -> tuple[list[str], float]:
    gains = [r["em_delta"] for r in rows if r["em_delta"] is not None]
    if not gains:
        return ["no finished demo"], 0.0
    median, least = statistics.median(gains), min(gains)
    searches_up = sum(1 for r in rows if None not in (r["searches_before"], r["searches_after"])
                      and r["searches_after"] > r["searches_before"])
    probe_up = sum(1 for r in rows if None not in (r["probe_correct_0"], r["probe_correct_100"])
                   and r["probe_correct_100"] > r["probe_correct_0"])
    walls = [r["wall_s"] for r in rows if r["wall_s"] is not None]
    checks = [
        (f"median EM gain {100 * median:+.1f} points (target ≥ +30)", median >= TARGET_MEDIAN),
        (f"minimum EM gain {100 * least:+.1f} points (target ≥ +30)", least >= TARGET_MIN),
        (f"searches per question up on {searches_up}/{len(rows)} worlds",
         searches_up == len(rows)),
        (f"probe curve of correct trajectories rising 0% → 100% on {probe_up}/{len(rows)}",
         probe_up == len(rows)),
        (f"longest demo {max(walls) / 60:.1f} min (target ≤ 10)" if walls else "no wall times",
         bool(walls) and max(walls) <= TARGET_WALL_S),
    ]
    return [f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in checks], median


def write_readme(lines: list[str]) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README}: the markers {BEGIN} / {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,4,5",
                        help="comma-separated world seeds (0 and 7 were used for tuning)")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "forage-efficacy"))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="passed to every demo")
    parser.add_argument("--busy", action="store_true",
                        help="one competing busy process beside every demo")
    parser.add_argument("--resume", action="store_true", help="skip seeds that finished")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table")
    parser.add_argument("--readme", action="store_true", help="write the table to bench/README.md")
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    root = Path(args.out)
    print(f"efficacy: seeds {seeds}, output {root}, load {load_average()}", flush=True)
    for seed in seeds:
        out = root / f"seed-{seed}"
        if args.table_only or (args.resume and seed_row(seed, out) is not None):
            continue
        if out.exists():
            shutil.rmtree(out)
        print(f"seed {seed}: forage demo (load {load_average()})", flush=True)
        wall = run_demo(seed, out, args.overrides, args.busy)
        print(f"seed {seed}: {wall / 60:.1f} min (load {load_average()})", flush=True)
    rows = [row for seed in seeds if (row := seed_row(seed, root / f"seed-{seed}")) is not None]
    missing = [s for s in seeds if s not in {r["seed"] for r in rows}]
    lines = table(rows)
    checks, median = verdict(rows)
    date = time.strftime("%Y-%m-%d")
    command = "bench/efficacy.py --seeds " + ",".join(map(str, seeds)) + "".join(
        f" --set {o}" for o in args.overrides) + (" --busy" if args.busy else "")
    block = [f"{date}, `.venv/bin/python {command}` (load after: {load_average()}):", "",
             *lines, "", *checks]
    if missing:
        block.append(f"- seeds without a finished demo: {missing}")
    print("\n".join(block))
    if args.readme:
        write_readme(block)
        print(f"table written to {README}")
    print(f"ratio: {median / TARGET_MEDIAN:.2f}  (median EM gain / 30 points)")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
