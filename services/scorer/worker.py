"""The scorer service: rollouts stream in (group `scorer`), scored stream out (DESIGN.md 3.2).

One batch: decode each message (CodecError → dead letter), decode its response tokens to text,
score the reward and the probe samples of the whole batch in one Scorer call (math_verify in
the worker-process pool), publish the ScoredTrajectory records, and only then ack. A record
whose data source has no reward or whose reward raises is dead-lettered with the reason.
Eval-kind trajectories are scored like train ones. A scorer that dies mid-batch leaves its
messages pending; another one reclaims them after `redis.visibility_timeout_s` (at least once).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from services.common.codec import CodecError, decode_as, encode
from services.common.config import RunConfig
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


@dataclass
class _Item:
    message: Any
    trajectory: Trajectory
    main: int  # index of its reward request
    probe: list[tuple[int, int]] | None = None  # (first request, count) per fraction


class ScorerWorker:
    def __init__(self, config: RunConfig, scorer: Scorer, tokenizer: Any, streams: Any,
                 name: str | None = None) -> None:
        self.config = config
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.streams = streams
        self.name = name or config.scorer.name or f"scorer-{socket.gethostname()}-{os.getpid()}"
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
        trajectories: list[tuple[Any, Trajectory]] = []
        for message in messages:
            try:
                trajectories.append((message, decode_as(message.payload, Trajectory)))
            except CodecError as exc:
                self._dead(message, f"undecodable record: {exc}", "undecodable")
        texts = self._decode_texts([t for _, t in trajectories])
        requests: list[ScoreRequest] = []
        items: list[_Item] = []
        for (message, trajectory), text in zip(trajectories, texts, strict=True):
            try:
                self.scorer.components(trajectory.data_source)
            except KeyError as exc:
                self._dead(message, str(exc), "unknown_data_source")
                continue
            item = _Item(message, trajectory, len(requests))
            requests.append(ScoreRequest(trajectory.data_source, text, trajectory.ground_truth,
                                         self._extra_info(trajectory)))
            if trajectory.probe is not None:
                suffix = default_suffix(trajectory.data_source, self.config.probe.suffix)
                item.probe = []
                for group in probe_texts(trajectory.probe, suffix):
                    item.probe.append((len(requests), len(group)))
                    requests.extend(ScoreRequest(trajectory.data_source, sample,
                                                 trajectory.ground_truth, for_probe=True)
                                    for sample in group)
            items.append(item)
        results = self.scorer.score_many(requests)
        out: list[bytes] = []
        ids: list[str] = []
        rewards: dict[str, list[float]] = defaultdict(list)
        probe_stats: list[tuple[float, float]] = []
        for item in items:
            main = results[item.main]
            failed = main.error or next(
                (results[i].error for start, n in (item.probe or [])
                 for i in range(start, start + n) if results[i].error), None)
            if failed:
                self._dead(item.message, f"reward failed: {failed}", "reward_error")
                continue
            probe_scores = None
            if item.probe is not None:
                grouped = [[results[i].score for i in range(start, start + n)]
                           for start, n in item.probe]
                summary = summarize(item.trajectory.probe.fractions, grouped)
                probe_scores = summary.per_fraction
                probe_stats.append((summary.auc, summary.overconfidence))
            record = ScoredTrajectory(item.trajectory, main.score, main.components, probe_scores)
            out.append(encode(record))
            ids.append(item.message.id)
            rewards[item.trajectory.data_source].append(main.score)
        if out:
            self.streams.publish_many("scored", out)
            self.streams.ack("rollouts", ids)
        self._observe(rewards, probe_stats, len(out), time.monotonic() - started)
        return len(out)

    def _decode_texts(self, trajectories: list[Trajectory]) -> list[str]:
        if not trajectories:
            return []
        return self.tokenizer.batch_decode(
            [t.response_ids.tolist() for t in trajectories], skip_special_tokens=True
        )

    @staticmethod
    def _extra_info(trajectory: Trajectory) -> dict[str, Any]:
        """verl's extra_info plus what the trajectory knows (for users' reward functions)."""
        info = dict(trajectory.extra)
        info.setdefault("num_searches", trajectory.num_searches)
        info.setdefault("finish_reason", trajectory.finish_reason)
        info.setdefault("num_turns", len(trajectory.turns))
        info.setdefault("kind", trajectory.kind)
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
    metrics_server = start_metrics_server(config.scorer.metrics_port, host=config.scorer.host)
    log_.info("metrics on http://%s:%d/metrics", metrics_server.host, metrics_server.port)
    http = None
    if config.scorer.http:
        from services.scorer.app import HttpServer, create_app

        http = HttpServer(create_app(scorer), config.scorer.host, config.scorer.port).start()
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
