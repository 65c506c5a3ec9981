"""A consumer SIGKILLed while holding messages: others reclaim them, none lost or acked twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import redis

from services.common.streams import RedisStreams

CHILD = Path(__file__).with_name("streams_child.py")
ROOT = Path(__file__).resolve().parents[2]


def test_killed_consumer_messages_are_reclaimed_exactly_once(redis_url, namespace):
    client = redis.Redis.from_url(redis_url)
    producer = RedisStreams(client, namespace)
    producer.ensure_group("rollouts")
    ids = producer.publish_many("rollouts", [f"traj-{i}".encode() for i in range(30)])

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), redis_url, namespace, "victim", "20", "5"],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    try:
        line = child.stdout.readline()
        assert line, "child consumer died before holding its messages"
        report = json.loads(line)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    held, acked_by_child = report["held"], report["acked"]
    assert len(held) == 15 and len(acked_by_child) == 5
    assert producer.pending("rollouts") == 15

    # Two survivors race for the rest; the dead one's messages become theirs after 0.5 s idle.
    results: dict[str, list] = {"s1": [], "s2": []}
    acked: dict[str, int] = {"s1": 0, "s2": 0}

    def survive(name: str) -> None:
        streams = RedisStreams(redis.Redis.from_url(redis_url), namespace, visibility_timeout_s=0.5)
        for _ in range(40):
            msgs = streams.consume("rollouts", name, count=4, block_ms=100)
            results[name] += msgs
            acked[name] += streams.ack("rollouts", [m.id for m in msgs])
            if streams.lag("rollouts") == 0:
                break
        streams.close()

    threads = [threading.Thread(target=survive, args=(n,)) for n in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = results["s1"] + results["s2"]
    got_ids = [m.id for m in got]
    assert len(got_ids) == len(set(got_ids)), "a message was delivered to both survivors"
    assert sorted(got_ids + acked_by_child) == sorted(ids)  # nothing lost
    assert acked["s1"] + acked["s2"] == 25  # every ack counted once
    reclaimed = {m.id: m.deliveries for m in got if m.id in held}
    assert set(reclaimed) == set(held) and set(reclaimed.values()) == {2}
    assert all(m.deliveries == 1 for m in got if m.id not in held)
    assert {m.payload for m in got if m.id in held} == {
        f"traj-{ids.index(i)}".encode() for i in held
    }
    assert producer.pending("rollouts") == 0 and producer.lag("rollouts") == 0
    assert producer.dead_letters() == []
    client.close()
