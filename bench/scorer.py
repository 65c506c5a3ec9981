"""math_verify throughput: the scorer's 2-worker process pool vs a serial loop in the main
process, over the same 2,000 items in the same run.

    .venv/bin/python bench/scorer.py [--items 2000] [--workers 2]

Prints items/s of both, the timeouts of each path (every one counted; none silent), how many
pool scores differ from the serial ones (must be 0), and last the ratio pool / serial.
"""

from __future__ import annotations

import argparse
import os
import random
import time


def make_items(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Math responses of a few hundred characters ending in a boxed answer; about half right."""
    rng = random.Random(seed)
    filler = ("We first rewrite the expression, then simplify both sides and check the "
              "boundary cases carefully. ")
    items = []
    for i in range(n):
        kind = i % 5
        a, b = rng.randint(1, 99), rng.randint(2, 30)
        right = rng.random() < 0.5
        if kind == 0:
            gold, answer = str(a), str(a if right else a + 1)
        elif kind == 1:
            gold, answer = f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}" if right else f"{a + 1}/{b}"
        elif kind == 2:
            gold = f"{a / 4:g}"
            answer = f"\\frac{{{a}}}{{4}}" if right else f"\\frac{{{a + 1}}}{{4}}"
        elif kind == 3:
            gold = f"{a}\\sqrt{{2}}"
            answer = f"\\sqrt{{{2 * a * a}}}" if right else f"\\sqrt{{{2 * a * a + 1}}}"
        else:
            gold, answer = f"x^2 + {2 * a}x + {a * a}", f"(x+{a})^2" if right else f"(x+{a})^3"
        text = filler * rng.randint(1, 4) + f"So the answer is $\\boxed{{{answer}}}$."
        items.append((text, gold))
    return items


def _cpu_seconds(pids: list[int]) -> float:
    """user + system CPU of running processes, from /proc (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()

    from services.scorer.pool import STATUS_OK, STATUS_TIMEOUT, Job, RewardPool
    from services.scorer.rewards.math import RewardTimeout, math_verify_reward, warm_up

    items = make_items(args.items)
    inner = max(1, int(args.timeout_s // 3))

    warm_up()
    serial: list[float] = []
    serial_timeouts = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    for text, gold in items:
        try:
            serial.append(math_verify_reward(text, gold, timeout_s=inner))
        except RewardTimeout:
            serial_timeouts += 1
            serial.append(0.0)
    serial_s = time.perf_counter() - started
    serial_cpu = time.process_time() - cpu_started

    pool_started = time.perf_counter()
    pool = RewardPool(num_workers=args.workers, timeout_s=args.timeout_s).start()
    startup_s = time.perf_counter() - pool_started
    try:
        jobs = [Job("services.scorer.rewards.functions:math_verify", ("synth_math", t, g, None),
                    {"timeout_s": inner}) for t, g in items]
        cpu_before = _cpu_seconds(pool.pids)
        started = time.perf_counter()
        results = pool.run(jobs)
        pool_s = time.perf_counter() - started
        pool_cpu = _cpu_seconds(pool.pids) - cpu_before
    finally:
        pool.close()
    pool_scores = [r.value if r.status == STATUS_OK else 0.0 for r in results]
    pool_timeouts = sum(r.status == STATUS_TIMEOUT for r in results)
    errors = sum(r.status not in (STATUS_OK, STATUS_TIMEOUT) for r in results)
    mismatches = sum(a != b for a, b in zip(serial, pool_scores, strict=True))

    print(f"items: {len(items)}  correct (serial): {int(sum(serial))}")
    print(f"serial (main process): {len(items) / serial_s:8.1f} items/s  ({serial_s:.2f} s), "
          f"timeouts {serial_timeouts}")
    print(f"pool ({args.workers} processes):   {len(items) / pool_s:8.1f} items/s  "
          f"({pool_s:.2f} s, + {startup_s:.2f} s start-up), timeouts {pool_timeouts}, "
          f"errors {errors}, restarts {pool.restarts}")
    # On a shared machine the wall ratio mostly measures the neighbours; CPU seconds show
    # what the pool costs per item (its overhead), whatever the load.
    print(f"CPU seconds: serial {serial_cpu:.2f}, pool workers {pool_cpu:.2f}; "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"pool scores differing from serial: {mismatches}")
    print(f"ratio: {serial_s / pool_s:.2f}")


if __name__ == "__main__":
    main()
