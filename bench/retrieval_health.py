"""Retrieval-health overhead: what the telemetry costs beside the work a step already does on the
same data, in the same run (services/common/retrieval_health.py; docs/learner.md).

    .venv/bin/python bench/retrieval_health.py [--trajectories 256] [--turns 3] [--topk 3]

Two places pay for it, each measured against work already done there on the same data:

- the rollout, per search turn: `turn_retrieval` (count passages and empty ones, normalise each
  passage once and look for the gold answers) against tokenizing that turn's observation, which
  the agent loop does for every search (a byte-level BPE trained here on the same passages,
  Hugging Face `tokenizers`, the fast tokenizers' library; real vocabularies cost about the same
  per character);
- the learner, per step: `health_metrics` over the step's trajectories against decoding them
  from the scored stream (the codec, which the learner runs on every trajectory).

Passages are Search-R1-sized (about 100 words, a quoted title line), a tenth of them hold the
gold answer, trajectories are 200 prompt + about 1,200 response tokens. Prints the time per
item of each side and the ratios telemetry / baseline; the last line is the step's total ratio
(telemetry on both sides over observation tokenization + codec encode + decode).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.codec import decode, encode  # noqa: E402
from services.common.formats import information_block  # noqa: E402
from services.common.retrieval_health import golds_of, health_metrics, turn_retrieval  # noqa: E402
from services.common.trajectory import ScoredTrajectory, Trajectory, Turn  # noqa: E402

WORDS = ("river castle founded born company city museum island war treaty king queen league "
         "album film river village railway station bridge tower abbey school parish county "
         "season player team coach election party minister council harbour").split()
REPEATS = 5  # each measurement is the best of REPEATS (least disturbed by other processes)


def passage(rng: random.Random, gold: str | None) -> str:
    title = " ".join(rng.choice(WORDS).title() for _ in range(2))
    words = [rng.choice(WORDS) for _ in range(100)]
    if gold is not None:
        words.insert(rng.randrange(len(words)), gold)
    return f'"{title}"\n' + " ".join(words) + "."


def make_step(n: int, turns: int, topk: int, seed: int = 0
              ) -> tuple[list[list[list[dict]]], list[dict], list[Trajectory]]:
    """Per trajectory: its search results (turns x topk /retrieve items), its ground truth,
    and the trajectory record its searches produce (ids, queries; tokens of realistic size)."""
    rng = random.Random(seed)
    results, truths, trajectories = [], [], []
    for t in range(n):
        gold = f"Zel{t}vik"
        truths.append({"target": [gold, f"{gold} city"]})
        per_turn = [[{"document": {"id": str(rng.randrange(10 ** 6)),
                                   "contents": passage(rng, gold if rng.random() < 0.1 else None)},
                      "score": rng.random()} for _ in range(topk)] for _ in range(turns)]
        results.append(per_turn)
        response = [rng.randrange(32_000) for _ in range(1200)]
        step = len(response) // (turns + 1)
        turn_list = [Turn(i * step, i * step + 40, "search", f"query {t} {i % 2}",
                          docs=[{"id": item["document"]["id"], "title": "t"} for item in docs])
                     for i, docs in enumerate(per_turn)]
        turn_list.append(Turn(turns * step, len(response), "answer", gold))
        trajectories.append(Trajectory(
            uid=f"u{t // 4}", sample_id=f"u{t // 4}:0:{t % 4}",
            data_source=("nq", "hotpotqa")[t % 2], policy_version=3,
            prompt_ids=[rng.randrange(32_000) for _ in range(200)], response_ids=response,
            loss_mask=[1] * len(response), rollout_logprobs=[-1.0] * len(response),
            turns=turn_list, num_searches=turns, ground_truth=truths[-1]))
    return results, truths, trajectories


def best(action: Callable[[], object]) -> float:
    """Seconds of the fastest of REPEATS runs of `action`."""
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, show_progress=False))
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3, help="search turns per trajectory")
    parser.add_argument("--topk", type=int, default=3)
    args = parser.parse_args()

    results, truths, trajectories = make_step(args.trajectories, args.turns, args.topk)
    searches = [(docs, truth) for per_turn, truth in zip(results, truths, strict=True)
                for docs in per_turn]
    observations = [information_block(docs) for docs, _ in searches]
    tokenizer = train_tokenizer(observations)

    # Rollout side: per search turn (the gold answers are read once per trajectory).
    def telemetry() -> None:
        for per_turn, truth in zip(results, truths, strict=True):
            golds = golds_of(truth)
            for docs in per_turn:
                turn_retrieval(docs, golds, 1.0, False)

    def tokenize() -> None:
        for text in observations:
            tokenizer.encode(text, add_special_tokens=False)

    turn_telemetry, turn_tokenize = best(telemetry), best(tokenize)

    # Learner side: per step. The turns carry their retrieval as the rollout recorded it.
    for trajectory, per_turn, truth in zip(trajectories, results, truths, strict=True):
        golds = golds_of(truth)
        for turn, docs in zip(trajectory.turns, per_turn, strict=False):
            turn.retrieval = turn_retrieval(docs, golds, random.uniform(5, 50), False)
    payloads = [encode(ScoredTrajectory(t, 1.0)) for t in trajectories]
    step_metrics = best(lambda: health_metrics(trajectories))
    step_decode = best(lambda: [decode(p) for p in payloads])
    step_encode = best(lambda: [encode(ScoredTrajectory(t, 1.0)) for t in trajectories])

    n_turns, n_traj = len(searches), len(trajectories)
    print(f"step: {n_traj} trajectories x {args.turns} search turns x top-{args.topk} passages "
          f"({statistics.mean(len(o) for o in observations):.0f} characters per observation); "
          f"best of {REPEATS}")
    print(f"rollout, per search turn: telemetry {1e6 * turn_telemetry / n_turns:.1f} us, "
          f"tokenizing its observation {1e6 * turn_tokenize / n_turns:.1f} us, "
          f"ratio {turn_telemetry / turn_tokenize:.3f}")
    print(f"learner, per step: health_metrics {1e3 * step_metrics:.2f} ms, codec decode "
          f"{1e3 * step_decode:.2f} ms, ratio {step_metrics / step_decode:.3f}")
    metrics = health_metrics(trajectories)
    print(f"  (gold hit rate {metrics['retrieval/gold_hit_rate']:.3f}, "
          f"{len(metrics)} metrics)")
    total = turn_telemetry + step_metrics
    baseline = turn_tokenize + step_encode + step_decode
    print(f"step total: telemetry {1e3 * total:.2f} ms vs tokenize + encode + decode "
          f"{1e3 * baseline:.2f} ms: ratio {total / baseline:.3f}")


if __name__ == "__main__":
    main()
