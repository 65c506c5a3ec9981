"""A DeepSpeed engine around one trainable model (the policy, or the critic for GAE).

Why a client optimizer: DeepSpeed's own CPU/fused Adam variants need a compiled op, while a
torch.optim.AdamW handed to `deepspeed.initialize` works on every stage (0-3) and device; ZeRO
wraps it and partitions its state. `optimizer: cpu_adam` picks DeepSpeedCPUAdam instead (gcc
builds it on first use), the usual choice with ZeRO-offload.

Why we drive the accumulation boundary ourselves: packed micro-batches make the number of
micro-batches per optimizer step vary with the lengths in the batch, while DeepSpeed's
`gradient_accumulation_steps` is fixed at start-up. We mark the last micro-batch as the boundary
(`set_gradient_accumulation_boundary`) and scale the loss ourselves (exact global token counts),
so DeepSpeed never divides by its own accumulation count (`scale_wrt_gas=False`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from services.common.config.learner import LearnerSection


def use_bf16(setting: str, device: torch.device) -> bool:
    if setting == "on":
        return True
    if setting == "off":
        return False
    return device.type == "cuda"


def ds_config(cfg: LearnerSection, bf16: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(cfg.grad_clip),
        "zero_optimization": {"stage": int(cfg.zero_stage)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


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
    ) -> None:
        import deepspeed

        self.bf16 = use_bf16(cfg.bf16, device)
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.optimizer == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(
                params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, adamw_mode=True
            )
        else:
            optimizer = torch.optim.AdamW(
                params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_lambda(cfg.warmup_steps, total_steps, cfg.lr_schedule)
        )
        model.to(device)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config(cfg, self.bf16),
            dist_init_required=False,
        )
        self.zero_stage = int(cfg.zero_stage)
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

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full-precision weights on every rank's CPU (ZeRO-3 shards gathered); rank-local."""
        if self.zero_stage == 3:
            import deepspeed

            params = list(self.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def save(self, directory: str, tag: str) -> None:
        """DeepSpeed's sharded model + optimizer + scheduler state (every rank writes its part)."""
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
