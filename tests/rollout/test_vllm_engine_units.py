"""The vLLM engine's own logic, as plain functions: finish-reason mapping, config -> EngineArgs,
prefix-cache reset with retries, and requests vLLM rejects (vLLM itself cannot run here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.common.config import ConfigError, load_config
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.engine import GenerationRequest, SamplingParams, run_to_completion
from services.rollout.engines import vllm_engine_kwargs
from services.rollout.vllm_engine import (
    RESET_ATTEMPTS,
    VLLMEngine,
    map_completion,
    plain_logprobs,
    reset_prefix_cache,
)
from services.rollout.vllm_worker import EXTENSION_CLASS

# ------------------------------------------------------------------ finish reasons


def test_stop_string_eos_and_length():
    lp = [{5: -0.5}, {7: -1.0, 8: -2.0}]
    stop = map_completion("stop", "</search>", [5, 7], lp)
    assert (stop.cause, stop.stop_string, stop.logprobs, stop.error) == (
        "stop", "</search>", [-0.5, -1.0], None)
    assert map_completion("stop", None, [5, 7], lp).cause == "eos"  # the EOS token
    assert map_completion("stop", 151643, [5, 7], lp).cause == "eos"  # another stop token id
    assert map_completion("length", None, [5, 7], lp).cause == "length"


@pytest.mark.parametrize("reason, cause", [("abort", "aborted"), ("error", "error"),
                                           ("repetition", "error"), (None, "error")])
def test_abort_error_and_unknown_reasons_are_never_eos(reason, cause):
    mapped = map_completion(reason, None, [5], [{5: -0.1}])
    assert mapped.cause == cause and mapped.error and mapped.logprobs == []


def test_missing_or_misaligned_logprobs_are_errors_not_shifted():
    assert map_completion("stop", None, [5, 7], None).cause == "error"
    assert map_completion("stop", None, [5, 7], [{5: -0.5}]).cause == "error"
    wrong = map_completion("stop", None, [5, 7], [{5: -0.5}, {8: -1.0}])
    assert wrong.cause == "error" and "token 7 at 1" in wrong.error


def test_plain_logprobs_reads_vllm_logprob_objects():
    class Logprob:  # vLLM's vllm.logprobs.Logprob carries .logprob, .rank, .decoded_token
        def __init__(self, logprob):
            self.logprob = logprob

    assert plain_logprobs([{5: Logprob(-0.25)}]) == [{5: -0.25}]
    assert plain_logprobs(None) is None


# ------------------------------------------------------------------ config -> EngineArgs


def test_rollout_keys_reach_the_engine_args(tmp_path):
    config = load_config(overrides=[
        f"model.path={tmp_path}", "rollout.engine=vllm", "rollout.dtype=bfloat16",
        "rollout.max_batch_size=256", "rollout.gpu_memory_utilization=0.55",
        "rollout.tensor_parallel_size=2", "rollout.enforce_eager=true",
        "rollout.enable_prefix_caching=false", "rollout.max_model_len=8192", "rollout.seed=3",
        "rollout.vllm_engine_args={max_num_batched_tokens: 4096}"])
    kwargs = vllm_engine_kwargs(config.rollout, config.model)
    assert kwargs == {
        "model": str(tmp_path), "tokenizer": str(tmp_path), "seed": 3, "dtype": "bfloat16",
        "max_num_seqs": 256, "gpu_memory_utilization": 0.55, "tensor_parallel_size": 2,
        "enforce_eager": True, "enable_prefix_caching": False, "max_model_len": 8192,
        "worker_extension_cls": EXTENSION_CLASS, "logprobs_mode": "processed_logprobs",
        "max_num_batched_tokens": 4096,
    }


def test_defaults_and_refused_overrides(tmp_path):
    config = load_config(overrides=[f"model.path={tmp_path}"])
    kwargs = vllm_engine_kwargs(config.rollout, config.model)
    assert (kwargs["gpu_memory_utilization"], kwargs["tensor_parallel_size"],
            kwargs["enforce_eager"], kwargs["enable_prefix_caching"], kwargs["max_model_len"],
            kwargs["max_num_seqs"]) == (0.9, 1, False, True, None, 32)
    clash = load_config(overrides=[f"model.path={tmp_path}",
                                   "rollout.vllm_engine_args={gpu_memory_utilization: 0.3}"])
    with pytest.raises(ValueError, match=r"vllm_engine_args sets \['gpu_memory_utilization'\]"):
        vllm_engine_kwargs(clash.rollout, clash.model)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(overrides=["rollout.gpu_memory_utilization=1.5"])


# ------------------------------------------------------------------ prefix cache


class SchedulerPrefixCache:
    """vLLM's documented contract for `reset_prefix_cache(reset_running_requests,
    reset_connector) -> bool` (vllm/v1/core/sched/scheduler.py), standing in because vLLM
    cannot run here. Without `reset_running_requests` it resets only when no running request
    holds blocks and returns whether it did. With it, running requests are first preempted
    (moved back to waiting, their blocks freed); if blocks still cannot be freed (remote KV
    transfers in flight, `stuck` attempts here) the scheduler raises RuntimeError, which the
    multiprocess client (SyncMPClient.call_utility) re-raises as `Exception(message)`."""

    def __init__(self, running: int, stuck: int = 0, error: type = Exception) -> None:
        self.running, self.waiting, self.stuck, self.error = running, 0, stuck, error
        self.cached_blocks = {"prefix-a", "prefix-b"}

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        if reset_running_requests:
            self.waiting, self.running = self.waiting + self.running, 0
            if self.stuck:
                self.stuck -= 1
                raise self.error("Failed to reset KV cache even when all the running "
                                 "requests are preempted and moved to the waiting queue.")
        if self.running:
            return False
        self.cached_blocks.clear()
        return True


def failures() -> float:
    return REGISTRY.get_sample_value("forage_rollout_prefix_cache_reset_failures_total") or 0.0


def test_reset_takes_effect_while_requests_run():
    cache = SchedulerPrefixCache(running=3)
    assert cache.reset_prefix_cache() is False and cache.cached_blocks  # the old call: no-op
    before = failures()
    assert reset_prefix_cache(cache.reset_prefix_cache) is True
    assert cache.cached_blocks == set() and cache.waiting == 3 and failures() == before


@pytest.mark.parametrize("error", [Exception, RuntimeError], ids=["mp-client", "in-process"])
def test_reset_retries_and_counts_failures(error):
    cache = SchedulerPrefixCache(running=2, stuck=2, error=error)
    before = failures()
    assert reset_prefix_cache(cache.reset_prefix_cache) is True
    assert failures() == before + 2 and cache.cached_blocks == set()
    hopeless = SchedulerPrefixCache(running=1, stuck=RESET_ATTEMPTS + 1, error=error)
    assert reset_prefix_cache(hopeless.reset_prefix_cache) is False
    assert failures() == before + 2 + RESET_ATTEMPTS and hopeless.cached_blocks


# ------------------------------------------------------------------ rejected requests


class IdleLLMEngine:
    """vLLM's LLMEngine contract with nothing admitted: step() returns no outputs."""

    def step(self):
        return []

    def has_unfinished_requests(self):
        return False


class RejectingVLLMEngine(VLLMEngine):
    """`_submit` raises as vLLM's input processing does for a prompt over max_model_len
    (a ValueError naming both lengths), standing in because vLLM cannot run here."""

    max_model_len = 16

    def _submit(self, key, request, lora_request=None):
        if len(request.prompt_ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(request.prompt_ids)}) is longer "
                             f"than the maximum model length of {self.max_model_len}.")
        raise AssertionError("only over-long prompts are sent in these tests")


def test_a_rejected_request_finishes_with_an_error_instead_of_hanging():
    engine = RejectingVLLMEngine(IdleLLMEngine(), tokenizer=None, max_batch_size=4,
                                 policy_version=5)
    [out] = run_to_completion(engine, [GenerationRequest(list(range(40)), SamplingParams())])
    assert out.finish == "error" and out.token_ids == [] and out.version_start == 5
    assert "longer than the maximum model length of 16" in out.extra["error"]
    assert not engine.has_unfinished()


def test_agent_records_a_rejected_turn_as_an_error_trajectory(tiny_policy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    engine = RejectingVLLMEngine(IdleLLMEngine(), tokenizer=tokenizer, max_batch_size=4)
    group = PromptGroup(uid="g", data_source="nq", ground_truth={"target": ["x"]}, n=2,
                        prompt=[{"role": "user", "content": "Where was Brixol born? " * 4}])
    trajectories = AgentLoop(engine, LoopSettings(use_search=False)).run([group])
    assert [t.finish_reason for t in trajectories] == ["error", "error"]
    assert all("maximum model length" in t.error for t in trajectories)
    assert all(len(t.response_ids) == 0 for t in trajectories)


# ------------------------------------------------------------------ reset after a failed batch


class DecodingLLMEngine:
    """vLLM's V1 `LLMEngine` request contract, standing in because vLLM cannot run here:
    `add_request(request_id, prompt, params)`, `step()` advancing every request by one token
    and returning a `RequestOutput`-shaped object per request (`finished` set on the last),
    and `abort_request(request_ids: list[str])`, which drops those requests without another
    output (vllm/v1/engine/llm_engine.py). `lengths` scripts how many tokens the requests take,
    in the order they arrive; the rest stop at their `max_tokens`."""

    TOKEN = 100

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = list(lengths or [])
        self.requests: dict[str, dict] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, request_id, prompt_ids, max_tokens):
        length = self.lengths.pop(0) if self.lengths else max_tokens
        self.requests[request_id] = {"length": min(length, max_tokens), "tokens": []}
        self.added.append(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        assert isinstance(request_ids, list), "vLLM takes a list of request ids"
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.steps += 1
        outputs = []
        for request_id, state in list(self.requests.items()):
            state["tokens"].append(self.TOKEN)
            finished = len(state["tokens"]) >= state["length"]
            completion = SimpleNamespace(
                finish_reason="length" if finished else None, stop_reason=None,
                token_ids=list(state["tokens"]), logprobs=[{self.TOKEN: -0.5}] * len(
                    state["tokens"]))
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[completion]))
            if finished:
                del self.requests[request_id]
        return outputs


class StandInVLLMEngine(VLLMEngine):
    """`_submit` hands the stand-in what it needs in place of vLLM's request types."""

    def _submit(self, key, request, lora_request=None):
        self.llm_engine.add_request(key, list(request.prompt_ids), request.params.max_tokens)


class FlakyStreams:
    """The two stream calls a batch makes; `publish_many` fails while `fail` is set (a group
    fault, not Redis's: the worker resets its engine and hands the groups back)."""

    def __init__(self) -> None:
        self.fail = True
        self.published: list[bytes] = []

    def publish_many(self, stream, payloads):
        if self.fail:
            raise ValueError("the stream refused the payload")
        self.published.extend(payloads)
        return [str(i) for i in range(len(payloads))]

    def ack(self, stream, ids):
        return len(ids)


def test_a_failed_batch_aborts_live_vllm_requests_and_the_next_batch_runs(tiny_policy_dir):
    from transformers import AutoTokenizer

    from services.common.codec import decode_as
    from services.common.trajectory import Trajectory
    from services.rollout.worker import RolloutWorker

    config = load_config(None, [
        f"model.path={tiny_policy_dir}", "rollout.use_search=false", "rollout.max_turns=0",
        "rollout.weight_sync=false", "rollout.max_tokens_per_turn=6",
        "rollout.max_response_length=6", "rollout.stop_strings=[]"])
    llm = DecodingLLMEngine(lengths=[2])  # the first request (group "short") ends at step 2
    engine = StandInVLLMEngine(llm, AutoTokenizer.from_pretrained(str(tiny_policy_dir)),
                               max_batch_size=8)
    worker = RolloutWorker(config, engine=engine)
    streams = FlakyStreams()
    worker._streams = streams
    lease = SimpleNamespace(release=lambda ids: None)
    groups = [(PromptGroup("short", "nq", "question one", {"target": ["x"]}, n=1),
               SimpleNamespace(id="1-0")),
              (PromptGroup("long", "nq", "question two", {"target": ["x"]}, n=2),
               SimpleNamespace(id="2-0"))]
    try:
        # "short" finishes at step 2, publishing it fails: the batch fails with "long" running
        left, error = worker._play_groups(groups, lease)
        assert isinstance(error, ValueError) and [g.uid for g, _ in left] == ["short", "long"]
        assert llm.aborted == llm.added[1:] and len(llm.aborted) == 2  # long's two samples
        assert llm.steps == 2, "the live requests were stepped instead of aborted"
        assert not engine.has_unfinished() and not llm.has_unfinished_requests()

        streams.fail = False  # the next batch: the same groups again, on the same engine
        left, error = worker._play_groups(left, lease)
        assert (left, error) == ([], None)
        trajectories = [decode_as(p, Trajectory) for p in streams.published]
        assert sorted(t.uid for t in trajectories) == ["long", "long", "short"]
        assert all(t.finish_reason != "error" and len(t.response_ids) == 6 for t in trajectories)
        assert len(llm.aborted) == 2 and llm.steps == 2 + 6
    finally:
        worker.loop.close()
