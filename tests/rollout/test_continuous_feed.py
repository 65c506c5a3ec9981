"""A replica keeps its engine full: it takes new groups from the stream as sequences finish,
instead of playing a batch to its slowest trajectory (issue: "Rollout throughput defaults").
Real Redis, the real transformers engine over the tiny policy (its `forced_tokens` hook makes
one group long and the others one token), the real worker without its process wrapper."""

from __future__ import annotations

import redis
import torch

from services.common.codec import decode_as, encode
from services.common.config import load_config
from services.common.streams import RedisStreams
from services.common.trajectory import PromptGroup, Trajectory
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.engines import vllm_engine_kwargs

LONG = 300  # tokens of the long group's samples (~1 s of decoding on the tiny policy)


def _group(uid: str, text: str, n: int = 2) -> PromptGroup:
    return PromptGroup(uid=uid, data_source="nq", prompt=text, ground_truth={"target": ["x"]},
                       n=n)


def _script(engine) -> None:
    """Prompts with "long" decode LONG filler tokens; every other prompt ends with EOS at once."""
    filler = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    eos = min(engine.eos_ids)
    assert filler not in engine.eos_ids

    def forced(request):
        text = engine.tokenizer.decode(request.prompt_ids)
        return [filler] * LONG if "long" in text else [eos]

    engine.forced_tokens = forced


def test_a_replica_starts_new_groups_while_a_long_one_runs(redis_url, namespace,
                                                           tiny_policy_dir):
    from services.rollout.transformers_engine import TransformersEngine
    from services.rollout.worker import RolloutWorker

    torch.set_num_threads(1)
    config = load_config(None, [
        f"redis.url={redis_url}", f"redis.namespace={namespace}", f"model.path={tiny_policy_dir}",
        "rollout.use_search=false", "rollout.max_turns=0", "rollout.weight_sync=false",
        f"rollout.max_tokens_per_turn={LONG}", f"rollout.max_response_length={LONG}",
        "rollout.stop_strings=[]", "rollout.max_batch_size=4", "data.n_samples=2"])
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=4, seed=0)
    _script(engine)
    worker = RolloutWorker(config, engine=engine)
    streams = RedisStreams(redis.Redis.from_url(redis_url), namespace)
    streams.ensure_group("prompts")
    streams.ensure_group("rollouts")
    worker._streams = streams
    shorts = [_group(f"short{i}", f"question {i}") for i in range(4)]
    streams.publish_many("prompts", [encode(g) for g in [_group("long", "the long one"),
                                                          *shorts]])
    try:
        # The replica reads only the long group (2 of its 4 slots); the short ones are still
        # in the stream when it starts.
        worker._play(streams.consume("prompts", worker.name, count=1, block_ms=100))
        out = [decode_as(f[b"payload"], Trajectory)
               for _, f in streams.client.xrange(streams.key("rollouts"))]
    finally:
        worker.loop.close()
    uids = [t.uid for t in out]
    # Every group played once, each published whole; the free slots took the short groups
    # from the stream while the long one decoded, so they were published before it.
    assert sorted(uids) == sorted(["long"] * 2 + [g.uid for g in shorts for _ in range(2)])
    assert len({t.sample_id for t in out}) == 10
    assert uids.index("long") > 0 and uids[-2:] == ["long", "long"]
    assert [len(t.response_ids) for t in out if t.uid == "long"] == [LONG, LONG]
    assert streams.pending("prompts") == 0 and streams.lag("prompts") == 0
    assert not engine.has_unfinished()
    streams.close()


def test_fed_groups_fill_free_slots_and_never_overfill_the_engine(engine):
    """AgentLoop.run(feed=...): the feed is asked with the free slots, what it returns starts
    at once and is reported through on_group_done; the engine never holds more sequences than
    its max_batch_size (4)."""
    _script(engine)
    waiting = [_group(f"fed{i}", f"question {i}") for i in range(3)]
    asked: list[int] = []
    done: list[str] = []
    loaded: list[int] = []

    def feed(free: int) -> list[PromptGroup]:
        asked.append(free)
        if free >= 2 and waiting:
            return [waiting.pop(0)]
        return []

    agent = AgentLoop(engine, LoopSettings(use_search=False, max_tokens_per_turn=LONG,
                                           max_response_length=LONG, stop_strings=()),
                      on_step=lambda: loaded.append(engine.num_running() + engine.num_waiting()))
    try:
        kept = agent.run([_group("long", "the long one")],
                         on_group_done=lambda group, trajs: done.append(group.uid), feed=feed)
    finally:
        agent.close()
    assert [t.uid for t in kept] == ["long", "long"]  # only the groups passed in are returned
    assert done == ["fed0", "fed1", "fed2", "long"]
    assert asked[0] == 2 and max(loaded) <= 4


def test_vllm_concurrency_defaults_to_a_gpu_size():
    """Left out, rollout.max_batch_size (vLLM's max_num_seqs) is vLLM's own default for the
    engine (256), not the CPU engine's 32; an explicit value still wins."""
    vllm = load_config(None, ["rollout.engine=vllm", "model.path=/models/m"])
    assert vllm.rollout.max_batch_size == 256
    assert vllm_engine_kwargs(vllm.rollout, vllm.model)["max_num_seqs"] == 256
    assert load_config(None, []).rollout.max_batch_size == 32
    assert load_config(None, ["rollout.engine=vllm",
                              "rollout.max_batch_size=1024"]).rollout.max_batch_size == 1024
