"""`forage learner train`: the RL stream loop (DESIGN.md 1, 6; issue 7 "The loop").

The learner owns the run. Each step it:
  1. issues prompt groups while admission control allows ((max_staleness + 1) × batch groups in
     flight; 0 = synchronous) and re-issues groups that timed out, went stale or failed;
  2. reads scored trajectories, de-duplicates them by sample id, drops stale ones (all counted:
     `loop_state.GroupLedger`), and takes a batch of complete groups (optionally filtering
     constant-reward groups and topping up from later ones);
  3. computes log-probs (current / reference / critic values), advantages and the loss, steps;
  4. publishes the new policy version through the weight-sync server (and a Redis notice);
  5. writes one JSON line of metrics, updates /metrics, checkpoints every `save_every` steps,
     and evaluates greedily on the test set through the rollout service when due.

With max_staleness ≥ 1 the next batch's groups are issued *before* the training step, so the
rollout replicas generate while the learner trains (the overlap bench/pipeline.py measures);
with 0 they are issued after the new weights are published (on-policy).

Ranks: rank 0 talks to Redis and serves weights; every other rank follows its commands (a
broadcast int per collective operation), so ZeRO-3 gathers and gradient reductions stay in step.
Scored stream messages are acked as soon as the ledger holds them: a learner that dies loses only
in-memory samples, and its checkpointed ledger re-issues every group that was in flight.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.codec import CodecError, decode_as, encode
from services.common.config import RunConfig
from services.common.trajectory import ScoredTrajectory
from services.learner import distributed as D
from services.learner import loop_metrics as M
from services.learner.algorithms import AlgorithmSettings
from services.learner.algorithms.filters import filter_groups
from services.learner.batch_stats import probe_metrics, trajectory_metrics
from services.learner.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from services.learner.loop_state import GroupLedger
from services.learner.packing import Sample
from services.learner.prompts import PromptSource, group_from_row, load_dataset
from services.learner.rl_batch import assign_advantages, check_estimator, samples_of

log = logging.getLogger("forage.learner.loop")

# Commands rank 0 broadcasts to the other ranks before each collective operation.
CMD_STOP, CMD_STEP, CMD_SAVE, CMD_EXPORT = 0, 1, 2, 3


def _broadcast_command(command: int = -1) -> int:
    if D.world_size() == 1:
        return command
    import torch.distributed as dist

    tensor = torch.tensor([command], dtype=torch.int64, device=D.device())
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def broadcast_fields(samples: list[Sample], names: tuple[str, ...]) -> None:
    """Rank 0's per-token fields `names` onto every rank's copy of the same samples."""
    if D.world_size() == 1 or not samples:
        return
    import torch.distributed as dist

    total = sum(len(s) for s in samples)
    if D.rank() == 0:
        flat = np.concatenate([s.fields[n] for n in names for s in samples])
        buffer = torch.from_numpy(flat).to(D.device())
    else:
        buffer = torch.zeros(total * len(names), dtype=torch.float32, device=D.device())
    dist.broadcast(buffer, 0)
    if D.rank() == 0:
        return
    host = buffer.cpu().numpy()
    pos = 0
    for name in names:
        for sample in samples:
            sample.set_field(name, host[pos : pos + len(sample)])
            pos += len(sample)


def jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """Plain floats/ints (NaN and inf as null, which JSON has no literal for)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, (bool, int, str)) or value is None:
            out[key] = value
        else:
            number = float(value)
            out[key] = number if np.isfinite(number) else None
    return out


class LearnerLoop:
    def __init__(self, cfg: RunConfig, *, resume: bool = False) -> None:
        learner = cfg.learner
        check_estimator(learner.adv_estimator)
        if not cfg.model.path:
            raise ValueError("model.path is not set (the policy to train)")
        if not cfg.data.train_files:
            raise ValueError("data.train_files is empty (parquet files of prompts)")
        self.cfg = cfg
        self.learner = learner
        self.resume = resume
        self.options = AlgorithmSettings.model_validate(dict(learner.algorithm))
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(learner.checkpoint_dir or self.run_dir / "checkpoints")
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rank = D.rank()
        self.stopping = False
        self.started = time.monotonic()
        self.state = TrainerState()
        self.version = 1
        self.last_saved_step = -1
        # Driver-only state (rank 0).
        self.streams: Any = None
        self.server: Any = None
        self.metrics_server: Any = None
        self.ledger: GroupLedger | None = None
        self.source: PromptSource | None = None
        self.train_rows: list[dict[str, Any]] = []
        self.test_rows: list[dict[str, Any]] = []
        self.eval_results: dict[str, ScoredTrajectory] = {}
        self.eval_pending: set[str] = set()
        self.filtered_in_a_row = 0
        self.last_lag_update = 0.0
        self.consumer = f"learner-{self.rank}"

    # ================================================================== set-up

    def _build_trainer(self) -> None:
        from transformers import AutoTokenizer

        from services.learner.trainer import PolicyTrainer

        opt = self.options
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_path
                                                  or self.cfg.model.path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.trainer = PolicyTrainer(
            self.cfg.model.path, self.learner,
            use_ref=opt.use_kl_loss or opt.use_kl_in_reward,
            use_critic=self.learner.adv_estimator == "gae",
            pad_token_id=pad,
        )
        self.bnpo_state = opt.make_bnpo_state() if self.learner.adv_estimator == "bnpo" else None
        self.kl_controller = opt.make_kl_controller() if opt.use_kl_in_reward else None

    def _restore(self) -> None:
        """Load the last complete checkpoint (every rank), or start fresh."""
        path = latest_checkpoint(self.ckpt_dir) if self.resume else None
        if path is None:
            if self.resume:
                log.info("no checkpoint under %s; starting fresh", self.ckpt_dir)
            return
        self.state = load_checkpoint(self.trainer, path)
        self.last_saved_step = self.state.step
        cursor = self.state.data_cursor
        if self.bnpo_state is not None and cursor.get("bnpo"):
            self.bnpo_state.load_state_dict(cursor["bnpo"])
        if self.kl_controller is not None and "kl_coef" in cursor:
            self.kl_controller.value = float(cursor["kl_coef"])
        log.info("resumed from %s at step %d (policy version %d)", path, self.state.step,
                 self.state.policy_version)

    def _start_driver(self) -> None:
        from services.common.metrics import start_metrics_server
        from services.common.streams import RedisStreams
        from services.common.weight_sync import WeightSyncServer

        cfg, learner = self.cfg, self.learner
        self.train_rows = load_dataset(cfg.data.train_files)
        self.test_rows = load_dataset(cfg.data.test_files, cfg.data.max_test_items)
        self.source = PromptSource(self.train_rows, cfg.data.seed, cfg.data.shuffle)
        cursor = self.state.data_cursor
        if cursor.get("prompts"):
            self.source.restore(cursor["prompts"])
        if cursor.get("ledger"):
            self.ledger = GroupLedger.from_dict(cursor["ledger"])
            # The run's bounds come from the config, not from the checkpoint.
            self.ledger.max_staleness = learner.max_staleness
            self.ledger.train_batch_size = learner.train_batch_size
            self.ledger.timeout_s = learner.group_timeout_s
            self.ledger.max_attempts = learner.max_attempts
        else:
            self.ledger = GroupLedger(
                max_staleness=learner.max_staleness, train_batch_size=learner.train_batch_size,
                timeout_s=learner.group_timeout_s, max_attempts=learner.max_attempts,
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.state.step > 0 or self.metrics_path.exists():
            self._trim_metrics()
        self.streams = RedisStreams.from_config(cfg.redis)
        for kind in ("prompts", "scored"):
            self.streams.ensure_group(kind)
        self.streams.ensure_group("rollouts")
        # Never re-use a version number: a learner killed after publishing version v but before
        # checkpointing it would otherwise publish different weights under the same number, and
        # replicas that already hold v would never fetch them.
        previous = self._published_version()
        self.version = max(self.state.policy_version, previous, 0) + 1
        self.ledger.advance(max(self.ledger.current_version, self.version))
        self.server = WeightSyncServer(
            learner.weight_sync_host, learner.weight_sync_port, token=learner.weight_sync_token,
            chunk_bytes=learner.weight_sync_chunk_bytes,
        ).start()
        self.metrics_server = start_metrics_server(learner.metrics_port, host="0.0.0.0",
                                                   healthy=lambda: not self.stopping)
        log.info("weights on %s, metrics on port %d, checkpoints in %s", self.server.address,
                 self.metrics_server.port, self.ckpt_dir)

    def _published_version(self) -> int:
        from services.common.weight_sync.notify import version_key

        raw = self.streams.client.get(version_key(self.streams.namespace))
        try:
            return int(raw) if raw is not None else 0
        except (TypeError, ValueError):
            return 0

    def _trim_metrics(self) -> None:
        """Drop metric lines a killed run wrote after its last checkpoint (they are redone)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(record.get("step", 0)) <= self.state.step:
                kept.append(line)
        self.metrics_path.write_text("".join(k + "\n" for k in kept))

    # ================================================================== main

    def run(self) -> int:
        self._build_trainer()
        self._restore()
        if self.rank != 0:
            return self._follow()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._start_driver()
        try:
            self._publish_weights()
            done = set(self.state.data_cursor.get("evals_done", []))
            if self.learner.eval_before and self.state.step == 0 and 0 not in done:
                self._evaluate()
            while self.state.step < self.learner.total_steps and not self.stopping:
                if self._out_of_time():
                    log.warning("learner.max_wall_s=%.0f reached at step %d; stopping",
                                self.learner.max_wall_s, self.state.step)
                    break
                if not self._step():
                    break
            finished = self.state.step >= self.learner.total_steps
            if finished and self.learner.eval_at_end and not self.stopping:
                done = set(self.state.data_cursor.get("evals_done", []))
                if self.state.step not in done:
                    self._evaluate()
            if self.state.step != self.last_saved_step:
                self._save()
            log.info("stopped at step %d; accounting %s", self.state.step,
                     json.dumps(self.ledger.accounting()))
        finally:
            _broadcast_command(CMD_STOP)
            self._shutdown()
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.info("signal %d: finishing the current step, checkpointing, then exiting", signum)
        self.stopping = True

    def _out_of_time(self) -> bool:
        limit = self.learner.max_wall_s
        return bool(limit) and time.monotonic() - self.started > limit

    def _shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.streams is not None:
            self.streams.close()

    def _follow(self) -> int:
        """Ranks > 0: run the collective half of each command rank 0 announces."""
        while True:
            command = _broadcast_command()
            if command == CMD_STOP:
                return 0
            if command == CMD_STEP:
                self._train_collective(None, None)
            elif command == CMD_SAVE:
                save_checkpoint(self.trainer, self.ckpt_dir, TrainerState(),
                                tokenizer_from=self.cfg.model.path,
                                keep=self.learner.keep_checkpoints)
            elif command == CMD_EXPORT:
                self.trainer.state_dict_for_export()

    # ================================================================== streams

    def _publish_groups(self, groups: list[Any]) -> None:
        if groups:
            self.streams.publish_many("prompts", [encode(g) for g in groups])

    def _train_group(self, uid: str, row_index: int, attempt: int, version_min: int) -> Any:
        return group_from_row(self.train_rows[row_index], uid, self.cfg.data.n_samples,
                              policy_version_min=version_min, attempt=attempt)

    def _issue(self, version_min: int | None = None) -> int:
        """Re-issue what is due, then admit new groups up to the capacity."""
        assert self.ledger is not None and self.source is not None
        now = time.monotonic()
        version_min = self.version if version_min is None else version_min
        poll = self.ledger.poll(now)
        groups = [self._train_group(r.uid, int(r.meta["row"]), r.attempt, version_min)
                  for r in poll.reissue]
        for r in poll.reissue:
            M.GROUPS.labels(f"reissued_{r.reason}").inc()
            log.info("re-issuing group %s (attempt %d, %s)", r.uid, r.attempt, r.reason)
        for uid in poll.dropped:
            M.GROUPS.labels("dropped").inc()
            log.warning("giving up group %s after %d attempts", uid, self.learner.max_attempts)
        for _ in range(self.ledger.admissible()):
            uid, row = self.source.next()
            self.ledger.issue(uid, self.cfg.data.n_samples, now=now, meta={"row": row})
            groups.append(self._train_group(uid, row, 0, version_min))
            M.GROUPS.labels("issued").inc()
        self._publish_groups(groups)
        M.IN_FLIGHT.set(self.ledger.in_flight)
        return len(groups)

    def _receive(self, block_ms: int) -> int:
        """Read scored trajectories into the ledger (or the eval results); ack them."""
        assert self.ledger is not None
        messages = self.streams.consume("scored", self.consumer,
                                        count=self.learner.consume_batch, block_ms=block_ms)
        ids = []
        for message in messages:
            try:
                item = decode_as(message.payload, ScoredTrajectory)
            except CodecError as exc:
                log.error("dead-lettering scored message %s: %s", message.id, exc)
                self.streams.dead_letter("scored", message, f"undecodable: {exc}")
                M.TRAJECTORIES.labels("dead_letter").inc()
                continue
            ids.append(message.id)
            traj = item.trajectory
            if traj.kind == "eval":
                if traj.uid in self.eval_pending:
                    self.eval_pending.discard(traj.uid)
                    self.eval_results[traj.uid] = item
                continue
            if traj.finish_reason == "error":
                outcome = self.ledger.reject(item)
                log.warning("trajectory %s failed (%s); its group will be re-issued",
                            traj.sample_id, traj.error)
            else:
                outcome = self.ledger.add(item)
            M.TRAJECTORIES.labels(outcome).inc()
        if ids:
            self.streams.ack("scored", ids)
        now = time.monotonic()
        if now - self.last_lag_update > 2.0:
            self.last_lag_update = now
            for kind in ("prompts", "rollouts", "scored"):
                M.STREAM_LAG.labels(kind).set(self.streams.lag(kind))
        return len(messages)

    def _filter_ready(self) -> None:
        """Drop complete groups whose rewards are all equal (learner.algorithm.filter_groups)."""
        assert self.ledger is not None
        if not self.options.filter_groups:
            return
        if self.filtered_in_a_row >= self.learner.filter_max_dropped:
            return  # guard: train the next batch unfiltered rather than sample forever
        rewards = {}
        for uid in self.ledger.ready_uids():
            record = self.ledger.groups[uid]
            rewards[uid] = [float(record.samples[i].reward) for i in sorted(record.samples)]
        kept = set(filter_groups(rewards, keep_singletons=self.options.filter_keep_singletons))
        for uid in rewards:
            if uid not in kept:
                self.ledger.drop(uid)
                self.filtered_in_a_row += 1
                M.GROUPS.labels("filtered").inc()
        if self.filtered_in_a_row >= self.learner.filter_max_dropped:
            log.warning("group filter dropped %d groups without a batch forming; training the "
                        "next batch unfiltered", self.filtered_in_a_row)

    def _wait_for_batch(self) -> list[Any] | None:
        assert self.ledger is not None
        size = self.learner.train_batch_size
        while not self.stopping and not self._out_of_time():
            self._issue()
            self._filter_ready()
            if self.ledger.ready >= size:
                return self.ledger.take_batch(size)
            self._receive(self.learner.poll_ms)
        return None

    # ================================================================== step

    def _step(self) -> bool:
        learner = self.learner
        t0 = time.monotonic()
        batch = self._wait_for_batch()
        if batch is None:
            return False
        self.filtered_in_a_row = 0
        t_wait = time.monotonic() - t0
        if learner.max_staleness > 0:
            self._issue()  # the next batch generates while this one trains
        items = [s for group in batch for s in group.samples]
        samples = samples_of(items)
        t1 = time.monotonic()
        _broadcast_command(CMD_STEP)
        train_metrics, adv_metrics = self._train_collective(samples, items)
        t_train = time.monotonic() - t1
        current = self.version
        self.state.step += 1
        t2 = time.monotonic()
        self.version += 1
        self.ledger.advance(self.version)
        self._publish_weights()
        t_publish = time.monotonic() - t2
        if learner.max_staleness == 0:
            self._issue()
        record: dict[str, Any] = {"kind": "train", "step": self.state.step,
                                  "policy_version": self.version, "time": time.time(),
                                  "elapsed_s": time.monotonic() - self.started}
        record.update(trajectory_metrics(items, current_version=current))
        record.update(probe_metrics(items))
        record.update(adv_metrics)
        record.update({f"actor/{k}": v for k, v in train_metrics.items()
                       if not k.startswith("critic/")})
        record.update({k: v for k, v in train_metrics.items() if k.startswith("critic/")})
        record.update({f"groups/{k}": v for k, v in self.ledger.accounting().items()})
        step_s = time.monotonic() - t0
        tokens = sum(s.num_loss_tokens for s in samples)
        record.update({"timing/wait_s": t_wait, "timing/train_s": t_train,
                       "timing/publish_s": t_publish, "timing/step_s": step_s,
                       "throughput/trained_tokens_per_s": tokens / max(t_train, 1e-9),
                       "throughput/trajectories": len(items)})
        self._write_metrics(record)
        self._export_prometheus(record, step_s)
        log.info("step %d/%d  reward %.3f  em %.3f  searches %.2f  staleness %.2f  %.1fs "
                 "(wait %.1fs, train %.1fs)", self.state.step, learner.total_steps,
                 record.get("reward/mean", 0.0), record.get("em/mean", 0.0),
                 record.get("searches/mean", 0.0), record.get("staleness/mean", 0.0),
                 step_s, t_wait, t_train)
        if self.state.step % learner.save_every == 0:
            self._save()
        if (learner.eval_every and self.state.step % learner.eval_every == 0
                and self.state.step < learner.total_steps):
            self._evaluate()
        return True

    def _train_collective(
        self, samples: list[Sample] | None, items: list[ScoredTrajectory] | None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Everything in one step that every rank must run: log-probs, advantages, update."""
        from services.learner.trainer import broadcast_samples

        trainer = self.trainer
        samples = broadcast_samples(samples)
        trainer.compute_log_probs(samples, "policy")
        if trainer.ref is not None:
            trainer.compute_log_probs(samples, "ref")
        if trainer.critic is not None:
            trainer.compute_values(samples)
        adv_metrics: dict[str, float] = {}
        if self.rank == 0:
            assert items is not None
            adv_metrics = assign_advantages(
                samples, items, self.options, self.learner.adv_estimator,
                bnpo_state=self.bnpo_state, kl_controller=self.kl_controller,
                overconf_coeff=self.cfg.probe.overconf_coeff,
            )
        broadcast_fields(samples, ("advantages", "returns"))
        metrics = trainer.rl_step(samples)
        return metrics, adv_metrics

    # ================================================================== weights, checkpoints

    def _publish_weights(self) -> None:
        from services.common.weight_sync.notify import notify_new_version

        _broadcast_command(CMD_EXPORT)
        state_dict = self.trainer.state_dict_for_export()
        self.server.publish(state_dict, self.version)
        notify_new_version(self.streams.client, self.streams.namespace, self.version)
        M.POLICY_VERSION.set(self.version)
        log.info("published policy version %d", self.version)

    def _save(self) -> None:
        assert self.ledger is not None and self.source is not None
        self.state.policy_version = self.version
        cursor: dict[str, Any] = dict(self.state.data_cursor)
        cursor["prompts"] = self.source.cursor()
        cursor["ledger"] = self.ledger.to_dict()
        if self.bnpo_state is not None:
            cursor["bnpo"] = self.bnpo_state.state_dict()
        if self.kl_controller is not None:
            cursor["kl_coef"] = float(self.kl_controller.value)
        self.state.data_cursor = cursor
        _broadcast_command(CMD_SAVE)
        path = save_checkpoint(self.trainer, self.ckpt_dir, self.state,
                               tokenizer_from=self.cfg.model.tokenizer_path or self.cfg.model.path,
                               keep=self.learner.keep_checkpoints)
        self.last_saved_step = self.state.step
        log.info("checkpoint %s", path)

    def _write_metrics(self, record: dict[str, Any]) -> None:
        clean = jsonable(record)
        self.state.metrics_history.append(clean)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(clean) + "\n")

    def _export_prometheus(self, record: dict[str, Any], step_s: float) -> None:
        M.STEP.set(self.state.step)
        M.EM_MEAN.set(record.get("em/mean", 0.0))
        M.STALENESS_MEAN.set(record.get("staleness/mean", 0.0))
        M.STEP_SECONDS.observe(step_s)
        M.TOKENS_PER_SECOND.set(record.get("throughput/trained_tokens_per_s", 0.0))
        for phase in ("wait", "train", "publish"):
            M.PHASE_SECONDS.labels(phase).set(record.get(f"timing/{phase}_s", 0.0))
        for key, value in record.items():
            if key.startswith("reward/") and key.endswith("/mean") and key.count("/") == 2:
                M.REWARD_MEAN.labels(key.split("/")[1]).set(value)
        M.REWARD_MEAN.labels("all").set(record.get("reward/mean", 0.0))

    # ================================================================== evaluation

    def _evaluate(self) -> dict[str, Any] | None:
        """Greedy pass over the test set through the rollout service; one `eval` JSON line."""
        if not self.test_rows:
            log.info("no test rows (data.test_files); skipping evaluation")
            return None
        step, version = self.state.step, self.version
        started = time.monotonic()
        uids = [f"eval-v{version}-{i}" for i in range(len(self.test_rows))]
        groups = [group_from_row(row, uid, 1, kind="eval", policy_version_min=version)
                  for uid, row in zip(uids, self.test_rows, strict=True)]
        self.eval_results = {}
        self.eval_pending = set(uids)
        self._publish_groups(groups)
        log.info("evaluating %d test questions with policy version %d", len(uids), version)
        from tqdm import tqdm

        bar = tqdm(total=len(uids), desc=f"eval v{version}", leave=False)
        deadline = started + self.learner.eval_timeout_s
        while self.eval_pending and time.monotonic() < deadline and not self.stopping:
            self._receive(self.learner.poll_ms)
            self._issue()  # keep re-issue bookkeeping alive during a long evaluation
            bar.update(len(self.eval_results) - bar.n)
        bar.close()
        items = [self.eval_results[u] for u in uids if u in self.eval_results]
        if self.eval_pending:
            log.warning("evaluation: %d of %d results missing after %.0fs", len(self.eval_pending),
                        len(uids), time.monotonic() - started)
        metrics = trajectory_metrics(items, prefix="eval/")
        record: dict[str, Any] = {"kind": "eval", "step": step, "policy_version": version,
                                  "time": time.time(),
                                  "elapsed_s": time.monotonic() - self.started,
                                  "eval/n": len(items), "eval/missing": len(self.eval_pending),
                                  "eval/em": metrics.get("eval/em/mean"),
                                  "eval/reward": metrics.get("eval/reward/mean"),
                                  "eval/seconds": time.monotonic() - started}
        record.update(metrics)
        self._write_metrics(record)
        if record["eval/em"] is not None:
            M.EVAL_EM.set(record["eval/em"])
        self.eval_pending = set()
        done = list(self.state.data_cursor.get("evals_done", []))
        self.state.data_cursor["evals_done"] = sorted(set(done) | {step})
        log.info("eval at step %d: em %.3f over %d questions (searches %.2f) in %.0fs", step,
                 record["eval/em"] or 0.0, len(items), metrics.get("eval/searches/mean", 0.0),
                 record["eval/seconds"])
        return record


def train(cfg: RunConfig, resume: bool = False,
          loop_factory: Callable[..., LearnerLoop] = LearnerLoop) -> int:
    """`forage learner train`: run the loop (one process per rank under a launcher)."""
    return loop_factory(cfg, resume=resume).run()
