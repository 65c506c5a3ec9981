"""A simulated rollout engine, and a host process that runs many rollout replicas as threads.

Used only by bench/scale.py (never shipped in services/). The engine implements the interface
of services/rollout/engine.py: `add_request`, `step`, `has_unfinished`, ... but runs no model.
Each request takes `per_token_s` seconds of wall time per emitted token (`time.sleep`, not CPU:
a GPU engine's decode time costs the host nothing, so with the engine simulated this way N
replicas could scale linearly, and whatever keeps them from it is Forage's own overhead). A
turn's tokens are real ids of the run's tokenizer: with probability `answer_rate` a
well-formed Search-R1 answer (`<think> ... </think>\\n<answer> X </answer>`, stopping at
`</answer>`), otherwise text with no action tag, which the agent loop treats as an invalid
turn (Search-R1's corrective message, then another turn). The engine never searches, so no
retriever is needed. Prefill costs nothing.

A request finishes `len(tokens) × per_token_s` after it was admitted, however late the agent
loop calls `step()`; `step()` sleeps until the next request finishes, but at most one decode
quantum (`step_s`), so the worker's between-steps work (heartbeat, weight-version poll, taking
new groups) runs about as often as with a real engine's steps.

Weights: the engine has `pull_weights`, the hook vLLM's engine has, so a replica asks the
learner's WeightSync for versions (`GetVersion`) and hands the version to the engine, which
records it without fetching bytes. Weight-byte fan-out is bench/weight_fanout.py's subject;
here the version handling (polls, `policy_version_min` gating, staleness) is what is measured.

`ReplicaHost` runs `count` real `services.rollout.worker.RolloutWorker`s in one process, one
thread each, each with its own Redis connections, consumer name, heartbeat key, metrics server
and WeightSync client: the replica code is Forage's, only the engine and the process layout
differ. 64 processes importing torch would not fit a small machine and would measure their
start-up and CPU, not the control plane.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
import types
from collections import deque
from dataclasses import dataclass
from typing import Any

from services.rollout.engine import GenerationOutput, GenerationRequest

log = logging.getLogger("forage.bench.sim")

# Answers the engine picks from; bench/scale.py draws ground truths from the same list, so
# exact match is about 1 / len(ANSWERS) and GRPO groups get non-constant rewards.
ANSWERS = ("Velmora", "Ostrand", "Kessary", "Bramlow")
FILLER = ("the question names one place so I recall what I know about it and check the "
          "likely candidates before I answer").split()


@dataclass
class _Running:
    request: GenerationRequest
    tokens: list[int]
    finish: str
    stop_string: str | None
    done_at: float
    version_start: int


class SimulatedEngine:
    """A model-free engine whose generation time is wall time (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, per_token_s: float, tokens_per_turn: int,
                 answer_rate: float, max_batch_size: int, seed: int = 0,
                 step_s: float = 0.05) -> None:
        if per_token_s < 0 or not 0.0 <= answer_rate <= 1.0 or tokens_per_turn < 8:
            raise ValueError("per_token_s >= 0, 0 <= answer_rate <= 1, tokens_per_turn >= 8")
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.max_batch_size = max_batch_size
        self.forced_tokens = None
        self.tokens_generated = 0
        self.per_token_s = per_token_s
        self.answer_rate = answer_rate
        self.step_s = max(step_s, per_token_s)
        self._rng = random.Random(seed)
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []
        self._answers = [self._turn(f"<answer> {answer} </answer>", tokens_per_turn)
                         for answer in ANSWERS]
        self._invalid = self._turn("", tokens_per_turn)

    def _turn(self, tail: str, length: int) -> list[int]:
        """Token ids of `<think> filler </think>\\n` + `tail` (or filler alone when `tail` is
        empty), about `length` long: the filler grows until the ids reach the length."""
        words: list[str] = []
        while True:
            think = " ".join(words)
            text = f"<think> {think} </think>\n{tail}" if tail else f"I think {think}"
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= length or len(words) > 4 * length:
                return list(ids)
            words.append(FILLER[len(words) % len(FILLER)])

    # ------------------------------------------------------------------ engine interface

    def add_request(self, request: GenerationRequest) -> None:
        self._waiting.append(request)

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting.popleft()
            well_formed = self._rng.random() < self.answer_rate
            tokens = self._rng.choice(self._answers) if well_formed else self._invalid
            finish, stop = ("stop", "</answer>") if well_formed else ("eos", None)
            limit = max(1, request.params.max_tokens)
            if len(tokens) > limit:
                tokens, finish, stop = tokens[:limit], "length", None
            self._running.append(_Running(request, tokens, finish, stop,
                                          now + len(tokens) * self.per_token_s,
                                          self.policy_version))

    def step(self) -> list[GenerationOutput]:
        """Sleep until the next request finishes (at most `step_s`); return those done."""
        self._admit(time.monotonic())
        if not self._running:
            return []
        now = time.monotonic()
        wake = min(min(r.done_at for r in self._running), now + self.step_s)
        if wake > now:
            time.sleep(wake - now)
            now = time.monotonic()
        done = [r for r in self._running if r.done_at <= now]
        if not done:
            return []
        self._running = [r for r in self._running if r.done_at > now]
        outputs = []
        for r in done:
            self.tokens_generated += len(r.tokens)
            outputs.append(GenerationOutput(
                request=r.request, token_ids=list(r.tokens), logprobs=[-0.7] * len(r.tokens),
                finish=r.finish, stop_string=r.stop_string, version_start=r.version_start,
                version_end=self.policy_version))  # type: ignore[arg-type]
        self._admit(now)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    def release(self, cache_key: Any) -> None:
        """Nothing is cached."""

    def abort_all(self) -> None:
        self._waiting.clear()
        self._running.clear()

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.policy_version = version

    def pull_weights(self, version: int, address: str, token: str | None,
                     plan: dict[str, Any] | None = None) -> int:
        """vLLM's hook: its workers would fetch `version` from `address`; this engine takes
        the version number only (weight bytes are bench/weight_fanout.py's subject)."""
        self.policy_version = version
        return version

    def generate(self, requests: Any) -> list[GenerationOutput]:
        from services.rollout.engine import run_to_completion

        return run_to_completion(self, requests)


# ---------------------------------------------------------------------- many replicas, 1 process


def _thread_safe_signals() -> None:
    """`RolloutWorker.run` installs SIGTERM/SIGINT handlers, which Python allows only in the
    main thread. In a host the process's one handler stops every worker (`ReplicaHost.stop`),
    so the workers' own installation is skipped: the worker module gets a `signal` namespace
    whose `signal()` does nothing and whose constants are the real ones."""
    import services.rollout.worker as worker_module

    worker_module.signal = types.SimpleNamespace(  # type: ignore[attr-defined]
        signal=lambda *args: None, SIGTERM=signal.SIGTERM, SIGINT=signal.SIGINT)


class ReplicaHost:
    """`count` RolloutWorkers with simulated engines, one thread each, in this process."""

    def __init__(self, config: Any, count: int, first_index: int, *, per_token_s: float,
                 tokens_per_turn: int, answer_rate: float, step_s: float,
                 profile_path: str = "") -> None:
        from transformers import AutoTokenizer

        from services.common.paths import LOCAL_ONLY
        from services.rollout.worker import RolloutWorker

        _thread_safe_signals()
        path = config.model.tokenizer_path or config.model.path
        self.workers: list[Any] = []
        for index in range(first_index, first_index + count):
            # One tokenizer per replica: a fast tokenizer shared by threads can fail with
            # "Already borrowed", and each real replica has its own anyway.
            tokenizer = AutoTokenizer.from_pretrained(path, **LOCAL_ONLY)
            engine = SimulatedEngine(tokenizer, per_token_s=per_token_s,
                                     tokens_per_turn=tokens_per_turn, answer_rate=answer_rate,
                                     max_batch_size=config.rollout.max_batch_size,
                                     seed=config.rollout.seed + index, step_s=step_s)
            replica = config.model_copy(deep=True)
            replica.rollout.name = f"sim-replica-{index}"
            self.workers.append(RolloutWorker(replica, engine=engine))
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []
        self.profile_path = profile_path
        self.profiles: list[Any] = []
        self._lock = threading.Lock()

    def _run_one(self, worker: Any) -> None:
        profile = None
        if self.profile_path:  # where a host's CPU goes: one cProfile per thread, merged
            import cProfile

            profile = cProfile.Profile(time.thread_time)  # CPU, not waits
            profile.enable()
        try:
            worker.run()
        except Exception as exc:  # reported by the host's exit code, with the replica's name
            log.exception("replica %s failed", worker.name)
            self.failures.append(f"{worker.name}: {type(exc).__name__}: {exc}")
        finally:
            if profile is not None:
                profile.disable()
                with self._lock:
                    self.profiles.append(profile)

    def dump_profile(self) -> None:
        """Write the merged per-thread profiles to `profile_path` (pstats format)."""
        import pstats

        if not self.profile_path or not self.profiles:
            return
        stats = pstats.Stats(self.profiles[0])
        for profile in self.profiles[1:]:
            stats.add(profile)
        stats.dump_stats(self.profile_path)

    def start(self) -> None:
        for worker in self.workers:
            thread = threading.Thread(target=self._run_one, args=(worker,), name=worker.name,
                                      daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stopping = True

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self.threads)

    def alive(self) -> int:
        return sum(thread.is_alive() for thread in self.threads)
