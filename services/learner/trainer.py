"""The policy trainer: log-probs, SFT and PPO-family updates on DeepSpeed, over packed batches.

Every rank holds the same global batch (rank 0 reads it from the streams and broadcasts it; see
`broadcast_samples`), computes the same micro-batch plan, and works on its own share. Loss
normalisation is global: a micro-batch's loss is its token-loss sum divided by the token count
of the whole mini-batch over all ranks (and sequence-mean modes by the global sequence count),
multiplied by the world size because DeepSpeed averages gradients over ranks. The gradient is
therefore the same as one process computing the mini-batch loss in one piece, whatever the
number of ranks and micro-batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.common.config.learner import LearnerSection
from services.common.paths import LOCAL_ONLY
from services.learner import distributed as D
from services.learner.attention import (
    SDPA,
    choose_attention,
    flash_attn_installed,
    flex_installed,
    forward_kwargs,
)
from services.learner.engine import TrainEngine, param_dtype, use_bf16
from services.learner.logprobs import (
    KeptLogits,
    keeps_logits,
    token_entropy,
    token_logprobs,
    token_sum_pi_squared,
    token_values,
)
from services.learner.packing import (
    MicroBatch,
    Sample,
    pack,
    plan_micro_batches,
    plan_shared_rows,
    split_mini_batches,
)

if TYPE_CHECKING:
    from services.learner.algorithms import AlgorithmSettings

log = logging.getLogger("forage.learner.trainer")


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = SDPA, gradient_checkpointing: bool = False):
    """A causal LM read from a local directory (never the hub), directly in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **LOCAL_ONLY
    )
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.to(device)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Non-reentrant checkpointing (as TRL and verl configure it): it works with inputs that need
    no gradient and with ZeRO-3's parameter hooks. The KV cache is off in every training
    forward (`use_cache=False` is passed on each call), so checkpointing never meets a cache;
    the model's config is left as it is, so an exported checkpoint still generates with one.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers ≥ 5.x name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class PolicyTrainer:
    """Policy (and optional frozen reference and critic) on DeepSpeed."""

    # The constant divisor of seq-mean-token-sum-norm (Dr. GRPO) when
    # learner.algorithm.max_response_len is unset: the RL loop sets rollout.max_response_length.
    # A per-micro-batch width would make the loss depend on how the batch is packed.
    max_response_length: int | None = None

    def __init__(
        self,
        model_path: str,
        cfg: LearnerSection,
        *,
        lr: float | None = None,
        total_steps: int | None = None,
        use_ref: bool = False,
        use_critic: bool = False,
        pad_token_id: int = 0,
        gradient_checkpointing: bool = False,
        updates_per_step: int | None = None,
    ) -> None:
        """`updates_per_step` (optimizer steps per RL step; the RL loop passes it) enables
        `learner.warmup_ratio` / `critic_warmup_ratio`, verl's warm-up counted in RL steps."""
        D.ensure_distributed()
        self.cfg = cfg
        self.rank = D.rank()
        self.world_size = D.world_size()
        self.device = D.device()
        self.pad_token_id = pad_token_id
        self.temperature = float(cfg.temperature)
        # learner.algorithm validated by the algorithms package (errors name the bad key).
        from services.learner.algorithms import AlgorithmSettings

        self.options = AlgorithmSettings.model_validate(dict(cfg.algorithm))
        steps = cfg.total_steps if total_steps is None else total_steps
        torch.manual_seed(cfg.seed)
        self.dtype = param_dtype(use_bf16(cfg.bf16, self.device))
        # The kernel for packed rows (attention.py): flash-attn varlen, FlexAttention block
        # masks, or SDPA's dense mask; a named one this machine lacks fails here, before loading.
        on_cuda = self.device.type == "cuda"
        self.attention = choose_attention(
            cfg.attention, self.device.type, self.dtype,
            flash_installed=on_cuda and flash_attn_installed(),
            flex_installed=flex_installed(self.device.type),
        )
        self.attn_implementation = self.attention.implementation
        # One copy of each group's prompt per row (packing.py); flash-attn's varlen kernel
        # cannot take the mask that needs, so the flash path never shares.
        self.share_prompts = cfg.shared_prompts and self.attention.shares_prompts
        log.info("policy in %s, attention %s (%s), gradient checkpointing %s, shared prompts %s",
                 str(self.dtype).removeprefix("torch."), self.attn_implementation,
                 self.attention.reason, "on" if gradient_checkpointing else "off",
                 "on" if self.share_prompts else "off")
        policy = load_causal_lm(model_path, self.device, self.dtype, self.attn_implementation,
                                gradient_checkpointing)
        # Logits only where a loss reads them (logprobs.KeptLogits); the reference model is
        # the same class.
        self.keep_logits = keeps_logits(policy)
        # LoRA: the base weights freeze and only the adapter trains (services/learner/lora.py);
        # TrainEngine hands DeepSpeed the parameters that require grad, so the optimizer state
        # is the adapter's alone.
        self.lora = cfg.lora if cfg.lora.enabled else None
        if self.lora is not None:
            from services.learner.lora import apply_lora

            policy = apply_lora(policy, self.lora)
            trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
            log.info("LoRA rank %d, alpha %g on %s: %d of %d parameters train", self.lora.rank,
                     self.lora.alpha, self.lora.target_modules, trained,
                     sum(p.numel() for p in policy.parameters()))
        ratio = critic_ratio = None  # SFT and direct use: cfg.warmup_steps
        if updates_per_step is not None:
            ratio = cfg.warmup_ratio
            critic_ratio = ratio if cfg.critic_warmup_ratio is None else cfg.critic_warmup_ratio
        per_step = updates_per_step or 1
        self.policy = TrainEngine(
            policy, cfg, lr=lr if lr is not None else cfg.lr, total_steps=steps, device=self.device,
            warmup_ratio=ratio, updates_per_step=per_step,
        )
        self.ref: torch.nn.Module | None = None
        if use_ref:
            self.ref = load_causal_lm(model_path, self.device, self.dtype,
                                      self.attn_implementation).eval()
            self.ref.requires_grad_(False)
        self.critic: TrainEngine | None = None
        if use_critic:
            from transformers import AutoModelForTokenClassification

            critic = AutoModelForTokenClassification.from_pretrained(
                model_path, num_labels=1, dtype=self.dtype,
                attn_implementation=self.attn_implementation, **LOCAL_ONLY
            )
            if gradient_checkpointing:
                enable_gradient_checkpointing(critic)
            self.critic = TrainEngine(
                critic,
                cfg,
                lr=cfg.critic_lr if cfg.critic_lr is not None else cfg.lr,
                total_steps=steps,
                device=self.device,
                warmup_ratio=critic_ratio,
                updates_per_step=per_step,
            )

    # ------------------------------------------------------------------ shared machinery

    def _plan(self, samples: Sequence[Sample], indices: Sequence[int]) -> list[list[int]]:
        """This rank's micro-batches: bins of at most micro_batch_tokens computed tokens,
        the same plan on every rank. With shared prompts a bin holds whole prompt groups and
        counts the batch's common prefix once (packing.plan_shared_rows)."""
        budget = self.cfg.micro_batch_tokens
        if self.share_prompts:
            plan = plan_shared_rows(samples, indices, self.world_size, budget)
            return plan[self.rank]
        lengths = [len(samples[i]) for i in indices]
        plan = plan_micro_batches(lengths, self.world_size, budget)
        return [[indices[j] for j in micro] for micro in plan[self.rank]]

    def _pack(self, samples: Sequence[Sample], micro: Sequence[int]) -> MicroBatch:
        return pack(samples, micro, self.pad_token_id, self.share_prompts,
                    dense_mask=self.attention.dense_mask).to(self.device)

    def _gather_field(
        self,
        samples: Sequence[Sample],
        name: str,
        compute: Callable[[MicroBatch], torch.Tensor],
    ) -> None:
        """Compute a per-token field for every sample, each rank on its share, then share."""
        self._gather_fields(samples, (name,), lambda mb: {name: compute(mb)})

    def _gather_fields(
        self,
        samples: Sequence[Sample],
        names: Sequence[str],
        compute: Callable[[MicroBatch], dict[str, torch.Tensor]],
    ) -> None:
        """Per-token fields `names` from one forward per micro-batch, each rank on its share
        (`_token_values`), stored on every sample."""
        values = self._token_values(samples, list(range(len(samples))), names, compute)
        for name, per_sample in values.items():
            for index, sample in enumerate(samples):
                sample.set_field(name, per_sample[index])

    def _token_values(
        self,
        samples: Sequence[Sample],
        indices: Sequence[int],
        names: Sequence[str],
        compute: Callable[[MicroBatch], dict[str, torch.Tensor]],
    ) -> dict[str, dict[int, np.ndarray]]:
        """Per-token values `names` of `samples[indices]` ({name: {index: (len,) float32}}) from
        one forward per micro-batch of the same plan an update over `indices` uses, each rank on
        its share; every rank gets all of them.

        The exchange is a SUM all-reduce of one flat buffer per field over all the samples'
        tokens (every rank knows every length), so nothing is serialised between ranks.
        """
        position = {index: k for k, index in enumerate(indices)}
        offsets = np.cumsum([0] + [len(samples[i]) for i in indices])
        buffers = {name: torch.zeros(int(offsets[-1]), dtype=torch.float32, device=self.device)
                   for name in names}
        for micro in self._plan(samples, indices):
            mb = self._pack(samples, micro)
            outputs = compute(mb)
            for name, buffer in buffers.items():
                values = outputs[name]
                for row, index in enumerate(mb.sample_indices):
                    start, n = int(offsets[position[index]]), mb.seq_lens[row]
                    buffer[start : start + n] = mb.sample_values(values, row).float()
        out: dict[str, dict[int, np.ndarray]] = {}
        for name, buffer in buffers.items():
            D.all_reduce_sum(buffer)
            host = buffer.cpu().numpy()
            out[name] = {index: host[offsets[k] : offsets[k + 1]]
                         for k, index in enumerate(indices)}
        return out

    @torch.no_grad()
    def loss_token_entropies(
        self, samples: Sequence[Sample], indices: Sequence[int]
    ) -> tuple[dict[int, np.ndarray], torch.Tensor | None]:
        """TRL `top_entropy_quantile`'s inputs for the mini-batch `samples[indices]`: each
        sample's per-token entropy under the current policy (one no-grad forward per
        micro-batch, packed as the update packs them; temperature applied, float32) and the
        keep threshold, the (1 - top_entropy_quantile) quantile of the entropies of every loss
        token of the mini-batch on all ranks (None: no loss token). Same on every rank.

        TRL pools the loss tokens of one forward over all processes; here the pool is the
        optimizer step's, so the selection does not depend on the micro-batch packing (the
        same as TRL with one forward per optimizer step). Costs one forward per mini-batch."""
        from services.learner import algorithms as alg

        self.policy.eval()

        def compute(mb: MicroBatch) -> dict[str, torch.Tensor]:
            kept = self._kept(mb)
            with self._autocast():
                logits = self._forward(self.policy, mb, kept).logits
            return {"entropy": token_entropy(logits, self.temperature, kept)}

        entropies = self._token_values(samples, indices, ("entropy",), compute)["entropy"]
        pooled = np.concatenate([entropies[i][samples[i].loss_mask > 0] for i in indices]
                                or [np.zeros(0, dtype=np.float32)])
        threshold = alg.entropy_threshold(torch.from_numpy(pooled),
                                          self.options.top_entropy_quantile)
        return entropies, threshold

    @torch.no_grad()
    def compute_log_probs(
        self, samples: Sequence[Sample], which: str = "policy", name: str | None = None,
        sum_pi_squared: bool = False,
    ) -> None:
        """Fill `old_logprobs` (policy) or `ref_logprobs` (reference) for every sample; with
        `sum_pi_squared` also the field of that name (sum over the vocabulary of p^2 of the
        distribution that predicted each token, from the same forward pass; the optimal token
        baseline estimators need it, verl's actor.calculate_sum_pi_squared)."""
        if which == "policy":
            model: Any = self.policy
            self.policy.eval()
        elif which == "ref":
            if self.ref is None:
                raise RuntimeError("no reference model (construct with use_ref=True)")
            model = self.ref
        else:
            raise ValueError(f"unknown model {which!r}")
        target = name or ("old_logprobs" if which == "policy" else "ref_logprobs")

        def compute(mb: MicroBatch) -> dict[str, torch.Tensor]:
            kept = self._kept(mb)
            with self._autocast():
                logits = self._forward(model, mb, kept).logits
            out = {target: token_logprobs(logits, mb.input_ids, self.temperature, kept)}
            if sum_pi_squared:
                out["sum_pi_squared"] = token_sum_pi_squared(logits, self.temperature, kept)
            return out

        names = (target, "sum_pi_squared") if sum_pi_squared else (target,)
        self._gather_fields(samples, names, compute)

    @torch.no_grad()
    def compute_values(self, samples: Sequence[Sample]) -> None:
        if self.critic is None:
            raise RuntimeError("no critic (construct with use_critic=True)")
        self.critic.eval()

        def compute(mb: MicroBatch) -> torch.Tensor:
            return token_values(self._forward(self.critic, mb).logits)

        self._gather_field(samples, "values", compute)

    def _forward(self, model: Any, mb: MicroBatch, kept: KeptLogits | None = None) -> Any:
        """One forward over a packed row, no KV cache: position ids restarting per sequence,
        plus what the kernel needs to keep sequences apart (attention.forward_kwargs: the
        boundaries for flash-attn, a shared row's block mask for flex or dense mask for SDPA).
        With `kept`, logits at those positions only."""
        extra = {} if kept is None else {"logits_to_keep": kept.positions}
        return model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                     **forward_kwargs(self.attn_implementation, mb), **extra)

    def _kept(self, mb: MicroBatch) -> KeptLogits | None:
        """The policy's (and reference's) forward computes logits only at the positions that
        predict a loss token; None (every position) when the model cannot, or when the row has
        no loss token (a dummy pass keeps its full forward, so every weight sees a backward)."""
        if not self.keep_logits:
            return None
        positions = mb.logit_positions
        return KeptLogits(positions, mb.num_tokens) if positions.numel() else None

    def _kept_in(self, mb: MicroBatch, logits: torch.Tensor) -> KeptLogits | None:
        """Which positions `logits` (given to a loss) hold: every one when it spans the row
        (a caller's own full forward), else the kept ones `_policy_out` computed."""
        return None if logits.shape[1] == mb.num_tokens else self._kept(mb)

    def _autocast(self):
        if self.policy.bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def _counts(
        self, samples: Sequence[Sample], indices: Sequence[int], step_rows: bool = False
    ) -> tuple[float, float]:
        """Loss tokens and loss rows of `samples[indices]`: a row is a sequence, or each of its
        steps with `step_rows` (rllm; learner.algorithm.loss_rows)."""
        from services.learner.algorithms import count_step_rows

        tokens = sum(samples[i].num_loss_tokens for i in indices)
        if step_rows:
            _require_step_index(samples, indices)
            seqs = sum(count_step_rows(samples[i].fields["step_index"], samples[i].loss_mask)
                       for i in indices)
        else:
            seqs = sum(1 for i in indices if samples[i].num_loss_tokens > 0)
        return float(max(tokens, 1)), float(max(seqs, 1))

    def _run_update(
        self,
        engine: TrainEngine,
        samples: Sequence[Sample],
        indices: Sequence[int],
        loss_fn: Callable[[MicroBatch, torch.Tensor, float, float], tuple[torch.Tensor, dict]],
        model_out: Callable[[MicroBatch], torch.Tensor],
        step_rows: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `samples[indices]`, micro-batched; returns summed metrics."""
        engine.train()
        tokens, seqs = self._counts(samples, indices, step_rows)
        metrics: dict[str, float] = {}
        computed = padding = 0
        plan = self._plan(samples, indices)
        for k, micro in enumerate(plan):
            mb = self._pack(samples, micro)
            computed += mb.num_tokens
            padding += mb.num_padding
            out = model_out(mb)
            if not micro:  # dummy pass: keeps ranks in step, contributes exactly zero
                loss, parts = out.float().sum() * 0.0, {}
            else:
                loss, parts = loss_fn(mb, out, tokens, seqs)
            engine.backward(loss * self.world_size, boundary=k == len(plan) - 1)
            engine.step()
            for key, value in parts.items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        totals = torch.tensor([computed, padding], dtype=torch.float64, device=self.device)
        D.all_reduce_sum(totals)
        metrics["grad_norm"] = engine.grad_norm()
        metrics["lr"] = engine.current_lr()
        metrics["tokens_computed"] = float(totals[0])
        metrics["padding_fraction"] = float(totals[1] / max(totals[0], 1))
        metrics["loss_tokens"] = tokens
        return metrics

    def _sum_over_ranks(self, metrics: dict[str, float], keys: Sequence[str]) -> None:
        """Sum `keys` of `metrics` over ranks, in place. Every rank joins the same all-reduce:
        the key list is the union over ranks (a rank that ran only dummy passes has none of
        the loss keys) and a key a rank lacks counts 0 there."""
        present = D.union_of_names(k for k in keys if k in metrics)
        if not present:
            return
        values = torch.tensor([metrics.get(k, 0.0) for k in present], dtype=torch.float64,
                              device=self.device)
        D.all_reduce_sum(values)
        for key, value in zip(present, values.tolist(), strict=True):
            metrics[key] = value

    def _policy_out(self, mb: MicroBatch) -> torch.Tensor:
        with self._autocast():
            return self._forward(self.policy, mb, self._kept(mb)).logits

    # ------------------------------------------------------------------------------ SFT

    def sft_loss(
        self, mb: MicroBatch, logits: torch.Tensor, tokens: float, seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-mean negative log-likelihood over trained tokens of the whole mini-batch."""
        logp = token_logprobs(logits, mb.input_ids, 1.0, self._kept_in(mb, logits))
        nll_sum = -(logp * mb.loss_mask).sum()
        loss = nll_sum / tokens
        return loss, {"loss": float(loss.detach())}

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step of supervised training on `samples` (loss on loss_mask tokens)."""
        start = time.perf_counter()
        metrics = self._run_update(
            self.policy, samples, list(range(len(samples))), self.sft_loss, self._policy_out
        )
        self._sum_over_ranks(metrics, ["loss"])
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    @torch.no_grad()
    def sft_eval_loss(self, samples: Sequence[Sample]) -> float:
        """The SFT loss of `samples` under the current weights (no update)."""
        self.policy.eval()
        tokens, _ = self._counts(samples, list(range(len(samples))))
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for micro in self._plan(samples, list(range(len(samples)))):
            if not micro:
                continue
            mb = self._pack(samples, micro)
            logp = token_logprobs(self._policy_out(mb), mb.input_ids, 1.0, self._kept(mb))
            total += -(logp * mb.loss_mask).sum().double()
        D.all_reduce_sum(total)
        return float(total.item() / tokens)

    # ------------------------------------------------------------------------------- RL

    def rl_loss(
        self, mb: MicroBatch, logits: torch.Tensor, tokens: float, seqs: float,
        entropies: Mapping[int, np.ndarray] | None = None,
        entropy_threshold: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO-family loss of one micro-batch, normalised by the global token / sequence counts
        of the whole mini-batch (see the module doc).

        `entropies` / `entropy_threshold`: `loss_token_entropies` of the mini-batch, which
        `rl_step` passes when `top_entropy_quantile` < 1; without them the threshold is taken
        over this call's own loss tokens (TRL's rule for one forward)."""
        from services.learner import algorithms as alg

        opt = self.options
        kept = self._kept_in(mb, logits)
        logp = token_logprobs(logits, mb.input_ids, self.temperature, kept)

        def rows(flat: torch.Tensor) -> torch.Tensor:
            matrix = mb.response_matrix(flat)
            return matrix if pick is None else matrix[pick]

        pick: torch.Tensor | None = None
        mask = rows(mb.loss_mask)
        if opt.step_rows:  # rllm: one row per step, so seq-mean modes average over steps
            if "step_index" not in mb.fields:
                raise ValueError(STEP_INDEX_MISSING)
            pick, mask = alg.step_rows(rows(mb.fields["step_index"]), mask)
        log_prob = rows(logp)
        name = opt.effective_policy_loss
        if name == "bypass_mode":  # verl bypass: the rollout's log-probs are the old ones
            if "rollout_logprobs" not in mb.fields:
                raise ValueError("bypass_mode needs the rollout's log-probs on every sample")
            old = rows(mb.fields["rollout_logprobs"])
        elif "old_logprobs" in mb.fields:
            old = rows(mb.fields["old_logprobs"])
        else:
            old = log_prob.detach()
        if kept is not None:
            # a position without logits (never a loss token now, though rejection may have
            # masked it after the old log-probs were read) takes the old value: ratio 1 there,
            # so no unclamped loss or metric meets exp(0 - old) before its mask
            log_prob = torch.where(mask > 0, log_prob, old)
        adv = rows(mb.fields["advantages"])
        weights = rows(mb.fields["rollout_is_weights"]) if "rollout_is_weights" in mb.fields \
            else None
        corr_metrics: dict[str, float] = {}
        if (weights is None and opt.uses_rollout_correction
                and not opt.rollout_correction_needs_batch and "rollout_logprobs" in mb.fields):
            # token-level IS with old = current (rl_batch.apply_rollout_correction left it here);
            # through rollout_correction so the off-policy metrics (kl, ppl, chi2) come too
            weights, _, corr_metrics = alg.rollout_correction(
                old, rows(mb.fields["rollout_logprobs"]), mask, rollout_is="token",
                rollout_is_threshold=opt.effective_rollout_is_threshold)
        keep, keep_metrics = None, {}
        if opt.uses_token_keep:
            behaviour = rows(mb.fields["rollout_logprobs"]) if "rollout_logprobs" in mb.fields \
                else old
            if opt.uses_entropy_mask:
                if entropies is None:
                    ent = rows(token_entropy(logits.detach(), self.temperature, kept))
                else:
                    ent = _response_rows(mb, entropies, mask.device)
                    ent = ent if pick is None else ent[pick]
            else:
                ent = None
            threshold = None if entropy_threshold is None else entropy_threshold.to(mask.device)
            keep, keep_metrics = _token_keep(opt, adv, log_prob, behaviour, mask, ent, threshold)
        settings = opt.loss_settings().with_counts(tokens, seqs, self._loss_scale_factor())
        settings = settings.with_keep(keep)
        counts = settings.counts()
        pg_loss, pg_metrics = alg.compute_policy_loss(name, log_prob, old, adv, mask, settings,
                                                      weights)
        pg_metrics.update(corr_metrics)  # already named rollout_corr/* (rollout_correction)
        pg_metrics.update(keep_metrics)
        loss = pg_loss
        share = float(mask.sum()) / tokens  # this micro-batch's share, to average metrics
        metrics: dict[str, float] = {"pg_loss": float(pg_loss.detach())}
        for key, value in (pg_metrics or {}).items():
            metrics[key] = float(value) * share
        if opt.use_kl_loss:
            if "ref_logprobs" not in mb.fields:
                raise ValueError("use_kl_loss needs ref_logprobs (compute_log_probs(..., 'ref'))")
            ref = rows(mb.fields["ref_logprobs"])
            kl_mat = alg.kl_penalty(log_prob, ref, opt.kl_loss_type, clamp=opt.kl_clamp)
            if opt.use_bias_correction_kl:  # TRL: the KL per token times pi_theta / pi_old
                kl_mat = alg.bias_corrected_kl(kl_mat, log_prob, old, mask,
                                               opt.importance_sampling_level, opt.log_ratio_clamp)
            kl = alg.agg_loss(kl_mat, mask, opt.loss_agg_mode, **counts)
            loss = loss + opt.kl_loss_coef * kl
            metrics["kl_loss"] = float(kl.detach())
        if opt.entropy_coeff != 0.0:
            ent = rows(token_entropy(logits, self.temperature, kept))
            ent_loss = alg.agg_loss(ent, mask, opt.loss_agg_mode, **counts)
            loss = loss - opt.entropy_coeff * ent_loss
            metrics["entropy"] = float(ent_loss.detach())
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def _loss_scale_factor(self) -> int | None:
        """The divisor of seq-mean-token-sum-norm: learner.algorithm.max_response_len, else the
        run's rollout.max_response_length; never a micro-batch's own width (see the class
        attribute). Other modes ignore it."""
        value = self.options.max_response_len or self.max_response_length
        if value is None and self.options.loss_agg_mode == "seq-mean-token-sum-norm":
            raise ValueError("loss_agg_mode seq-mean-token-sum-norm needs a constant divisor: "
                             "set learner.algorithm.max_response_len (the RL loop uses "
                             "rollout.max_response_length)")
        return value

    def value_loss(
        self, mb: MicroBatch, values_out: torch.Tensor, tokens: float, seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped value loss of the critic (GAE), normalised like the policy loss."""
        from services.learner import algorithms as alg

        opt = self.options
        mask = mb.response_matrix(mb.loss_mask)
        vpreds = mb.response_matrix(token_values(values_out))
        returns = mb.response_matrix(mb.fields["returns"])
        old_values = mb.response_matrix(mb.fields["values"])
        vf_loss, vf_metrics = alg.value_loss(
            vpreds, old_values, returns, mask, opt.cliprange_value, opt.loss_agg_mode,
            global_token_count=tokens, global_seq_count=seqs,
            max_response_len=self._loss_scale_factor(),
        )
        share = float(mask.sum()) / tokens
        metrics = {"vf_loss": float(vf_loss.detach())}
        metrics.update({k: float(v) * share for k, v in (vf_metrics or {}).items()})
        return vf_loss, metrics

    def rl_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """PPO epochs x mini-batches over a batch whose samples carry `advantages` (and
        `old_logprobs`; `ref_logprobs` with a KL loss; `returns`/`values` with a critic).

        Returns metrics averaged over the optimizer steps taken.
        """
        start = time.perf_counter()
        missing = [i for i, s in enumerate(samples) if "advantages" not in s.fields]
        if missing:
            raise ValueError(f"samples {missing[:5]} have no advantages")
        steps: list[dict[str, float]] = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in split_mini_batches(len(samples), self.cfg.mini_batch_size):
                loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]] = self.rl_loss
                if self.options.uses_entropy_mask:  # TRL top_entropy_quantile
                    entropies, threshold = self.loss_token_entropies(samples, mini)
                    loss_fn = partial(self.rl_loss, entropies=entropies,
                                      entropy_threshold=threshold)
                m = self._run_update(self.policy, samples, mini, loss_fn, self._policy_out,
                                     step_rows=self.options.step_rows)
                if self.critic is not None:
                    critic = self.critic

                    def critic_out(mb: MicroBatch, critic: TrainEngine = critic) -> torch.Tensor:
                        return self._forward(critic, mb).logits

                    cm = self._run_update(critic, samples, mini, self.value_loss, critic_out)
                    m.update({f"critic/{k}": v for k, v in cm.items()})
                steps.append(m)
        summed = {k: float(np.mean([s[k] for s in steps if k in s])) for k in steps[0]}
        sum_keys = [k for k in summed if k not in ("grad_norm", "lr", "tokens_computed",
                                                   "padding_fraction", "loss_tokens")
                    and not k.startswith("critic/grad") and not k.startswith("critic/lr")]
        self._sum_over_ranks(summed, sum_keys)
        summed["step_time_s"] = time.perf_counter() - start
        return summed

    # ------------------------------------------------------------------------ weights

    def state_dict_for_export(self, keep: bool | None = None) -> dict[str, torch.Tensor]:
        """Full policy weights (ZeRO-3 gathered) on CPU; what the weight-sync server serves.

        Every rank calls it (ZeRO-3 gathers are collective); only rank 0 (or `keep=True`) gets
        the weights, other ranks get {} without copying (TrainEngine.full_state_dict). With
        LoRA: the merged model under the base model's names, so replicas and checkpoints load
        it like any full model."""
        return self.export(keep)[0]

    def export(self, keep: bool | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(full weights under the base model's names, the LoRA adapter's tensors or None);
        collective like state_dict_for_export."""
        full = self.policy.full_state_dict(keep)
        if self.lora is None:
            return full, None
        from services.learner.lora import adapter_state, merge_lora_state, scaling

        return merge_lora_state(full, scaling(self.lora)), adapter_state(full)

    def adapter_for_export(self, keep: bool | None = None) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors alone (what `learner.lora.publish: adapter` sends),
        without merging the whole model only to drop it; collective like export."""
        from services.learner.lora import adapter_state

        if self.lora is None:
            raise RuntimeError("adapter_for_export needs learner.lora.rank > 0")
        return adapter_state(self.policy.full_state_dict(keep))

    @property
    def base_model(self) -> torch.nn.Module:
        """The Hugging Face model under the DeepSpeed engine (and the LoRA wrapper)."""
        module = self.policy.module
        return module.get_base_model() if self.lora is not None else module


STEP_INDEX_MISSING = ("learner.algorithm.loss_rows=step needs each sample's step_index "
                      "(services.learner.rl_batch.samples_of(items, step_rows=True))")


def _response_rows(mb: MicroBatch, per_sample: Mapping[int, np.ndarray],
                   device: torch.device) -> torch.Tensor:
    """(n_seq, T) response rows of a per-token value held per sample (full-length arrays keyed
    by sample index), laid out like `mb.response_matrix`."""
    resp_lens = [n - p for n, p in zip(mb.seq_lens, mb.prompt_lens, strict=True)]
    out = torch.zeros(len(resp_lens), max(resp_lens, default=0), dtype=torch.float32)
    for row, (index, p, k) in enumerate(zip(mb.sample_indices, mb.prompt_lens, resp_lens,
                                            strict=True)):
        out[row, :k] = torch.from_numpy(np.asarray(per_sample[index][p : p + k],
                                                   dtype=np.float32))
    return out.to(device)


def _token_keep(
    opt: AlgorithmSettings,
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    mask: torch.Tensor,
    entropies: torch.Tensor | None,
    entropy_threshold: torch.Tensor | None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """TRL's 0/1 multiplier of the per-token policy loss (token_masks.py): the off-policy
    sequence mask (`off_policy_mask_threshold`; behaviour = the rollout's log-probs, else the
    old ones, as TRL's sampling_per_token_logps) times the top-entropy mask
    (`top_entropy_quantile`), and their fractions over this call's loss tokens."""
    from services.learner import algorithms as alg

    keep: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = {}
    if opt.off_policy_mask_threshold is not None:
        keep = alg.off_policy_sequence_mask(advantages, log_prob, behaviour_log_prob, mask,
                                            opt.off_policy_mask_threshold)
        keep = keep.expand_as(mask).to(mask.dtype)
        metrics["off_policy_masked_fraction"] = alg.masked_mean(1.0 - keep, mask)
    if entropies is not None:
        high = alg.high_entropy_mask(entropies, mask, opt.top_entropy_quantile,
                                     entropy_threshold).to(mask.dtype)
        metrics["entropy_mask_kept_fraction"] = alg.masked_mean(high, mask)
        keep = high if keep is None else keep * high
    return keep, metrics


def _require_step_index(samples: Sequence[Sample], indices: Sequence[int]) -> None:
    if any("step_index" not in samples[i].fields for i in indices):
        raise ValueError(STEP_INDEX_MISSING)


def broadcast_samples(samples: list[Sample] | None) -> list[Sample]:
    """Rank 0's samples on every rank, sent as flat numeric tensors (no pickling).

    Layout: a header of per-sample (length, prompt_len, field bitmap) int64s, then the token ids,
    masks and fields as one float/int buffer each; uids are not needed for training.
    """
    import torch.distributed as dist

    from services.learner.packing import TOKEN_FIELDS

    if D.world_size() == 1:
        return list(samples or [])
    dev = D.device()
    if D.rank() == 0:
        assert samples is not None
        header = torch.tensor(
            [[len(s), s.prompt_len, sum(1 << i for i, f in enumerate(TOKEN_FIELDS)
                                       if f in s.fields)] for s in samples],
            dtype=torch.int64,
        ).reshape(-1)
        size = torch.tensor([len(samples)], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, 0)
    n = int(size.item())
    if D.rank() != 0:
        header = torch.zeros(3 * n, dtype=torch.int64)
    header = header.to(dev)
    dist.broadcast(header, 0)
    meta = header.cpu().view(n, 3).tolist()
    total = sum(m[0] for m in meta)
    if D.rank() == 0:
        ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples])).to(dev)
        floats = torch.from_numpy(np.concatenate(
            [s.loss_mask for s in samples]
            + [s.fields[f] for f in TOKEN_FIELDS for s in samples if f in s.fields]
        )).to(dev)
    else:
        n_fields = sum(m[0] * bin(m[2]).count("1") for m in meta)
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        floats = torch.zeros(total + n_fields, dtype=torch.float32, device=dev)
    dist.broadcast(ids, 0)
    dist.broadcast(floats, 0)
    if D.rank() == 0:
        return list(samples)
    ids_h, floats_h = ids.cpu().numpy(), floats.cpu().numpy()
    out: list[Sample] = []
    pos = 0
    for length, prompt_len, _ in meta:
        out.append(Sample(ids_h[pos : pos + length], floats_h[pos : pos + length], prompt_len))
        pos += length
    cursor = total
    for bit, name in enumerate(TOKEN_FIELDS):
        for sample, (length, _, bits) in zip(out, meta, strict=True):
            if bits & (1 << bit):
                sample.set_field(name, floats_h[cursor : cursor + length])
                cursor += length
    return out
