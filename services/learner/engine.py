"""A DeepSpeed engine around one trainable model (the policy, or the critic for GAE).

Why a client optimizer: DeepSpeed's own CPU/fused Adam variants need a compiled op, while a
torch.optim.AdamW handed to `deepspeed.initialize` works on every stage (0-3) and device; ZeRO
wraps it and partitions its state. `optimizer: cpu_adam` picks DeepSpeedCPUAdam instead (gcc
builds it on first use). It needs the parameters on the CPU, so it serves a learner on CPU
only: ZeRO-Offload, which would put them there on a GPU learner, is not exposed (ds_config).

Why we drive the accumulation boundary ourselves: packed micro-batches make the number of
micro-batches per optimizer step vary with the lengths in the batch, while DeepSpeed's
`gradient_accumulation_steps` is fixed at start-up. We mark the last micro-batch as the boundary
(`set_gradient_accumulation_boundary`) and scale the loss ourselves (exact global token counts),
so DeepSpeed never divides by its own accumulation count (`scale_wrt_gas=False`).

Why fp32 gradient accumulation under bf16: the micro-batch count per step varies and can be
large, and summing many bf16 gradients loses the small ones (bf16 keeps 8 bits of mantissa), so
the DeepSpeed config asks for `data_types.grad_accum_dtype: fp32` (DeepSpeed's default for the
BF16 optimizer, made explicit). DeepSpeed 0.19 implements that mix only with ZeRO (stage 1 runs
its BF16_Optimizer: fp32 master weights and fp32 gradient buffers); without ZeRO it either
accumulates in bf16 or refuses the config. So with bf16, `zero_stage: 0` runs as stage 1
(`effective_zero_stage`), which on one rank holds the same state as stage 0 would, and on N
ranks partitions the fp32 optimizer state.

Why gather in groups for the export: under ZeRO-3 each rank holds 1/N of every parameter, and
gathering the whole model at once needs the full model in accelerator memory on every rank
besides the partitions. `full_state_dict` gathers at most `export_group_bytes` of parameters at
a time (one or a few layers), copies them to CPU and releases them.

Why only rank 0 copies: rank 0 alone serves the weights and writes the Hugging Face checkpoint,
so a host copy of the whole model on every other rank (as big as the model, each publish) was
thrown away at once. The other ranks still run every gather, in the same order, because under
ZeRO-3 they are collectives; they copy nothing. Tied weights are copied once and stay one
tensor under both names, so the weight-sync server sends them once.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from services.common.config.learner import LearnerSection
from services.learner import distributed as D
from services.learner.op_build_watch import in_own_extensions_dir, watch_build_locks

log = logging.getLogger("forage.learner.engine")

# Parameters gathered at once by the ZeRO-3 weight export: a few decoder layers of a 7B model
# (one Qwen2.5-7B layer is ~0.47 GB in bf16), small next to the activations of a step.
EXPORT_GROUP_BYTES = 1 << 30


def use_bf16(setting: str, device: torch.device) -> bool:
    if setting == "on":
        return True
    if setting == "off":
        return False
    return device.type == "cuda"


def param_dtype(bf16: bool) -> torch.dtype:
    """The dtype the model is loaded in: the training dtype, so a bf16 run never holds an fp32
    copy of the weights on the device first (DeepSpeed keeps the fp32 master copy itself)."""
    return torch.bfloat16 if bf16 else torch.float32


def effective_zero_stage(zero_stage: int, bf16: bool) -> int:
    """bf16 needs ZeRO ≥ 1 for fp32 gradient accumulation in DeepSpeed 0.19 (module doc)."""
    return max(int(zero_stage), 1) if bf16 else int(zero_stage)


def ds_config(cfg: LearnerSection, bf16: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(cfg.grad_clip),
        "zero_optimization": {"stage": effective_zero_stage(cfg.zero_stage, bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def plan_gather_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of parameter indices whose byte sizes sum to at most `max_bytes`
    (a parameter larger than that gets a group of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    load = 0
    for index, size in enumerate(sizes):
        if current and load + size > max_bytes:
            groups.append(current)
            current, load = [], 0
        current.append(index)
        load += size
    if current:
        groups.append(current)
    return groups


def _full_bytes(param: torch.Tensor) -> int:
    """Bytes of the whole parameter (ZeRO-3 keeps its full size in `ds_numel`)."""
    numel = int(getattr(param, "ds_numel", param.numel()))
    return numel * param.element_size()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor` that owns its memory (training goes on moving the original); one
    copy from any device, where `.cpu().clone()` copied a device tensor twice."""
    return tensor.detach().to("cpu", copy=True)


def host_copies(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`host_copy` of every entry, each distinct tensor object once: names that share one
    (tied weights) share the copy, as they share the original."""
    copies: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in entries.items():
        if id(value) not in copies:
            copies[id(value)] = host_copy(value)
        out[name] = copies[id(value)]
    return out


def warmup_lambda(warmup_steps: int, total_steps: int, schedule: str):
    """LR multiplier: linear warm-up from 1/(w+1) to 1 over `warmup_steps`, then constant or a
    cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "cosine" and total_steps > warmup_steps:
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def ratio_warmup_lambda(
    warmup_ratio: float, total_steps: int, updates_per_step: int, schedule: str
):
    """LR multiplier of verl's ratio warm-up, per optimizer step.

    verl (and Search-R1's fork) builds `get_constant_schedule_with_warmup(num_warmup_steps=
    int(lr_warmup_steps_ratio x total_training_steps))` and steps it once per training step,
    after the update: training step t (from 0) runs every one of its mini-batch updates at
    LR x min(1, t / W), so step 0 runs at LR 0. Here the scheduler steps per optimizer step,
    so t = optimizer step // `updates_per_step` (the fixed number of updates one RL step
    takes) gives the same LR at every update. After the warm-up: constant, or a cosine decay
    to 0 at `total_steps` (in training steps).
    """
    warmup = int(warmup_ratio * total_steps)
    per_step = max(1, int(updates_per_step))

    def factor(step: int) -> float:
        t = step // per_step
        if warmup > 0 and t < warmup:
            return t / warmup
        if schedule == "cosine" and total_steps > warmup:
            progress = min(1.0, (t - warmup) / max(1, total_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def lr_multiplier(cfg: LearnerSection, total_steps: int, warmup_ratio: float | None,
                  updates_per_step: int):
    """The LR multiplier per optimizer step for `total_steps` training steps of
    `updates_per_step` optimizer steps each.

    With `warmup_ratio`: verl's warm-up counted in training steps. Without: `cfg.warmup_steps`
    optimizer steps, and the cosine horizon is the run's optimizer-step count
    (total_steps x updates_per_step) — counting it in training steps made the decay reach 0
    after 1/updates_per_step of an RL run whose steps take several mini-batch updates.
    """
    if warmup_ratio is not None:
        return ratio_warmup_lambda(warmup_ratio, total_steps, updates_per_step, cfg.lr_schedule)
    return warmup_lambda(cfg.warmup_steps, total_steps * max(1, int(updates_per_step)),
                         cfg.lr_schedule)


def rl_updates_per_step(cfg: LearnerSection, n_samples: int) -> int:
    """Optimizer steps one RL training step takes: PPO epochs x mini-batches of the batch's
    train_batch_size x n_samples sequences (`learner.mini_batch_size`; 0 = one mini-batch)."""
    sequences = cfg.train_batch_size * n_samples
    mini = cfg.mini_batch_size if 0 < cfg.mini_batch_size < sequences else sequences
    return cfg.ppo_epochs * -(-sequences // mini)


class TrainEngine:
    """One model under DeepSpeed: forward, masked-accumulation backward, stepping, state."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: LearnerSection,
        *,
        lr: float,
        total_steps: int,
        device: torch.device,
        export_group_bytes: int = EXPORT_GROUP_BYTES,
        warmup_ratio: float | None = None,
        updates_per_step: int = 1,
    ) -> None:
        """`warmup_ratio` (with `updates_per_step`) selects verl's per-training-step warm-up
        (`ratio_warmup_lambda`); None keeps `cfg.warmup_steps` in optimizer steps."""
        import deepspeed

        self.bf16 = use_bf16(cfg.bf16, device)
        self.zero_stage = effective_zero_stage(cfg.zero_stage, self.bf16)
        if self.zero_stage != cfg.zero_stage:
            log.info("bf16 with learner.zero_stage %d: running ZeRO stage %d for fp32 gradient "
                     "accumulation (DeepSpeed's BF16 optimizer)", cfg.zero_stage, self.zero_stage)
        self.export_group_bytes = export_group_bytes
        self.export_groups = 0  # gathers done by the last full_state_dict (ZeRO-3)
        params = [p for p in model.parameters() if p.requires_grad]
        # DeepSpeed may JIT-build C++ ops (cpu_adam, shm_comm) here, behind lock files.
        with in_own_extensions_dir(), watch_build_locks():
            if cfg.optimizer == "cpu_adam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                optimizer = DeepSpeedCPUAdam(
                    params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, adamw_mode=True
                )
            else:
                optimizer = torch.optim.AdamW(
                    params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay
                )
            lr_factor = lr_multiplier(cfg, total_steps, warmup_ratio, updates_per_step)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
            model.to(device)
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=ds_config(cfg, self.bf16),
                dist_init_required=False,
            )
        self._norm = float("nan")

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Call after every backward; the optimizer only moves at the boundary."""
        if self.zero_stage == 0 and self.engine.is_gradient_accumulation_boundary():
            # Without ZeRO, DeepSpeed does not record the norm for a client optimizer; the
            # gradients are already all-reduced here, so the pre-clip norm is the global one.
            grads = [p.grad.detach().float() for p in self.module.parameters()
                     if p.grad is not None]
            self._norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        self.engine.step()

    def grad_norm(self) -> float:
        if self.zero_stage == 0:
            return self._norm
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return float("nan")
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def full_state_dict(self, keep: bool | None = None) -> dict[str, torch.Tensor]:
        """The model's weights (its state_dict, in the training dtype) on this rank's CPU.

        `keep` (default: on rank 0 only, the rank that serves and saves them) says whether this
        rank wants them; a rank that does not gets {} and makes no host copy. Under ZeRO-3
        every rank must call it, kept or not (the gathers are collective); parameters are
        gathered `export_group_bytes` at a time, so the device never holds the whole model.
        Tied names share one CPU tensor.
        """
        if keep is None:
            keep = D.rank() == 0
        entries = self.module.state_dict(keep_vars=True)  # name -> Parameter / buffer object
        if self.zero_stage != 3:
            self.export_groups = 0
            return host_copies(entries) if keep else {}
        return self._gathered_state_dict(entries, keep)

    def _gathered_state_dict(
        self, entries: dict[str, torch.Tensor], keep: bool
    ) -> dict[str, torch.Tensor]:
        """ZeRO-3: gather the parameters group by group (every rank, same groups in the same
        order) and, when `keep`, copy each to CPU before it is released."""
        import deepspeed

        params: list[torch.nn.Parameter] = []
        names_of: dict[int, list[str]] = {}
        buffers: dict[str, torch.Tensor] = {}
        for name, value in entries.items():
            if isinstance(value, torch.nn.Parameter):
                if id(value) not in names_of:  # tied weights: one gather, several names
                    names_of[id(value)] = []
                    params.append(value)
                names_of[id(value)].append(name)
            else:
                buffers[name] = value  # buffers are not partitioned
        out = host_copies(buffers) if keep else {}
        groups = plan_gather_groups([_full_bytes(p) for p in params], self.export_group_bytes)
        for group in groups:
            members = [params[i] for i in group]
            with deepspeed.zero.GatheredParameters(members, modifier_rank=None):
                if keep:
                    for param in members:
                        copy = host_copy(param)
                        out.update(dict.fromkeys(names_of[id(param)], copy))
        self.export_groups = len(groups)
        return {name: out[name] for name in entries} if keep else {}  # state_dict order

    def save(self, directory: str, tag: str) -> None:
        """DeepSpeed's sharded model + optimizer + scheduler state (every rank writes its part)."""
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
