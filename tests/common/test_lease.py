"""Leases: work longer than the visibility timeout is not reclaimed and done twice (issue 14,
item 8). Streams-level tests with a second consumer reclaiming, then the two services that
hold messages while they work (`forage scorer serve`, `forage rollout serve`) as real
processes, two of each, on a real Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import yaml

from services.common.codec import decode_as, encode
from services.common.streams import RedisStreams, lease_interval
from services.common.streams_async import AsyncRedisStreams
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory

ROOT = Path(__file__).resolve().parents[2]
VT = 1.0  # visibility timeout of these tests; the work takes 3x as long


@pytest.fixture()
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_a_leased_message_is_not_reclaimed_while_its_work_takes_3x_the_timeout(
        client, redis_url, namespace):
    s = RedisStreams(client, namespace, visibility_timeout_s=VT)
    s.ensure_group("rollouts")
    s.publish("rollouts", b"slow work")
    [message] = s.consume("rollouts", "worker", count=1, block_ms=50)
    stolen: list[str] = []
    stop = threading.Event()

    def thief() -> None:  # a second consumer polling as a service does
        other = RedisStreams(redis.Redis.from_url(redis_url), namespace, visibility_timeout_s=VT)
        while not stop.is_set():
            stolen.extend(m.id for m in other.consume("rollouts", "thief", count=1, block_ms=50))
        other.close()

    thread = threading.Thread(target=thief)
    thread.start()
    try:
        with s.lease("rollouts", "worker", [message.id]) as lease:
            time.sleep(3 * VT)  # the work
            assert lease.renewals >= 5 and not lease.lost
            assert s.ack("rollouts", [message.id]) == 1
            lease.release([message.id])
    finally:
        stop.set()
        thread.join()
    assert stolen == []
    assert s.pending("rollouts") == 0


def test_ids_added_to_a_lease_are_kept_too(client, redis_url, namespace):
    """A replica that takes new groups while it works on others adds them to its lease
    (Lease.add): they are renewed like the first ones, never reclaimed mid-work."""
    s = RedisStreams(client, namespace, visibility_timeout_s=VT)
    s.ensure_group("prompts")
    s.publish_many("prompts", [b"first", b"taken later"])
    [first] = s.consume("prompts", "worker", count=1, block_ms=50)
    other = RedisStreams(redis.Redis.from_url(redis_url), namespace, visibility_timeout_s=VT)
    stolen: list[str] = []
    try:
        with s.lease("prompts", "worker", [first.id]) as lease:
            time.sleep(VT / 2)
            [later] = s.consume("prompts", "worker", count=1, block_ms=50)
            lease.add([later.id, first.id])  # a repeat id is held once
            deadline = time.monotonic() + 3 * VT
            while time.monotonic() < deadline:
                stolen.extend(m.id for m in other.consume("prompts", "thief", count=1,
                                                          block_ms=50))
            assert lease.ids == [first.id, later.id] and not lease.lost
            assert s.ack("prompts", [first.id, later.id]) == 2
    finally:
        other.close()
    assert stolen == []


def test_without_the_lease_the_same_work_is_reclaimed(client, namespace):
    """The control: what the lease prevents does happen without it."""
    s = RedisStreams(client, namespace, visibility_timeout_s=VT)
    s.ensure_group("rollouts")
    s.publish("rollouts", b"slow work")
    [message] = s.consume("rollouts", "worker", count=1, block_ms=50)
    with s.lease("rollouts", "worker", [message.id]):
        time.sleep(1.5 * VT)
    assert s.consume("rollouts", "thief", count=1, block_ms=1) == []  # renewed up to the stop
    time.sleep(VT + 0.1)
    [again] = s.consume("rollouts", "thief", count=1, block_ms=1)
    assert again.id == message.id and again.deliveries == 2


def test_renewal_never_takes_a_reclaimed_message_back(client, namespace):
    s = RedisStreams(client, namespace, visibility_timeout_s=0.2)
    s.ensure_group("prompts")
    s.publish("prompts", b"x")
    [message] = s.consume("prompts", "stalled", count=1, block_ms=50)
    time.sleep(0.3)  # the first consumer stalled past the timeout
    [taken] = s.consume("prompts", "rescuer", count=1, block_ms=1)
    assert taken.id == message.id
    assert s.keep_alive("prompts", "stalled", [message.id]) == 0
    assert s.renew("prompts", "stalled", [message.id]) == ([], [message.id])
    owner = s.client.xpending_range(s.key("prompts"), "rollout", "-", "+", 10)
    assert [o["consumer"] for o in owner] == [b"rescuer"]
    lease = s.lease("prompts", "stalled", [message.id], interval_s=0.05)
    time.sleep(0.2)
    lease.stop()
    assert lease.lost == {message.id} and lease.ids == []
    assert s.ack("prompts", [message.id]) == 1
    assert s.renew("prompts", "rescuer", [message.id]) == ([], [])  # acked: in neither list


def test_lease_interval_is_a_third_of_the_timeout():
    assert lease_interval(120.0) == 40.0
    assert lease_interval(0.0) == 0.05


def test_async_lease_keeps_a_message(redis_url, namespace):
    async def body() -> None:
        s = AsyncRedisStreams(aioredis.Redis.from_url(redis_url), namespace,
                              visibility_timeout_s=0.5)
        await s.ensure_group("rollouts")
        await s.publish("rollouts", b"slow")
        [message] = await s.consume("rollouts", "worker", count=1, block_ms=50)
        async with s.lease("rollouts", "worker", [message.id]) as lease:
            for _ in range(6):
                await asyncio.sleep(0.25)
                assert await s.consume("rollouts", "thief", count=1, block_ms=1) == []
            assert lease.renewals >= 3
        assert await s.ack("rollouts", [message.id]) == 1
        await s.close()

    asyncio.run(body())


# ----------------------------------------------------------------- real services, two of each


def _env(*paths: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), *map(str, paths),
                                       os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def _start(args: list[str], log: Path, *paths: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                            env=_env(*paths), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _wait_for(condition, procs, logs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"{log.name} exited {proc.returncode}:\n"
                                     f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s:\n" +
                                 "\n".join(log.read_text()[-1500:] for log in logs))
        time.sleep(0.05)


SLOW_REWARD = """
import os
import time


def slow(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["FORAGE_TEST_CALLS"], "a") as handle:
        handle.write(f"{os.getpid()}\\n")
    time.sleep(3.5)  # more than 3x redis.visibility_timeout_s
    return 1.0
"""


@pytest.mark.slow
def test_a_scorer_batch_slower_than_the_timeout_is_scored_once(tmp_path, redis_url, namespace,
                                                               tiny_policy_dir, monkeypatch):
    from transformers import AutoTokenizer

    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FORAGE_TEST_CALLS", str(calls))
    config = tmp_path / "scorer.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": VT},
        "scorer": {"num_workers": 1, "http": False, "batch_size": 4, "block_ms": 100,
                   "tokenizer_path": str(tiny_policy_dir),
                   "rewards": {"slow_task": [{"function": "slow_rewards:slow"}]}},
    }))
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("rollouts")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start(["scorer", "serve", "--config", str(config), "--set", f"scorer.name={n}"],
                    log, tmp_path) for n, log in zip("ab", logs, strict=True)]
    try:
        _wait_for(lambda: all("consuming" in log.read_text() for log in logs), procs, logs, 90,
                  "both scorers consuming")
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
        ids = tokenizer.encode("<answer> x </answer>", add_special_tokens=False)
        trajectory = Trajectory("slow", "slow:0:0", "slow_task", 1, [1, 2], ids, [1] * len(ids),
                                [0.0] * len(ids))
        streams.publish("rollouts", encode(trajectory))
        _wait_for(lambda: streams.client.xlen(streams.key("scored")) >= 1, procs, logs, 60,
                  "the slow record scored")
        time.sleep(2 * VT)  # a second scoring would finish here if one had started
        _wait_for(lambda: streams.pending("rollouts") == 0, procs, logs, 10, "acked")
    finally:
        codes = [_stop(proc) for proc in procs]
    scored = [decode_as(f[b"payload"], ScoredTrajectory)
              for _, f in streams.client.xrange(streams.key("scored"))]
    assert len(calls.read_text().split()) == 1, "the reward ran more than once"
    assert [s.trajectory.sample_id for s in scored] == ["slow:0:0"]
    assert streams.dead_letters() == []
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    streams.close()


@pytest.mark.slow
def test_a_rollout_group_held_past_the_timeout_is_played_once(tmp_path, redis_url, namespace,
                                                              tiny_policy_dir):
    """Replica A takes a group that needs policy version 2, which the learner serves but which
    takes A ~12 s to fetch (a lazy provider, slow like a large model over a slow link): A
    holds the group all that time. Replica B (no weight sync: it would play the group at
    once) starts meanwhile and polls the stream, reclaiming whatever is idle past the
    visibility timeout."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.weight_sync.server import WeightSyncServer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    pause = 12.0 / len(weights)

    def slow_provider():
        for name, tensor in weights.items():
            time.sleep(pause)
            yield name, tensor

    server = WeightSyncServer(port=0).start()
    server.publish(weights, version=1)
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("prompts")
    streams.ensure_group("rollouts")
    client = redis.Redis.from_url(redis_url)
    names = [f"lease-{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
    logs = [tmp_path / f"{n}.log" for n in names]
    procs: list[subprocess.Popen] = []

    def start(name: str, log: Path, weight_sync: bool) -> subprocess.Popen:
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({
            "redis": {"url": redis_url, "namespace": namespace, "visibility_timeout_s": VT},
            "model": {"path": str(tiny_policy_dir)},
            "learner": {"weight_sync_host": "127.0.0.1", "weight_sync_port": server.port},
            "rollout": {"max_batch_size": 4, "use_search": False, "max_turns": 0,
                        "stop_strings": [], "weight_sync": weight_sync, "weight_poll_s": 60,
                        "weight_wait_s": 60, "heartbeat_s": 0.2, "name": name,
                        "max_tokens_per_turn": 8, "max_response_length": 8},
            "data": {"n_samples": 2},
        }))
        return _start(["rollout", "serve", "--config", str(config)], log)

    try:
        procs.append(start(names[0], logs[0], weight_sync=True))
        _wait_for(lambda: client.get(f"{namespace}:heartbeat:rollout:{names[0]}"), procs,
                  logs[:1], 90, "replica A up")
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]
        server.publish_lazy(slow_provider, 2, specs=specs)
        group = PromptGroup("held", "nq", "Who founded the city?", {"target": ["x"]}, n=2,
                            policy_version_min=2)
        streams.publish("prompts", encode(group))

        def owner() -> list[bytes]:
            return [p["consumer"] for p in
                    client.xpending_range(streams.key("prompts"), "rollout", "-", "+", 10)]

        _wait_for(lambda: owner() == [names[0].encode()], procs, logs[:1], 30, "A holding it")
        procs.append(start(names[1], logs[1], weight_sync=False))
        _wait_for(lambda: streams.client.xlen(streams.key("rollouts")) >= 2, procs, logs, 90,
                  "the group played")
        assert client.get(f"{namespace}:heartbeat:rollout:{names[1]}"), "B never polled"
        time.sleep(2.0)  # a second play of the group would publish here
        _wait_for(lambda: streams.pending("prompts") == 0, procs, logs, 10, "acked")
    finally:
        codes = [_stop(proc) for proc in procs]
        server.stop()
    trajectories = [decode_as(f[b"payload"], Trajectory)
                    for _, f in streams.client.xrange(streams.key("rollouts"))]
    assert len(trajectories) == 2, [(t.sample_id, t.policy_version) for t in trajectories]
    assert all(t.policy_version == 2 for t in trajectories)  # played by A, after the fetch
    assert streams.dead_letters() == []
    assert codes == [0, 0]
    streams.close()
