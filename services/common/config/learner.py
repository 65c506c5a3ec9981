"""Learner settings: algorithm, optimisation, loop (docs/architecture.md)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config.base import Section


class LoraSettings(Section):
    """`learner.lora`: train a LoRA adapter instead of every weight (services/learner/lora.py).
    Defaults as verl's: rank 0 = off, alpha 16, every linear layer but the LM head."""

    rank: int = Field(default=0, ge=0)  # LoRA rank (0: off, every weight trains)
    alpha: float = Field(default=16.0, gt=0)  # LoRA alpha
    dropout: float = Field(default=0.0, ge=0, lt=1)  # LoRA dropout
    # "all-linear" (peft: every linear layer except the output head) or module names.
    target_modules: str | list[str] = "all-linear"
    # What replicas receive each step: "merged" full weights (any engine), or "adapter": the
    # adapter tensors alone with the base model's fingerprint, applied by the transformers
    # engine onto its own copy of the base, and by the vLLM engine through vLLM's LoRA
    # support (enable_lora; services/rollout/vllm_lora.py).
    publish: Literal["merged", "adapter"] = "merged"

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LearnerSection(Section):
    adv_estimator: str = "grpo"  # advantage estimator (docs/algorithms.md)
    lr: float = Field(default=1e-6, gt=0)  # policy learning rate
    train_batch_size: int = Field(default=8, ge=1)  # prompt groups per RL step
    total_steps: int = Field(default=100, ge=0)  # RL steps of the run
    max_staleness: int = Field(default=1, ge=0)  # versions a trained rollout may lag (0: on-policy)
    zero_stage: int = Field(default=0, ge=0, le=3)  # DeepSpeed ZeRO stage
    # None: RUN_DIR/checkpoints.
    checkpoint_dir: str | None = None  # where checkpoints go
    save_every: int = Field(default=10, ge=1)  # RL steps between checkpoints
    # Bind address of the learner's listeners (weight-sync gRPC and /metrics + /healthz);
    # 0.0.0.0 in containers and pods. `weight_sync_host` is where replicas reach the learner.
    host: str = "127.0.0.1"
    weight_sync_host: str = "127.0.0.1"  # where replicas reach the weight server
    weight_sync_port: int = Field(default=50051, ge=0, le=65535)  # weight-sync gRPC port
    weight_sync_token: str | None = None  # bearer token (FORAGE_WEIGHT_SYNC_TOKEN)
    # TLS for weight sync (docs/weight_sync.md "TLS"); all three or none (null: plain gRPC),
    # also from FORAGE_WEIGHT_SYNC_TLS_CERT_FILE, _KEY_FILE and _CA_FILE: the weight server's
    # certificate and key, and the CA replicas check it with.
    weight_sync_tls_cert_file: str | None = None
    weight_sync_tls_key_file: str | None = None  # weight server certificate's private key
    # The CA replicas verify the weight server and each other's relays with.
    weight_sync_tls_ca_file: str | None = None
    # Bytes per streamed weight chunk.
    weight_sync_chunk_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Concurrent Fetch streams the weight server takes (null: 14) and per client address (null:
    # half of max_fetches); more are answered "busy" and retried (docs/weight_sync.md).
    weight_sync_max_fetches: int | None = Field(default=None, ge=1)
    # Concurrent Fetch streams per client address (null: half of weight_sync_max_fetches).
    weight_sync_max_fetches_per_peer: int | None = Field(default=None, ge=1)
    # Relay fan-out (docs/weight_sync.md "Relays"): "auto" sends each replica to one that already
    # receives the version, so the learner streams about one copy per version whatever the
    # number of replicas; "off": every replica pulls from the learner. Fanout: children one
    # relay feeds at once (1: a pipelined chain, each uplink carries one copy).
    weight_sync_relay: Literal["auto", "off"] = "auto"  # relay fan-out of new weights, or off
    weight_sync_relay_fanout: int = Field(default=1, ge=1)  # children per relay
    metrics_port: int = Field(default=0, ge=0, le=65535)  # /metrics and /healthz port (0: any free)
    seed: int = 0  # seed of the learner's RNGs
    # Free-form estimator / loss options passed through to services.learner.algorithms.
    algorithm: dict[str, Any] = Field(default_factory=dict)

    # --- Training (services/learner/trainer.py, engine.py; docs/learner.md) ---
    # Token budget of one packed micro-batch: sequences are concatenated into one row (position
    # ids restart per sequence) up to this many tokens, so no compute is spent on padding.
    micro_batch_tokens: int = Field(default=4096, ge=1)
    # Compute each prompt once per row for the samples that repeat it (a GRPO group): the same
    # log-probs and gradients for a fraction of the tokens (packing.py "shared prompts"). Off
    # by itself on the flash-attn path, whose varlen kernel cannot take the mask it needs
    # (docs/learner.md, "Shared prefixes").
    shared_prompts: bool = True
    # The attention kernel for packed rows (services/learner/attention.py; docs/learner.md
    # "GPU settings"): "flash" (flash-attn varlen: CUDA, bf16/fp16, the flash_attn package),
    # "flex" (PyTorch FlexAttention block masks: CUDA), "sdpa" (a dense mask over the row:
    # anywhere), or "auto", the first of those three that this machine can train with. A named
    # kernel the machine cannot run stops the learner at start-up, saying why.
    attention: Literal["auto", "flash", "flex", "sdpa"] = "auto"
    # Sequences per optimizer step inside one RL batch (0: the whole batch is one mini-batch),
    # and passes over the batch (PPO epochs).
    mini_batch_size: int = Field(default=0, ge=0)
    ppo_epochs: int = Field(default=1, ge=1)  # passes over each RL batch
    # "adamw": torch.optim.AdamW handed to DeepSpeed as a client optimizer (works everywhere);
    # "cpu_adam": DeepSpeedCPUAdam (compiles an op with gcc on first use), for a learner on CPU
    # only: it needs the parameters on the CPU, and ZeRO-Offload is not exposed.
    optimizer: Literal["adamw", "cpu_adam"] = "adamw"  # the optimizer (cpu_adam: CPU learners only)
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    grad_clip: float = Field(default=1.0, ge=0)  # global gradient-norm clip; 0: none
    warmup_steps: int = Field(default=0, ge=0)  # linear LR warm-up, in optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # LR after the warm-up
    # RL only, verl's `optim.lr_warmup_steps_ratio`: warm up over int(ratio x total_steps)
    # training steps, LR x min(1, t/W) during training step t (so step 0 runs at LR 0, as in
    # verl); replaces warmup_steps. None: warmup_steps. docs/learner.md "LR schedule".
    warmup_ratio: float | None = Field(default=None, ge=0, le=1)
    # The critic's warm-up ratio (verl `critic.optim.lr_warmup_steps_ratio`); None: warmup_ratio.
    critic_warmup_ratio: float | None = Field(default=None, ge=0, le=1)
    # bf16 autocast/weights: "auto" = on when a CUDA device is used, off on CPU.
    bf16: Literal["auto", "on", "off"] = "auto"  # bf16 weights and compute (auto: on CUDA)
    # Sampling temperature the rollout used: log-probs are computed from logits / temperature.
    temperature: float = Field(default=1.0, gt=0)
    # Critic (GAE): its own learning rate; None = lr. The critic starts from the policy weights.
    critic_lr: float | None = None  # the critic's learning rate (None: lr)
    # LoRA on the policy (rank 0: off, every weight trains). docs/learner.md "LoRA".
    lora: LoraSettings = Field(default_factory=LoraSettings)
    # --- SFT warm start (`forage learner sft`) ---
    sft_epochs: int = Field(default=1, ge=1)  # SFT: passes over the demonstrations
    sft_batch_size: int = Field(default=16, ge=1)  # SFT: sequences per optimizer step
    sft_lr: float | None = None  # SFT learning rate (None: lr)
    sft_warmup_steps: int | None = Field(default=None, ge=0)  # SFT warm-up (None: warmup_steps)
    sft_max_rows: int | None = Field(default=None, ge=1)  # SFT: use the first N rows (None: all)
    sft_save_every: int = Field(default=0, ge=0)  # SFT steps between checkpoints; 0: end only
    keep_checkpoints: int = Field(default=2, ge=1)  # complete checkpoints kept; older ones go
    # Skill-gated warm start (services/learner/sft_skills.py; docs/learner.md "SFT warm start").
    # Every `sft_eval_every` steps (0: never) measure skills on held-out demonstrations; with
    # `sft_until` ({skill: threshold}, skills format / first_query / query / answer) train,
    # epochs repeating, until every listed skill reaches its threshold (not before
    # `sft_min_steps`), at most `sft_max_steps` steps (then a WARNING); sft_epochs is ignored.
    # None: a fixed length, `sft_epochs` epochs (capped by `sft_max_steps` when set).
    sft_until: dict[str, float] | None = None  # SFT until these skill thresholds are met
    sft_eval_every: int = Field(default=0, ge=0)  # SFT steps between skill measurements
    sft_min_steps: int = Field(default=0, ge=0)  # gated SFT never stops before this step
    sft_max_steps: int | None = Field(default=None, ge=1)  # most SFT steps
    # Held-out demonstrations (None: sft_heldout.parquet beside the SFT data, as `forage data
    # synth` writes it).
    sft_heldout: str | None = None  # held-out demonstrations for the skills
    # --- The RL stream loop (`forage learner train`; services/learner/loop.py) ---
    # A group not complete this long after a rollout replica took its latest issue from the
    # prompts stream is issued again (counted); after `max_attempts` issues it is given up
    # (counted) so one bad prompt cannot stall the run. The clock starts when a replica takes
    # the group, not when it is published: groups queued while replicas load (or work through
    # an evaluation) are not timed out for waiting.
    group_timeout_s: float = Field(default=300.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)  # issues of one group before it is given up
    # Scored trajectories read per poll, and how long one read blocks.
    consume_batch: int = Field(default=256, ge=1)
    poll_ms: int = Field(default=200, ge=1)  # how long one read blocks, in ms
    # Evaluation on data.test_files through the rollout service: before the first step,
    # every `eval_every` steps (0: never in between) and after the last step.
    eval_before: bool = True
    eval_every: int = Field(default=0, ge=0)  # RL steps between evaluations (0: none between)
    eval_at_end: bool = True  # evaluate after the last step
    # Early stop on a held-out plateau (services/learner/early_stop.py): from step
    # `early_stop_min_steps` on, after an evaluation, stop when none of the last
    # `early_stop_patience` evaluations (0: never stop early) beat the best one before them by
    # more than `early_stop_min_delta` (EM). Needs eval_every > 0. The run's final EM is its
    # last evaluation.
    early_stop_patience: int = Field(default=0, ge=0)  # evaluations without a new best; 0: off
    early_stop_min_steps: int = Field(default=0, ge=0)  # never stop early before this step
    early_stop_min_delta: float = Field(default=0.0, ge=0)  # EM a new best must add
    # The evaluation's time limit, counted from when a replica takes its first question.
    eval_timeout_s: float = Field(default=600.0, gt=0)
    # Questions per evaluation (0: every test row): a fixed subset, proportional per
    # data_source and chosen by a hash of each row's place in its source, so every evaluation
    # of every run on the same test files asks the same questions (prompts.eval_subset).
    eval_max_questions: int = Field(default=2000, ge=0)
    # Evaluation questions published and not yet answered, at most (0: all at once). Training
    # groups the learner issues meanwhile queue behind this window rather than behind the
    # whole test set, and an evaluation that times out leaves at most this many questions in
    # the stream. Keep it >= 2 x replicas x rollout.max_batch_size for a full-speed evaluation.
    eval_max_in_flight: int = Field(default=1024, ge=0)
    # Answers sampled per question (verl's val_kwargs.n). 1 with temperature 0 is Search-R1's
    # greedy evaluation; above 1, eval/em is the mean over each question's samples (mean@n)
    # and eval/pass@n the share of questions some sample answered, at `eval_temperature`
    # with top_p 1 and top_k off (verl's val_kwargs defaults).
    eval_samples: int = Field(default=1, ge=1)
    eval_temperature: float = Field(default=0.0, ge=0)  # evaluation sampling temperature
    # Group filter guard: after this many constant-reward groups are dropped in a row without a
    # batch forming, the next batch is trained unfiltered (logged) instead of sampling forever.
    filter_max_dropped: int = Field(default=256, ge=1)
    # Run this long at most (0: no limit); the loop then checkpoints and exits cleanly.
    max_wall_s: float = Field(default=0.0, ge=0)
    # --- What a researcher watches (services/learner/trackers.py, samples.py; docs/learner.md) ---
    # Where each train/eval metrics line goes (verl's `trainer.logger`). RUN_DIR/metrics.jsonl
    # is always written (the report, resume and progress read it); the others are optional
    # extras: pip install 'forage[tensorboard]' / '[wandb]' / '[mlflow]' / '[trackers]'.
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console", "jsonl"])
    # Every this many RL steps (0: never; evaluations always log theirs), write
    # `log_samples_n` decoded trajectories to RUN_DIR/samples.jsonl and the trackers.
    log_samples_every: int = Field(default=10, ge=0)
    log_samples_n: int = Field(default=4, ge=0)  # trajectories logged each time

    def sft_step_budget(self, examples: int) -> int:
        """SFT steps to run at most for `examples` demonstrations: the cap `sft_max_steps` when
        gated (`sft_until`), else `sft_epochs` epochs of the first `sft_max_rows` examples in
        batches of `sft_batch_size`, capped by `sft_max_steps` when set. One rule for the SFT
        loop (services/learner/sft.py) and the demo's progress bar. The LR schedule's horizon
        is this number, so with the gate the LR at step t never depends on when the gate stops:
        a run stopped early and one resumed saw the same schedule, and a cosine decay would
        reach its end only at the cap (the demo's schedule is constant after the warm-up)."""
        if self.sft_until is not None:
            return int(self.sft_max_steps or 0)
        used = min(examples, self.sft_max_rows or examples)
        epochs = math.ceil(used / self.sft_batch_size) * self.sft_epochs
        return min(epochs, self.sft_max_steps or epochs)

    @field_validator("weight_sync_relay", mode="before")
    @classmethod
    def _relay_switch(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false (and `on` as true): take them as the words."""
        return ("auto" if value else "off") if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_warmup(self) -> LearnerSection:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("set learner.warmup_steps or learner.warmup_ratio, not both")
        if self.early_stop_patience and not self.eval_every:
            raise ValueError("learner.early_stop_patience needs learner.eval_every > 0 (the "
                             "evaluations it compares)")
        if self.sft_until is not None and not self.sft_eval_every:
            raise ValueError("learner.sft_until needs learner.sft_eval_every > 0 (how often the "
                             "skills are measured)")
        if self.sft_until is not None and self.sft_max_steps is None:
            raise ValueError("learner.sft_until needs learner.sft_max_steps (the cap)")
        if self.sft_max_steps is not None and self.sft_min_steps > self.sft_max_steps:
            raise ValueError("learner.sft_min_steps is above learner.sft_max_steps")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError("learner.eval_samples > 1 needs learner.eval_temperature > 0: "
                             "greedy answers to one question are all the same")
        tls = {"weight_sync_tls_cert_file": self.weight_sync_tls_cert_file,
               "weight_sync_tls_key_file": self.weight_sync_tls_key_file,
               "weight_sync_tls_ca_file": self.weight_sync_tls_ca_file}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(f"learner.{k}" for k, v in tls.items() if not v)
            raise ValueError(f"weight-sync TLS needs the server's certificate and key and the "
                             f"CA replicas verify it with; missing {missing}")
        return self
