"""The rollout service: prompt groups in, trajectories out (docs/architecture.md).

One replica = one process = one engine. It joins consumer group `rollout` on the prompts
stream, plays groups through the agent loop, publishes each group's `n` trajectories together
and only then acks the group (at-least-once: a replica that dies before the ack leaves the
group pending, another replica reclaims it after the visibility timeout; sample ids are
deterministic so the learner's de-duplication drops a repeat). The engine is kept full: as
sequences finish, the replica takes new groups from the stream (up to `rollout.max_batch_size`
sequences in flight), rather than playing a batch to its slowest trajectory before reading
again; a group is taken only when it can start, so the learner may time it from that moment.
Between engine steps it polls the learner's WeightSync and swaps to a newer version; before
taking any work it fetches the current one. A heartbeat key with a TTL says it is alive and
what it serves. SIGTERM stops taking work, finishes the groups in hand, publishes and acks
them, and exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from services.common.codec import CodecError, decode_as, encode
from services.common.logs import set_log_context, setup_logging
from services.common.metrics import start_metrics_server
from services.common.trajectory import PromptGroup, Trajectory
from services.rollout import metrics
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.engines import make_engine
from services.rollout.probe import ProbeSettings
from services.rollout.retrieval import RetrieverClient
from services.rollout.retrieval_cache import open_cache
from services.rollout.tool_runner import ToolLoadError

log = logging.getLogger("forage.rollout")

# While its engine is busy, a replica reads the stream for new groups at most this often (an
# idle one reads at once): two Redis round trips per engine step would cost more than the
# few milliseconds a freed slot waits.
FEED_INTERVAL_S = 0.05
# While it holds groups that need newer weights than its engine serves, a replica asks the
# learner for them at most this often instead of every `rollout.weight_poll_s`: the learner
# publishes a version before it issues groups that need it, so the version is there, and the
# slots reserved for the held groups stay empty until it arrives. Waiting for the regular poll
# (1 s by default) left those slots idle and the groups in play a version older (more of them
# dropped as stale): with 16 replicas it cost about a quarter of the throughput (bench/scale.py).
HELD_POLL_S = 0.1
# While a replica waits for the learner's first weights (the learner may still be starting), a
# failed poll is logged this often, at INFO, instead of a warning a second.
WAIT_LOG_S = 30.0


def replica_name(configured: str) -> str:
    return configured or f"{socket.gethostname()}-{os.getpid()}"


def _describe(exc: BaseException) -> str:
    """An exception as one bounded line for a dead-letter reason."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__


def _replica_fault(exc: BaseException) -> bool:
    """Whether a failure during play is the replica's own rather than the groups': Redis or
    backpressure (the service cannot work; it exits and is restarted), or an exception raised
    in its between-steps work (weight sync, heartbeat), which any group would meet."""
    import redis

    from services.common.streams import BackpressureTimeout

    if isinstance(exc, redis.RedisError | BackpressureTimeout):
        return True
    own = RolloutWorker._between_steps.__code__
    return any(frame.f_code is own for frame, _ in traceback.walk_tb(exc.__traceback__))


def _published(manifest: Any) -> bool:
    """Whether a GetVersion manifest describes real weights (a fresh server has none)."""
    if manifest is None:
        return False
    tensors = manifest.get("tensors") if isinstance(manifest, dict) else getattr(
        manifest, "tensors", None)
    return bool(tensors)


def _is_adapter(manifest: Any) -> bool:
    """Whether a GetVersion manifest announces a LoRA adapter (services/common/lora.py)."""
    from services.common.lora import KIND

    metadata = manifest.get("metadata") if isinstance(manifest, dict) else getattr(
        manifest, "metadata", None)
    return dict(metadata or {}).get("kind") == KIND


def plays(config: Any) -> dict[str, Any]:
    """What the heartbeat says this replica plays: the model it loaded and the agent-loop
    settings a prompt group cannot override (its `sampling` sets temperature, top_p, top_k
    and max_turns). `forage eval` through replicas records them, and refuses flags that
    disagree, instead of reporting settings the replicas never used."""
    r = config.rollout
    return {"model": str(config.model.path), "engine": r.engine, "settings": {
        "max_tokens_per_turn": r.max_tokens_per_turn, "max_obs_length": r.max_obs_length,
        "max_response_length": r.max_response_length,
        "max_prompt_length": r.max_prompt_length, "use_search": r.use_search,
        "protocol": r.protocol, "topk": config.retriever.topk}}


class RolloutWorker:
    def __init__(self, config: Any, engine: Any | None = None) -> None:
        self.config = config
        self.name = replica_name(config.rollout.name)
        self.namespace = config.redis.namespace
        retriever = None
        self._retrieval_cache = None
        if config.rollout.use_search:
            retriever = RetrieverClient(
                config.retriever.url, topk=config.retriever.topk,
                timeout_s=config.retriever.timeout_s, retries=config.retriever.retries,
                backoff_s=config.rollout.retrieve_backoff_s,
                max_query_chars=config.retriever.max_query_chars,
            )
            # rollout.retrieval_cache (None: off), checked before the engine loads: a store of
            # another index stops the replica at once
            self._retrieval_cache = open_cache(config, retriever)
            if self._retrieval_cache is not None:
                retriever = self._retrieval_cache  # type: ignore[assignment]
        self.engine = engine if engine is not None else make_engine(config)
        self.loop = AgentLoop(
            self.engine, LoopSettings.from_config(config.rollout), retriever,
            ProbeSettings.from_config(config.probe), on_step=self._between_steps,
            seed=config.rollout.seed,
        )
        self.stopping = False
        self._weights = None
        self._relay = None  # this replica's weight relay (transformers engine), once started
        self._share_path = ""  # vLLM with tensor parallelism: rank 0's socket for the others
        self._last_poll = 0.0
        self._last_beat = 0.0
        self._busy = 0
        self._redis = None
        self._streams = None
        # Groups taken while the engine serves an older version than they need: leased, not
        # started until the new weights are in.
        self._held: list[tuple[PromptGroup, Any]] = []
        self._in_hand = 0  # groups taken and not yet published or dead-lettered
        self._published = 0  # groups published since the start (for the log line)
        self._last_read = 0.0
        self._waiting_since: float | None = None  # set while waiting for the first weights
        self._next_wait_log = 0.0
        self._plays = plays(config)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        from services.common.streams import RedisStreams

        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        server = start_metrics_server(self.config.rollout.metrics_port,
                                      host=self.config.rollout.host,
                                      healthy=lambda: not self.stopping, service=self.name)
        log.info("replica %s: metrics on %s:%d", self.name, server.host, server.port)
        self._streams = RedisStreams.from_config(self.config.redis)
        # The heartbeat goes through the streams' client: the same server and credentials.
        self._redis = self._streams.client
        self._streams.ensure_group("prompts")
        if self.config.rollout.weight_sync:
            self._client()  # a TLS file or setting that cannot work stops the replica here
            self._wait_for_first_weights()
        metrics.POLICY_VERSION.set(self.engine.policy_version)
        self._heartbeat(force=True)
        try:
            while not self.stopping:
                self._heartbeat()
                self._poll_weights(force=False)
                count = self._groups_per_batch()
                messages = self._streams.consume("prompts", consumer=self.name, count=count,
                                                 block_ms=1000)
                if messages:
                    self._play(messages)
        finally:
            self._redis.delete(self._beat_key())
            server.stop()
            self.loop.close()
            if self._retrieval_cache is not None:
                self._retrieval_cache.close()
            if self._relay is not None:  # children reading from it go on elsewhere
                self._relay.stop()
        log.info("replica %s stopped", self.name)
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.info("signal %d: finishing the groups in hand, then exiting", signum)
        self.stopping = True

    def _groups_per_batch(self) -> int:
        """Groups an idle replica reads at once: as many as fill the engine."""
        configured = self.config.rollout.groups_per_batch
        if configured:
            return configured
        return max(1, self.engine.max_batch_size // max(1, self.config.data.n_samples))

    # ------------------------------------------------------------------ work

    def _play(self, messages: list[Any]) -> None:
        """Decode, play, publish and ack groups, taking more from the stream as sequences
        finish, until the replica has nothing in flight; one bad group never takes the others.

        A record that does not decode (the codec also refuses NaN sampling values, empty
        prompts, unbounded `n`, deep free-form fields) is dead-lettered alone with the reason.
        If playing raises, the groups not yet published are played again one at a time and
        only a group that fails alone is dead-lettered, with the exception. Failures of the
        replica itself (Redis, backpressure, its weight sync between steps) are not the
        groups' fault: they propagate. Every message is leased until its group is acked, so
        play slower than `redis.visibility_timeout_s` is not reclaimed and played twice.
        """
        with self._streams.lease("prompts", self.name, [m.id for m in messages]) as lease:
            pending = self._accept(messages)
            self._last_read = time.monotonic()
            started, tokens0, published0 = time.perf_counter(), self._tokens(), self._published
            while pending:
                needed = max(group.policy_version_min for group, _ in pending)
                if needed > self.engine.policy_version and self.config.rollout.weight_sync:
                    self._wait_for_version(needed)
                left, error = self._play_groups(
                    pending, lease, feed=lambda free: self._take_more(lease, free))
                if error is not None:
                    log.error("playing failed (%s); playing the %d unfinished group(s) alone",
                              _describe(error), len(left))
                    for one in left:
                        rest, error = self._play_groups([one], lease)
                        if error is not None:
                            self._dead_letter(rest[0][1], f"playing the group failed: "
                                                          f"{_describe(error)}")
                            self._in_hand -= 1
                # Groups that waited for newer weights: the engine went idle without them.
                pending, self._held = self._held, []
            elapsed = time.perf_counter() - started
            log.info("played %d groups in %.2fs (%.0f tokens/s)", self._published - published0,
                     elapsed, (self._tokens() - tokens0) / max(elapsed, 1e-9))
            self._busy = 0

    def _accept(self, messages: list[Any]) -> list[tuple[PromptGroup, Any]]:
        """Decoded groups of `messages`; undecodable records and groups asking for a version
        the learner never published are dead-lettered (each alone, with the reason)."""
        pending: list[tuple[PromptGroup, Any]] = []
        for message in messages:
            try:
                pending.append((decode_as(message.payload, PromptGroup), message))
            except CodecError as exc:
                self._dead_letter(message, str(exc))
        pending = self._drop_future_versions(pending)
        self._in_hand += len(pending)
        return pending

    def _take_more(self, lease: Any, free: int) -> list[tuple[PromptGroup, Any]]:
        """Groups to start now that `free` sequence slots are free: held ones whose weights
        have arrived, then new ones from the stream (read without blocking). A group is read
        only when its samples fit (by `data.n_samples`), so the learner's clock, which starts
        when a replica takes a group, starts when the group can start. Groups that need newer
        weights than the engine serves are held (leased, not started) until they arrive."""
        if self.stopping:
            return []
        ready: list[tuple[PromptGroup, Any]] = []
        still: list[tuple[PromptGroup, Any]] = []
        for group, message in self._held:  # new weights arrive between engine steps
            fits = group.policy_version_min <= self.engine.policy_version
            (ready if fits else still).append((group, message))
        self._held = still
        free -= sum(max(1, group.n) for group, _ in ready)
        now = time.monotonic()
        idle = free >= self.engine.max_batch_size and not self._held
        count = free // max(1, self.config.data.n_samples)
        if idle:
            count = max(count, 1)  # a group larger than the engine still runs, alone
        configured = self.config.rollout.groups_per_batch
        if configured:
            count = min(count, configured - self._in_hand)
        if count <= 0 or (not idle and now - self._last_read < FEED_INTERVAL_S):
            return ready
        self._last_read = now
        messages = self._streams.consume("prompts", consumer=self.name, count=count,
                                         block_ms=0)
        if not messages:
            return ready
        lease.add([m.id for m in messages])
        for group, message in self._accept(messages):
            if group.policy_version_min > self.engine.policy_version and \
                    self.config.rollout.weight_sync:
                self._held.append((group, message))
            else:
                ready.append((group, message))
        return ready

    def _drop_future_versions(self, pending: list[tuple[PromptGroup, Any]]
                              ) -> list[tuple[PromptGroup, Any]]:
        """Dead-letter groups that ask for a policy version the learner has not published.

        The learner publishes a version before it issues groups that need it, so such a group
        is bogus, and waiting for it would hold the replica for `rollout.weight_wait_s`. When
        the learner cannot be asked, groups wait as before.
        """
        if not self.config.rollout.weight_sync or all(
                group.policy_version_min <= self.engine.policy_version for group, _ in pending):
            return pending
        from services.common.weight_sync import WeightSyncError

        try:
            served, _ = self._client().get_version()
        except WeightSyncError:
            return pending
        keep = []
        for group, message in pending:
            if group.policy_version_min > served:
                self._dead_letter(message, f"policy_version_min {group.policy_version_min} is "
                                           f"ahead of the version the learner serves ({served})")
            else:
                keep.append((group, message))
        return keep

    def _play_groups(
        self, pending: list[tuple[PromptGroup, Any]], lease: Any,
        feed: Callable[[int], list[tuple[PromptGroup, Any]]] | None = None,
    ) -> tuple[list[tuple[PromptGroup, Any]], Exception | None]:
        """Play groups, publishing and acking each as it finishes, and the groups `feed` hands
        over as sequence slots free up; returns the groups not published and the exception
        that stopped them (None when all were)."""
        message_of = {id(group): message for group, message in pending}
        left = {id(group): (group, message) for group, message in pending}
        self._busy = sum(group.n for group, _ in pending)
        self._heartbeat(force=True)

        def publish(group: PromptGroup, trajectories: list[Trajectory]) -> None:
            message = message_of.pop(id(group))
            self._streams.publish_many("rollouts", [encode(t) for t in trajectories])
            self._streams.ack("prompts", [message.id])
            lease.release([message.id])
            left.pop(id(group), None)
            metrics.GROUPS.labels(group.kind).inc()
            self._busy -= group.n
            self._in_hand -= 1
            self._published += 1

        def take(free: int) -> list[PromptGroup]:
            fresh = feed(free) if feed is not None else []
            for group, message in fresh:
                message_of[id(group)] = message
                left[id(group)] = (group, message)
                self._busy += group.n
            return [group for group, _ in fresh]

        try:
            self.loop.run([group for group, _ in pending], on_group_done=publish,
                          feed=take if feed is not None else None)
        except Exception as exc:
            if _replica_fault(exc):
                raise
            log.exception("playing %d group(s) failed", len(left))
            self._reset_engine()
            return list(left.values()), exc
        return [], None

    def _reset_engine(self) -> None:
        """Drop what a failed run left in the engine, so the next run starts clean."""
        abort = getattr(self.engine, "abort_all", None)
        if abort is not None:
            abort()
            return
        while self.engine.has_unfinished():  # engines without abort_all: finish and discard
            self.engine.step()

    def _dead_letter(self, message: Any, reason: str) -> None:
        log.error("dead-lettering prompt group %s: %s", message.id, reason)
        self._streams.dead_letter("prompts", message, reason)

    def _tokens(self) -> int:
        return int(getattr(self.engine, "tokens_generated", 0))

    def _between_steps(self) -> None:
        self._heartbeat()
        self._poll_weights(force=self._held_wait_for_weights())

    def _held_wait_for_weights(self) -> bool:
        """Whether held groups need a newer version than the engine serves and the last poll
        is at least HELD_POLL_S old: then the poll is due now, not at `weight_poll_s`."""
        if not any(group.policy_version_min > self.engine.policy_version
                   for group, _ in self._held):
            return False
        return time.monotonic() - self._last_poll >= HELD_POLL_S

    # ------------------------------------------------------------------ weights

    def _client(self) -> Any:
        """The replica's weight-sync client. With an engine that fetches in its own workers
        (vLLM) it only asks for versions (and small adapters): plain. Otherwise it fetches the
        weights itself, through relays, and relays them on (rollout.weight_relay)."""
        if self._weights is None:
            from services.common.weight_sync import WeightSyncClient
            from services.common.weight_sync.settings import (
                check_tls_files,
                client_tls,
                relay_plan,
                replica_client,
                start_relay,
            )

            learner = self.config.learner
            address = f"{learner.weight_sync_host}:{learner.weight_sync_port}"
            plan = relay_plan(self.config.rollout, learner)
            if hasattr(self.engine, "pull_weights"):
                check_tls_files(plan)  # the engine's workers read them: fail here, not there
                self._weights = WeightSyncClient(address, token=learner.weight_sync_token,
                                                 **client_tls(plan))
            else:
                self._relay = start_relay(plan, learner.weight_sync_token)
                self._weights = replica_client(address, learner.weight_sync_token, plan,
                                               self._relay)
        return self._weights

    def _pull_plan(self) -> dict[str, Any]:
        """What a vLLM engine's workers need to fetch like this replica would (plain values:
        they cross vLLM's RPC): the relay settings, and with tensor parallelism the Unix
        socket on which rank 0 serves the other ranks what it receives, so the replica
        fetches each version once rather than once per rank."""
        from services.common.weight_sync.settings import relay_plan

        plan = relay_plan(self.config.rollout, self.config.learner)
        if self.config.rollout.tensor_parallel_size > 1:
            if not self._share_path:
                import tempfile
                import uuid

                self._share_path = (f"unix:{tempfile.gettempdir()}/forage-weights-"
                                    f"{uuid.uuid4().hex[:12]}.sock")
            plan["share"] = self._share_path
        return plan

    def _wait_for_first_weights(self) -> None:
        """Block until the learner's first published weights are loaded. The learner may still
        be starting (`forage up` starts every service at once): until the deadline a failed
        poll is the expected state, logged once and then every WAIT_LOG_S, not as a warning."""
        learner = self.config.learner
        log.info("waiting for the learner's first weights at %s:%d",
                 learner.weight_sync_host, learner.weight_sync_port)
        deadline = time.monotonic() + self.config.rollout.weight_wait_s
        self._waiting_since = time.monotonic()
        try:
            while not self.stopping:
                if self._poll_weights(force=True, first=True):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no weights from the learner at {learner.weight_sync_host}:"
                        f"{learner.weight_sync_port} after {self.config.rollout.weight_wait_s}s"
                    )
                self._heartbeat()
                time.sleep(min(1.0, self.config.rollout.weight_poll_s))
        finally:
            self._waiting_since = None

    def _wait_for_version(self, version: int) -> None:
        deadline = time.monotonic() + self.config.rollout.weight_wait_s
        while self.engine.policy_version < version and time.monotonic() < deadline:
            if not self._poll_weights(force=True):
                time.sleep(min(1.0, self.config.rollout.weight_poll_s))
            self._heartbeat()

    def _poll_weights(self, force: bool, first: bool = False) -> bool:
        """Fetch and load newer weights; True when new weights were loaded."""
        if not self.config.rollout.weight_sync:
            return False
        now = time.monotonic()
        if not force and now - self._last_poll < self.config.rollout.weight_poll_s:
            return False
        self._last_poll = now
        from services.common.weight_sync import WeightSyncError

        try:
            version, manifest = self._client().get_version()
            if not _published(manifest):
                return False
            if version <= self.engine.policy_version and not first:
                return False
            started = time.perf_counter()
            pulls = hasattr(self.engine, "pull_weights")
            if pulls and not _is_adapter(manifest):
                # vLLM, full weights: each engine worker fetches this version itself (nothing
                # crosses the engine's RPC but the version, the address and the token).
                learner = self.config.learner
                version = self.engine.pull_weights(
                    version, f"{learner.weight_sync_host}:{learner.weight_sync_port}",
                    learner.weight_sync_token, plan=self._pull_plan())
            else:
                # Fetched here: full weights or an adapter for the transformers engine (the
                # newest consistent version), or exactly this adapter for vLLM, which a few MB
                # make cheap and which vLLM loads from a directory (VLLMEngine.load_adapter).
                version, tensors, meta = self._client().fetch_with_metadata(
                    version if pulls else None)
                self._load(version, tensors, meta)
        except (WeightSyncError, ValueError) as exc:
            metrics.WEIGHT_SYNC_FAILURES.inc()
            if self._waiting_since is None:
                log.warning("weight sync failed, keeping version %d: %s",
                            self.engine.policy_version, exc)
            elif time.monotonic() >= self._next_wait_log:
                waited = time.monotonic() - self._waiting_since
                log.info("no weights from the learner yet (%.0fs): %s", waited, exc)
                self._next_wait_log = time.monotonic() + WAIT_LOG_S
            return False
        metrics.WEIGHT_SYNC_SECONDS.observe(time.perf_counter() - started)
        metrics.POLICY_VERSION.set(version)
        set_log_context(policy_version=version)
        log.info("loaded policy version %d in %.2fs", version, time.perf_counter() - started)
        return True

    def _load(self, version: int, tensors: dict, meta: dict[str, str]) -> None:
        from services.rollout.published import load_published

        load_published(self.engine, self.config.model.path, version, tensors, meta)

    # ------------------------------------------------------------------ heartbeat

    def _beat_key(self) -> str:
        return f"{self.namespace}:heartbeat:rollout:{self.name}"

    def _heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._redis is None or (not force and now - self._last_beat < self.config.rollout.heartbeat_s):
            return
        self._last_beat = now
        body = {
            "name": self.name, "pid": os.getpid(), "ts": time.time(),
            "policy_version": self.engine.policy_version, "busy": self._busy,
            "stopping": self.stopping, **self._plays,
        }
        ttl = max(1, int(round(self.config.rollout.heartbeat_ttl_s)))
        self._redis.set(self._beat_key(), json.dumps(body), ex=ttl)


def serve(config: Any) -> int:
    setup_logging("rollout", run_id=config.run_id, level=config.log_level)
    try:
        worker = RolloutWorker(config)
    except ToolLoadError as exc:  # a bad rollout.tools / mcp_servers entry: one line, no trace
        log.error("%s", exc)
        print(f"forage rollout: error: {exc}", file=sys.stderr)
        return 2
    return worker.run()
