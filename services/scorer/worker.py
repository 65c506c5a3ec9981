"""The scorer service: rollouts stream in (group `scorer`), scored stream out (docs/architecture.md).

One batch: decode each message (CodecError → dead letter; token ids must lie in the
tokenizer's vocabulary), decode its response tokens to text, score the reward and the probe
samples of the whole batch in one Scorer call (math_verify in the worker-process pool), publish
the ScoredTrajectory records, and only then ack. Every stage is per record: a record that fails
anywhere (no reward for its data source, a reward that raises or returns infinity, any
unexpected exception) is dead-lettered alone with the reason, and its neighbours go on; if the
batch's Scorer call itself raises, each record is scored alone. Eval-kind trajectories are
scored like train ones. The batch's messages are leased while it is scored (`Lease`, renewed
every third of `redis.visibility_timeout_s`), so a slow batch is not reclaimed and scored
twice; a scorer that dies mid-batch leaves them pending and another one reclaims them after
the timeout (at least once).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.codec import CodecError, check_token_ids, decode_as, encode
from services.common.config import RunConfig
from services.common.evidence import evidence_scores
from services.common.probe_curve import CORRECT_THRESHOLD
from services.common.trajectory import ScoredTrajectory, Trajectory
from services.scorer import metrics
from services.scorer.rewards.probe import default_suffix, probe_texts, summarize
from services.scorer.scoring import Scorer, ScoreRequest

log = logging.getLogger("forage.scorer.worker")


def tokenizer_path(config: RunConfig) -> str | None:
    return tokenizer_key_and_path(config)[1]


def tokenizer_key_and_path(config: RunConfig) -> tuple[str, str | None]:
    """(config key, path) of the tokenizer the scorer decodes with, first one set wins."""
    for key, path in (("scorer.tokenizer_path", config.scorer.tokenizer_path),
                      ("model.tokenizer_path", config.model.tokenizer_path),
                      ("model.path", config.model.path)):
        if path:
            return key, path
    return "scorer.tokenizer_path", None


def response_text(tokenizer: Any, trajectory: Trajectory) -> str:
    """The text the rewards read: the response decoded without special tokens (tags, verl's
    convention), or with them for a tool_calls trajectory, whose turns the rewards split at
    the chat template's markers (services.common.tool_calls.split_response)."""
    return tokenizer.decode(trajectory.response_ids.tolist(),
                            skip_special_tokens=trajectory.protocol != "tool_calls")


def run_tool_info(config: RunConfig) -> dict[str, Any]:
    """The run's tool declarations as the format reward reads them from extra_info:
    `tool_specs` {name: argument schema} of rollout.tools (built-ins and user tools; their
    schemas are in the config), `tool_specs_open` when rollout.mcp_servers add tools whose
    schemas only the replica lists."""
    from services.common.tools import TOOL_REGISTRY

    rollout = getattr(config, "rollout", None)
    specs: dict[str, Any] = {}
    for entry in getattr(rollout, "tools", None) or ["search"]:
        if isinstance(entry, str):
            if entry in TOOL_REGISTRY:
                specs[entry] = TOOL_REGISTRY[entry].parameters
        else:
            specs[entry.name] = dict(entry.parameters)
    return {"tool_specs": specs,
            "tool_specs_open": bool(getattr(rollout, "mcp_servers", None))}


def load_tokenizer(path: str | None, key: str = "scorer.tokenizer_path") -> Any:
    """The tokenizer from a local directory; a missing one is one line naming `key`, never a
    model-hub lookup (services/common/paths.py)."""
    from services.common.paths import LOCAL_ONLY, InputPathError, require_tokenizer_dir

    if not path:
        raise InputPathError(
            "the scorer decodes response tokens: set scorer.tokenizer_path, "
            "model.tokenizer_path or model.path"
        )
    require_tokenizer_dir(path, key)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **LOCAL_ONLY)


def vocab_bound(tokenizer: Any) -> int:
    """Token ids the scorer accepts: below the tokenizer's size, or the model's embedding rows
    when its config.json sits beside the tokenizer (models pad their vocabulary, e.g. Qwen2.5:
    151665 tokens, 151936 rows, and a sampler can draw a padded id)."""
    size = len(tokenizer)
    path = getattr(tokenizer, "name_or_path", None)
    if path:
        try:
            rows = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
            size = max(size, int(rows or 0))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return size


def _describe(exc: BaseException) -> str:
    """An exception as one bounded line for a dead-letter reason."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__


class _Rejected(Exception):
    """A record the scorer dead-letters: the message is the reason, `label` the metric's."""

    def __init__(self, reason: str, label: str) -> None:
        super().__init__(reason)
        self.label = label


@dataclass
class _Item:
    message: Any
    trajectory: Trajectory
    requests: list[ScoreRequest]  # its reward, then its probe samples
    probe_sizes: list[int] | None = None  # probe samples per fraction
    # probe.evidence: (variant, rewrites) after the probe samples, behind one request for the
    # real answer (the response itself, format credit 0).
    evidence_sizes: list[tuple[str, int]] | None = None


class ScorerWorker:
    def __init__(self, config: RunConfig, scorer: Scorer, tokenizer: Any, streams: Any,
                 name: str | None = None) -> None:
        self.config = config
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.streams = streams
        self.name = name or config.scorer.name or f"scorer-{socket.gethostname()}-{os.getpid()}"
        self.vocab_size = vocab_bound(tokenizer)
        self.tool_info = run_tool_info(config)
        self.stopping = False
        self.batches = 0

    def stop(self, *_: object) -> None:
        self.stopping = True

    def run(self, max_batches: int | None = None) -> None:
        self.streams.ensure_group("rollouts")
        log.info("scorer %s consuming %s", self.name, self.streams.key("rollouts"))
        while not self.stopping:
            messages = self.streams.consume(
                "rollouts", consumer=self.name, count=self.config.scorer.batch_size,
                block_ms=self.config.scorer.block_ms,
            )
            if messages:
                self.process(messages)
                self.batches += 1
                if max_batches is not None and self.batches >= max_batches:
                    return

    def process(self, messages: list[Any]) -> int:
        """Score one batch; returns how many scored records were written."""
        started = time.monotonic()
        with self.streams.lease("rollouts", self.name, [m.id for m in messages]):
            items = [item for item in map(self._prepare, messages) if item is not None]
            out: list[bytes] = []
            ids: list[str] = []
            rewards: dict[str, list[float]] = defaultdict(list)
            probe_stats: list[tuple[float, float]] = []
            for item, results in zip(items, self._score(items), strict=True):
                try:
                    if isinstance(results, Exception):
                        raise _Rejected(f"scoring failed: {_describe(results)}", "error")
                    record, stats = self._record(item, results)
                    payload = encode(record)
                except _Rejected as exc:
                    self._dead(item.message, str(exc), exc.label)
                    continue
                except Exception as exc:  # one record's bug must not take the batch with it
                    log.exception("scoring %s failed", item.message.id)
                    self._dead(item.message, f"scoring failed: {_describe(exc)}", "error")
                    continue
                out.append(payload)
                ids.append(item.message.id)
                rewards[item.trajectory.data_source].append(record.reward)
                if stats is not None:
                    probe_stats.append(stats)
            if out:
                self.streams.publish_many("scored", out)
                self.streams.ack("rollouts", ids)
        self._observe(rewards, probe_stats, len(out), time.monotonic() - started)
        return len(out)

    def _prepare(self, message: Any) -> _Item | None:
        """Decode one message into its score requests; dead-letters it (None) when it cannot."""
        try:
            trajectory = decode_as(message.payload, Trajectory)
            check_token_ids(trajectory, self.vocab_size)
        except CodecError as exc:
            self._dead(message, f"undecodable record: {exc}", "undecodable")
            return None
        try:
            self.scorer.components(trajectory.data_source)
        except KeyError as exc:
            self._dead(message, str(exc), "unknown_data_source")
            return None
        try:
            text = response_text(self.tokenizer, trajectory)
            extra_info = self._extra_info(trajectory, self.tool_info)
            item = _Item(message, trajectory, [ScoreRequest(
                trajectory.data_source, text, trajectory.ground_truth, extra_info)])
            if trajectory.probe is not None:
                suffix = default_suffix(trajectory.data_source, self.config.probe.suffix)
                item.probe_sizes = []
                for group in probe_texts(trajectory.probe, suffix):
                    item.probe_sizes.append(len(group))
                    item.requests.extend(ScoreRequest(trajectory.data_source, sample,
                                                      trajectory.ground_truth, for_probe=True)
                                         for sample in group)
            if trajectory.evidence is not None:
                # `real`: the response as the reward reads it (a tool_calls one: its last
                # turn's answer, never an <answer> quoted in a tool result); each rewrite is a
                # single final turn, read alike in both protocols
                item.requests.append(ScoreRequest(trajectory.data_source, text,
                                                  trajectory.ground_truth, extra_info,
                                                  for_probe=True))
                item.evidence_sizes = []
                for variant, rewrites in trajectory.evidence.samples.items():
                    item.evidence_sizes.append((variant, len(rewrites)))
                    item.requests.extend(ScoreRequest(trajectory.data_source, rewrite,
                                                      trajectory.ground_truth, for_probe=True)
                                         for rewrite in rewrites)
        except Exception as exc:
            log.exception("preparing %s failed", message.id)
            self._dead(message, f"cannot prepare the record: {_describe(exc)}", "error")
            return None
        return item

    def _score(self, items: list[_Item]) -> list[list[Any] | Exception]:
        """Each item's results, from one Scorer call for the batch; if that call raises, each
        item is scored alone, so only the items that fail alone fail."""
        if not items:
            return []
        try:
            flat = self.scorer.score_many([r for item in items for r in item.requests])
        except Exception:
            log.exception("scoring a batch of %d failed; scoring each record alone", len(items))
        else:
            out: list[list[Any] | Exception] = []
            start = 0
            for item in items:
                out.append(flat[start:start + len(item.requests)])
                start += len(item.requests)
            return out
        alone: list[list[Any] | Exception] = []
        for item in items:
            try:
                alone.append(self.scorer.score_many(item.requests))
            except Exception as exc:
                alone.append(exc)
        return alone

    @staticmethod
    def _record(item: _Item, results: list[Any]
                ) -> tuple[ScoredTrajectory, tuple[float, float] | None]:
        main = results[0]
        failed = main.error or next((r.error for r in results[1:] if r.error), None)
        if failed:
            raise _Rejected(f"reward failed: {failed}", "reward_error")
        if math.isinf(main.score):
            raise _Rejected(f"reward failed: the reward is {main.score} (must be finite, or "
                            "NaN for none)", "reward_error")
        probe_scores, stats = None, None
        start = 1
        if item.probe_sizes is not None:
            grouped = []
            for size in item.probe_sizes:
                grouped.append([r.score for r in results[start:start + size]])
                start += size
            summary = summarize(item.trajectory.probe.fractions, grouped)
            probe_scores = summary.per_fraction
            stats = (summary.auc, summary.overconfidence)
        evidence = None
        if item.evidence_sizes is not None:
            real = results[start].score
            start += 1
            rewrites: dict[str, list[float]] = {}
            for variant, size in item.evidence_sizes:
                rewrites[variant] = [r.score for r in results[start:start + size]]
                start += size
            evidence = evidence_scores(real, rewrites, CORRECT_THRESHOLD)
        record = ScoredTrajectory(item.trajectory, main.score, main.components, probe_scores,
                                  evidence)
        return record, stats

    @staticmethod
    def _extra_info(trajectory: Trajectory, tool_info: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
        """verl's extra_info plus what the trajectory knows (for users' reward functions).
        `protocol` is the trajectory's own; a tool_calls trajectory also gets the run's tool
        declarations (`tool_info`: tool_specs, tool_specs_open) for the format reward."""
        info = dict(trajectory.extra)
        info.setdefault("num_searches", trajectory.num_searches)
        info.setdefault("finish_reason", trajectory.finish_reason)
        info.setdefault("num_turns", len(trajectory.turns))
        info.setdefault("kind", trajectory.kind)
        info["protocol"] = trajectory.protocol
        if trajectory.protocol == "tool_calls" and tool_info:
            for key, value in tool_info.items():
                info.setdefault(key, value)
        return info

    def _dead(self, message: Any, reason: str, label: str) -> None:
        metrics.DEAD_LETTERS.labels(label).inc()
        self.streams.dead_letter("rollouts", message, reason)

    @staticmethod
    def _observe(rewards: dict[str, list[float]], probe_stats: list[tuple[float, float]],
                 count: int, seconds: float) -> None:
        metrics.BATCH_SECONDS.observe(seconds)
        if count and seconds > 0:
            metrics.ITEMS_PER_SECOND.set(count / seconds)
        for source, values in rewards.items():
            metrics.ITEMS.labels(source).inc(len(values))
            scored = [v for v in values if v == v]  # NaN: unscorable, not a reward (TRL)
            if scored:
                metrics.REWARD_SUM.labels(source).inc(sum(scored))
                metrics.SCORED.labels(source).inc(len(scored))
                metrics.REWARD_MEAN.labels(source).set(sum(scored) / len(scored))
        if probe_stats:
            metrics.PROBE_AUC.set(sum(a for a, _ in probe_stats) / len(probe_stats))
            metrics.PROBE_OVERCONF.set(sum(o for _, o in probe_stats) / len(probe_stats))
        if count:
            log.info("scored %d trajectories in %.2fs", count, seconds)


def serve(config: RunConfig) -> int:
    """`forage scorer serve`: the stream worker, /score over HTTP, /metrics; stops on SIGTERM."""
    from services.common.logs import setup_logging
    from services.common.metrics import start_metrics_server
    from services.common.streams import RedisStreams

    log_ = setup_logging("scorer", run_id=config.run_id, level=config.log_level)
    key, path = tokenizer_key_and_path(config)
    tokenizer = load_tokenizer(path, key)  # before the pool and Redis: a bad path fails at once
    scorer = Scorer.from_config(config.scorer).start()
    streams = RedisStreams.from_config(config.redis)
    worker = ScorerWorker(config, scorer, tokenizer, streams)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    metrics_server = start_metrics_server(config.scorer.metrics_port, host=config.scorer.host,
                                          service="scorer")
    log_.info("metrics on http://%s:%d/metrics", metrics_server.host, metrics_server.port)
    http = None
    if config.scorer.http:
        from services.scorer.app import HttpServer, create_app

        http = HttpServer(create_app(scorer, config.scorer), config.scorer.host,
                          config.scorer.port).start()
        log_.info("POST /score on http://%s:%d", config.scorer.host, http.port)
    try:
        worker.run()
    finally:
        if http is not None:
            http.stop()
        metrics_server.stop()
        scorer.close()
        streams.close()
    log_.info("scorer %s stopped", worker.name)
    return 0
