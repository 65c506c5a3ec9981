"""A consumer for test_streams_kill: takes messages, acks some, then waits to be SIGKILLed.

Usage: streams_child.py REDIS_URL NAMESPACE CONSUMER TAKE ACK
Prints one JSON line {"held": [...ids...], "acked": [...ids...]} once it holds its messages.
"""

from __future__ import annotations

import json
import sys
import time

import redis

from services.common.streams import RedisStreams


def main() -> None:
    url, namespace, consumer, take, ack = sys.argv[1:6]
    streams = RedisStreams(redis.Redis.from_url(url), namespace, visibility_timeout_s=60)
    held = []
    deadline = time.monotonic() + 30
    while len(held) < int(take) and time.monotonic() < deadline:
        held += streams.consume("rollouts", consumer, count=int(take) - len(held), block_ms=200)
    acked = [m.id for m in held[: int(ack)]]
    assert streams.ack("rollouts", acked) == len(acked)
    print(json.dumps({"held": [m.id for m in held[int(ack):]], "acked": acked}), flush=True)
    time.sleep(600)  # "working": the test kills us here


if __name__ == "__main__":
    main()
