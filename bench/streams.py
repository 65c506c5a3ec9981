"""Streams throughput and codec speed for realistic trajectories.

1. Trajectories/s through publish → consume → ack with `RedisStreams` (backpressure check,
   reclaim scan, delivery counts included) against a bare redis-py loop doing only
   XADD / XREADGROUP / XACK on the same payloads, same Redis, same run.
2. The codec's encode+decode of one 2k-token trajectory against pickle.dumps+loads of the same
   record (pickle only as the baseline here: it never crosses a process in Forage).

The LAST line is the codec ratio pickle_time / codec_time (target >= 0.5: the codec at most 2x
slower than pickle).

    .venv/bin/python bench/streams.py [--count 2000] [--batch 64] [--response-tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.codec import decode, encode  # noqa: E402
from services.common.redis_server import ensure_redis  # noqa: E402
from services.common.streams import RedisStreams  # noqa: E402
from services.common.trajectory import Trajectory, Turn  # noqa: E402


def trajectory(rng: np.random.Generator, index: int, prompt_tokens: int, response: int) -> Trajectory:
    """A Search-R1-like trajectory: 3 search turns with observations, then an answer."""
    mask = np.ones(response, dtype=np.uint8)
    turns = []
    cut = response // 4
    for turn in range(4):
        start, end = turn * cut, (turn + 1) * cut
        if turn < 3:
            mask[end - cut // 3 : end] = 0  # the observation tokens of this turn
            turns.append(Turn(start, end - cut // 3, "search", f"who founded city {index}?", 3))
        else:
            turns.append(Turn(start, response, "answer", None, 3))
    logprobs = np.where(mask == 1, rng.normal(-1.0, 0.5, response), 0.0)
    return Trajectory(
        uid=f"group-{index // 8}",
        sample_id=f"group-{index // 8}-{index % 8}-{uuid.uuid4().hex[:8]}",
        data_source="nq",
        policy_version=3,
        prompt_ids=rng.integers(0, 151_000, prompt_tokens),
        response_ids=rng.integers(0, 151_000, response),
        loss_mask=mask,
        rollout_logprobs=logprobs,
        turns=turns,
        finish_reason="answer",
        num_searches=3,
        ground_truth={"target": ["Paris", "City of Light"]},
        extra={"index": index, "split": "train", "question": "Which city is the capital?"},
    )


def through_library(url: str, payloads: list[bytes], batch: int) -> float:
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    streams = RedisStreams(client, ns, stream_maxlen=max(4 * batch, 1000))
    streams.ensure_group("rollouts")
    try:
        started = time.perf_counter()
        done = 0
        for start in range(0, len(payloads), batch):
            streams.publish_many("rollouts", payloads[start : start + batch])
            messages = streams.consume("rollouts", "bench", count=batch, block_ms=1000)
            done += streams.ack("rollouts", [m.id for m in messages])
        elapsed = time.perf_counter() - started
        assert done == len(payloads), (done, len(payloads))
        return len(payloads) / elapsed
    finally:
        client.delete(*(f"{ns}:{k}" for k in ("prompts", "rollouts", "scored", "dead")))
        client.close()


def through_raw(url: str, payloads: list[bytes], batch: int) -> float:
    key = f"bench-raw-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    client.xgroup_create(key, "g", id="0", mkstream=True)
    try:
        started = time.perf_counter()
        done = 0
        for start in range(0, len(payloads), batch):
            pipe = client.pipeline(transaction=False)
            for payload in payloads[start : start + batch]:
                pipe.xadd(key, {"payload": payload})
            pipe.execute()
            reply = client.xreadgroup("g", "bench", {key: ">"}, count=batch, block=1000)
            ids = [entry_id for _, entries in reply for entry_id, _ in entries]
            done += client.xack(key, "g", *ids)
        elapsed = time.perf_counter() - started
        assert done == len(payloads)
        return len(payloads) / elapsed
    finally:
        client.delete(key)
        client.close()


def per_call(fn, record, repeats: int, rounds: int) -> float:
    """Median over rounds of the mean seconds per call."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            fn(record)
        times.append((time.perf_counter() - started) / repeats)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="trajectories through streams")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=2048)
    parser.add_argument("--codec-repeats", type=int, default=300)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    records = [trajectory(rng, i, args.prompt_tokens, args.response_tokens)
               for i in range(min(args.count, 256))]
    payloads = [encode(records[i % len(records)]) for i in range(args.count)]
    size = statistics.mean(len(p) for p in payloads)
    print(f"payload: {args.prompt_tokens}+{args.response_tokens} tokens, {size / 1024:.1f} KiB "
          f"msgpack; {args.count} trajectories in batches of {args.batch}")

    server = ensure_redis(os.environ.get("REDIS_URL"), allow_embedded=True)
    try:
        info = redis.Redis.from_url(server.url).info("server")
        print(f"redis {info['redis_version']} at {server.url}"
              f"{' (embedded)' if server.embedded else ''}")
        through_raw(server.url, payloads[: args.batch * 2], args.batch)  # warm-up
        lib, raw = [], []
        for _ in range(3):  # alternate so load drift hits both
            raw.append(through_raw(server.url, payloads, args.batch))
            lib.append(through_library(server.url, payloads, args.batch))
        lib_rate, raw_rate = max(lib), max(raw)
    finally:
        server.stop()
    print(f"streams: RedisStreams {lib_rate:,.0f} traj/s ({lib_rate * size / 2**20:,.1f} MiB/s), "
          f"bare redis-py {raw_rate:,.0f} traj/s; library/bare = {lib_rate / raw_rate:.2f}")

    record = records[0]

    def codec_round(r: Trajectory) -> Trajectory:
        return decode(encode(r))

    def pickle_round(r: Trajectory) -> Trajectory:
        return pickle.loads(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL))

    assert np.array_equal(codec_round(record).response_ids, record.response_ids)
    codec_s = per_call(codec_round, record, args.codec_repeats, 7)
    pickle_s = per_call(pickle_round, record, args.codec_repeats, 7)
    pickled = len(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
    print(f"codec encode+decode {codec_s * 1e6:.1f} us ({len(encode(record))} B), "
          f"pickle dumps+loads {pickle_s * 1e6:.1f} us ({pickled} B)")
    print(f"ratio: {pickle_s / codec_s:.2f}")


if __name__ == "__main__":
    main()
