"""Pipeline throughput: RL steps per minute with max_staleness 1 (async) vs 0 (synchronous).

Both runs use the demo config (configs/demo.yaml, or --quick's), the same world, SFT policy and
seed, and run the whole system as `forage up` does (retriever, learner, scorer, one rollout
replica on loopback). Evaluation is off; the rate is taken between the first and the last step
line of each run, so process start-up is excluded. With max_staleness 1 the rollout generates
the next batch while the learner trains this one; with 0 they take turns.

    .venv/bin/python bench/pipeline.py                  # demo size, 8 steps each
    .venv/bin/python bench/pipeline.py --steps 6 --out runs/bench-pipeline

World and SFT policy are built once under --out (reused on later runs). The last line is
`ratio: async_steps_per_min / sync_steps_per_min` (target >= 1.5 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def steps_per_minute(metrics: Path) -> tuple[float, int]:
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [m for m in lines if m.get("kind") == "train"]
    if len(train) < 2:
        raise SystemExit(f"{metrics}: fewer than 2 steps; see the logs next to it")
    span = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    return 60.0 * (len(train) - 1) / max(span, 1e-9), len(train)


def run(out: Path, staleness: int, steps: int, quick: bool, seed: int,
        extra: list[str]) -> float:
    from services.common.config import load_config
    from services.launch.demo import DEMO_CONFIG, QUICK_CONFIG, prepare, rl_overrides
    from services.launch.up import run_up

    config_file = QUICK_CONFIG if quick else DEMO_CONFIG
    base = [f"data.seed={seed}"]
    cfg = load_config(config_file, base)
    _, policy = prepare(cfg, config_file, base, out)
    run_dir = out / f"staleness{staleness}"
    overrides = [*base, *rl_overrides(out, policy), f"run_dir={run_dir}",
                 f"learner.checkpoint_dir={run_dir / 'checkpoints'}",
                 f"learner.max_staleness={staleness}", f"learner.total_steps={steps}",
                 "learner.eval_before=false", "learner.eval_at_end=false",
                 f"learner.save_every={steps}",
                 f"redis.namespace=bench-pipeline-{staleness}-{time.time_ns()}", *extra]
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    code = run_up(load_config(config_file, overrides))
    if code != 0:
        raise SystemExit(f"max_staleness={staleness}: run failed ({code}); logs in {run_dir}")
    rate, count = steps_per_minute(run_dir / "metrics.jsonl")
    print(f"max_staleness={staleness}: {rate:.2f} steps/min over {count} steps", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench-pipeline")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="the quick demo config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key in both runs")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    sync = run(out, 0, args.steps, args.quick, args.seed, args.overrides)
    overlapped = run(out, 1, args.steps, args.quick, args.seed, args.overrides)
    print(f"sync {sync:.2f} steps/min, async {overlapped:.2f} steps/min")
    print(f"ratio: {overlapped / sync:.2f}")


if __name__ == "__main__":
    main()
