"""A whole node's plan: each service's estimate (services/common/plan.py) placed on the GPUs a
layout gives it (services/common/plan_layout.py), summed per GPU, with a verdict and, where a
GPU does not fit, the settings that would make it fit, one line each.

Without a layout each GPU service gets GPUs of its own: the learner `gpus` of them (its
ranks), the rollout its tensor-parallel GPUs, the retriever one when its config puts anything
on CUDA. A config whose services all run on the CPU, with no layout and no `gpus`, is planned
for a CPU node: host memory only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.plan import (
    CUDA_CONTEXT,
    ENCODER_WORKING,
    FAISS_GPU_TEMP,
    GIB,
    PROCESS_BASE,
    TIGHT,
    IndexSpec,
    LearnerEstimate,
    PlanError,
    Shape,
    VllmEstimate,
    encoder_hidden,
    encoder_params,
    estimate_learner,
    estimate_vllm,
    gib,
    index_bytes,
    learner_setup,
    longest_trajectory,
    micro_batch_that_fits,
    ranks_that_fit,
    read_index_spec,
    resolve_model,
    transformers_engine_bytes,
    vllm_setup,
)
from services.common.plan_layout import (
    Placement,
    declared_gpu_gib,
    gpu_ids,
    layout_files,
    read_layout,
)

# The GPU docs/deploy.md sizes for: an 80 GB H100, as torch.cuda reports it.
DEFAULT_GPU_GIB = 79.6
LORA_RANK_ADVICE = 64


@dataclass
class Load:
    service: str
    what: str
    bytes: int
    note: str = ""


@dataclass
class GpuPlan:
    gpu: str
    capacity: int
    loads: list[Load] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # fails whatever the sum
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(load.bytes for load in self.loads)

    @property
    def verdict(self) -> str:
        if self.problems or self.total > self.capacity:
            return "does not fit"
        return "tight" if self.total > TIGHT * self.capacity else "fits"

    def services(self) -> list[str]:
        return list(dict.fromkeys(load.service for load in self.loads))


@dataclass
class NodePlan:
    title: str
    shape: Shape
    gpus: list[GpuPlan]
    one_shot: list[GpuPlan]
    learner: LearnerEstimate | None
    vllm: dict[str, VllmEstimate]
    index: IndexSpec | None
    host: list[Load]
    notes: list[str]
    learner_config: Any = None
    problems: list[str] = field(default_factory=list)  # a service that cannot start at all

    @property
    def fits(self) -> bool:
        return not self.problems and all(g.verdict != "does not fit"
                                         for g in self.gpus + self.one_shot)

    @property
    def host_total(self) -> int:
        return sum(load.bytes for load in self.host)

    def to_json(self) -> dict[str, Any]:
        def gpu(g: GpuPlan) -> dict[str, Any]:
            return {"gpu": g.gpu, "capacity_gib": round(g.capacity / GIB, 2),
                    "total_gib": round(g.total / GIB, 2), "verdict": g.verdict,
                    "loads": [{"service": x.service, "what": x.what,
                               "gib": round(x.bytes / GIB, 2), "note": x.note}
                              for x in g.loads],
                    "problems": g.problems, "advice": g.advice}

        learner = None
        if self.learner is not None:
            s = self.learner.setup
            learner = {
                "ranks": s.ranks, "zero_stage": s.stage, "bf16": s.bf16,
                "gradient_checkpointing": s.gradient_checkpointing,
                "micro_batch_tokens": s.micro_tokens, "trained_params": self.learner.trained,
                "items": {i.name: round(i.bytes / GIB, 2) for i in self.learner.items},
                "peak_gib": round(self.learner.peak / GIB, 2),
                "activation_bytes_per_token": {
                    "without_checkpointing": self.learner.per_token_no_ckpt,
                    "with_checkpointing": self.learner.per_token_ckpt},
                "logit_tensor_gib": round(self.learner.logit_tensor / GIB, 2)}
        return {
            "title": self.title, "fits": self.fits,
            "model": {"name": self.shape.name, "params": self.shape.params(),
                      "source": self.shape.source},
            "gpus": [gpu(g) for g in self.gpus], "one_shot": [gpu(g) for g in self.one_shot],
            "learner": learner,
            "vllm": {name: {"budget_gib": round(v.budget / GIB, 2),
                            "weights_gib": round(v.weights / GIB, 2),
                            "activation_gib": round(v.activation / GIB, 2),
                            "overhead_gib": round(v.overhead / GIB, 2),
                            "kv_cache_gib": round(v.kv / GIB, 2), "kv_tokens": v.kv_tokens,
                            "kv_bytes_per_token": v.kv_per_token,
                            "max_model_len": v.max_model_len,
                            "problems": v.problems, "warnings": v.warnings}
                     for name, v in self.vllm.items()},
            "index": None if self.index is None else {
                "rows": self.index.rows, "dim": self.index.dim, "kind": self.index.kind,
                "source": self.index.source,
                "cpu_gib": round(index_bytes(self.index) / GIB, 2)},
            "host": {"total_gib": round(self.host_total / GIB, 2),
                     "loads": [{"service": x.service, "what": x.what,
                                "gib": round(x.bytes / GIB, 2), "note": x.note}
                               for x in self.host]},
            "notes": self.notes, "problems": self.problems,
        }


def _synthetic_layout(cfg: Any, gpus: int | None) -> list[Placement]:
    """Each GPU service on GPUs of its own (module docstring)."""
    rollout, retriever = cfg.rollout, cfg.retriever
    wants_gpu = any(str(d).startswith("cuda") for d in (
        rollout.device, retriever.encoder_placement, retriever.index_placement))
    if gpus is None:
        gpus = 1 if wants_gpu else 0
    if gpus == 0:  # forage up on this machine: the launcher and its children
        return [Placement("forage up", "launcher"),
                Placement("learner", "learner"), Placement("rollout", "rollout"),
                *([Placement("retriever", "retriever")] if retriever.index_dir else []),
                Placement("scorer", "scorer")]
    ids = iter(str(i) for i in range(1000))
    placements = [Placement("learner", "learner", gpus=[next(ids) for _ in range(gpus)],
                            ranks=gpus)]
    if rollout.device.startswith("cuda") or rollout.engine == "vllm":
        tp = rollout.tensor_parallel_size if rollout.engine == "vllm" else 1
        placements.append(Placement("rollout", "rollout", gpus=[next(ids) for _ in range(tp)]))
    else:
        placements.append(Placement("rollout", "rollout"))
    on_gpu = any(str(d).startswith("cuda") for d in (retriever.encoder_placement,
                                                     retriever.index_placement))
    if retriever.index_dir:  # forage up starts a retriever only then (launch/up.py)
        placements.append(Placement("retriever", "retriever",
                                    gpus=[next(ids)] if on_gpu else []))
    placements.append(Placement("scorer", "scorer"))
    return placements


def make_plan(configs: Sequence[str | Path] | None, overrides: Sequence[str] = (), *,
              layout: str | Path | None = None, gpus: int | None = None,
              gpu_gib: float | None = None, model_config: str | Path | None = None,
              index_rows: int | None = None, index_dim: int | None = None,
              index_kind: str | None = None,
              environ: Mapping[str, str] | None = None) -> NodePlan:
    from services.common.config import load_config

    paths = [str(p) for p in configs or []]
    base_cfg = load_config(paths, list(overrides), environ=environ)
    shape = resolve_model(base_cfg.model.path, model_config)
    notes: list[str] = []
    declared = None
    if layout is not None:
        files = layout_files(Path(layout))
        declared = declared_gpu_gib(*files)
        placements = read_layout(*files)
        if not placements:
            raise PlanError(f"layout {layout}: no Forage service found")
        title = f"layout {layout}"
        named = sorted({Path(c).name for p in placements for c in p.configs})
        planned = sorted(Path(c).name for c in paths)
        if named and named != planned:
            notes.append(f"the layout's services read {', '.join(named)}; planned with "
                         f"{', '.join(planned) or 'the defaults'} and each service's --set")
        if gpus is not None:
            notes.append("--gpus is ignored with --layout: the layout's device_ids say which "
                         "GPUs each service holds")
    else:
        placements = _synthetic_layout(base_cfg, gpus)
        title = ("a CPU node" if not any(p.gpus for p in placements) else
                 f"one GPU per service, the learner on {placements[0].ranks}")
    capacity = int((gpu_gib or declared or DEFAULT_GPU_GIB) * GIB)
    if gpu_ids(placements):
        title += f", GPUs of {gib(capacity)}" + (" (the layout's x-forage-plan)"
                                                  if declared and not gpu_gib else "")
    plans = {g: GpuPlan(g, capacity) for g in gpu_ids(placements)}
    one_shot: list[GpuPlan] = []
    host: list[Load] = []
    result = NodePlan(title, shape, [], [], None, {}, None, host, notes)
    for p in placements:
        cfg = load_config(paths, [*p.overrides, *overrides], environ=environ)
        if p.one_shot:
            one_shot.extend(_index_build(p, capacity, cfg, index_rows, index_dim, index_kind))
            continue
        if p.role == "learner":
            _place_learner(result, plans, p, cfg, shape)
        elif p.role == "rollout":
            _place_rollout(result, plans, p, cfg, shape, capacity)
        elif p.role == "retriever":
            _place_retriever(result, plans, p, cfg, index_rows, index_dim, index_kind)
        elif p.role == "launcher":
            host.append(Load(p.name, "process", PROCESS_BASE["plain"]))
        elif p.role == "scorer":
            workers = getattr(cfg.scorer, "num_workers", 0) or 0
            host.append(Load(p.name, "processes", PROCESS_BASE["plain"] * (1 + workers),
                             f"the server and {workers} worker processes"))
    result.gpus = [plans[g] for g in gpu_ids(placements) if plans[g].loads or plans[g].problems]
    result.one_shot = one_shot
    for gpu_plan in result.gpus:
        if gpu_plan.verdict != "fits":
            _advise(result, gpu_plan)
    return result


def _place_learner(result: NodePlan, plans: dict[str, GpuPlan], p: Placement, cfg: Any,
                   shape: Shape) -> None:
    on_gpu = bool(p.gpus)
    setup = learner_setup(cfg, shape, p.ranks, on_gpu)
    est = estimate_learner(setup)
    result.learner, result.learner_config = est, cfg
    if on_gpu:
        if len(p.gpus) < p.ranks:
            plans[p.gpus[0]].problems.append(
                f"{p.name}: {p.ranks} ranks but only {len(p.gpus)} GPU(s) in its device_ids")
        for rank, gpu in enumerate(p.gpus[: p.ranks]):
            plans[gpu].loads.append(Load(p.name, f"rank {rank}", est.peak,
                                         "peak of a training micro-batch"))
            plans[gpu].loads.append(Load(p.name, "CUDA context", CUDA_CONTEXT))
        result.host.append(Load(p.name, "processes", PROCESS_BASE["torch"] * p.ranks,
                                f"{p.ranks} rank(s)"))
        result.host.append(Load(p.name, "weights copied for publishing", 2 * shape.params(),
                                "rank 0, bf16, each weight version"))
    else:
        result.host.append(Load(p.name, "training (CPU)", est.peak,
                                "fp32" if not setup.bf16 else "bf16"))
        result.host.append(Load(p.name, "process", PROCESS_BASE["torch"]))


def _place_rollout(result: NodePlan, plans: dict[str, GpuPlan], p: Placement, cfg: Any,
                   shape: Shape, capacity: int) -> None:
    rollout = cfg.rollout
    cuda = rollout.device.startswith("cuda")
    if cuda and not p.gpus:
        result.problems.append(f"{p.name}: rollout.device is {rollout.device} but the "
                               "layout gives it no GPU")
    if rollout.engine == "vllm" and p.gpus:
        est = estimate_vllm(vllm_setup(cfg, shape, capacity))
        result.vllm[p.name] = est
        tp = max(1, rollout.tensor_parallel_size)
        if len(p.gpus) < tp:
            plans[p.gpus[0]].problems.append(
                f"{p.name}: tensor_parallel_size {tp} but {len(p.gpus)} GPU(s)")
        for gpu in p.gpus[:tp]:
            plans[gpu].loads.append(Load(
                p.name, "vLLM", est.budget,
                f"gpu_memory_utilization {rollout.gpu_memory_utilization:g}" if not
                rollout.kv_cache_gib else f"kv_cache_gib {rollout.kv_cache_gib:g}"))
            plans[gpu].problems.extend(f"{p.name}: {x}" for x in est.problems)
        result.host.append(Load(p.name, "process + received weights",
                                PROCESS_BASE["torch"] + 2 * shape.params(),
                                "a weight version staged on the host"))
    elif p.gpus and cuda:
        items = transformers_engine_bytes(cfg, shape, on_gpu=True)
        for item in items:
            plans[p.gpus[0]].loads.append(Load(p.name, item.name, item.bytes, item.note))
        plans[p.gpus[0]].loads.append(Load(p.name, "CUDA context", CUDA_CONTEXT))
        result.host.append(Load(p.name, "process", PROCESS_BASE["torch"]))
    else:
        items = transformers_engine_bytes(cfg, shape, on_gpu=False)
        result.host.append(Load(p.name, "engine (CPU)", sum(i.bytes for i in items),
                                ", ".join(f"{i.name} {gib(i.bytes)}" for i in items)))
        result.host.append(Load(p.name, "process", PROCESS_BASE["torch"]))


def _place_retriever(result: NodePlan, plans: dict[str, GpuPlan], p: Placement, cfg: Any,
                     rows: int | None, dim: int | None, kind: str | None) -> None:
    retriever = cfg.retriever
    spec = read_index_spec(retriever.index_dir, rows, dim, kind)
    result.index = spec
    enc_params, enc_name = encoder_params(spec)
    encoder_dev, index_dev = retriever.encoder_placement, retriever.index_placement
    for what, device in (("encoder", encoder_dev), ("index", index_dev)):
        if device.startswith("cuda") and not p.gpus:
            result.problems.append(f"{p.name}: the retriever's {what} is on {device} but the "
                                   "layout gives it no GPU")
    cpu_index = index_bytes(spec)
    used: set[str] = set()
    if encoder_dev.startswith("cuda") and p.gpus:
        gpu = _pick(p.gpus, encoder_dev)
        plans[gpu].loads.append(Load(p.name, f"encoder ({enc_name})",
                                     2 * enc_params + ENCODER_WORKING, "fp16"))
        used.add(gpu)
    else:
        result.host.append(Load(p.name, f"encoder ({enc_name})", 4 * enc_params, "fp32"))
    if index_dev.startswith("cuda") and p.gpus:
        targets = p.gpus if index_dev in ("cuda", "cuda:all") else [_pick(p.gpus, index_dev)]
        on_gpu = index_bytes(spec, on_gpu=True)
        share = on_gpu if retriever.index_gpu_mode == "replicate" else -(-on_gpu //
                                                                          len(targets))
        for gpu in targets:
            plans[gpu].loads.append(Load(p.name, f"index ({spec.kind}, fp16 vectors)"
                                         if spec.kind in ("flat", "ivf") else
                                         f"index ({spec.kind})", share,
                                         f"{spec.rows:,} x {spec.dim}"
                                         + (f", sharded over {len(targets)}"
                                            if len(targets) > 1 else "")))
            plans[gpu].loads.append(Load(p.name, "FAISS scratch", FAISS_GPU_TEMP))
            used.add(gpu)
        result.host.append(Load(p.name, "index while loading", cpu_index,
                                "read on the host, then cloned to the GPU"))
    else:
        result.host.append(Load(p.name, f"index ({spec.kind})",
                                0 if retriever.mmap else cpu_index,
                                f"mapped: {gib(cpu_index)} of page cache, shared"
                                if retriever.mmap else f"{spec.rows:,} x {spec.dim}"))
    for gpu in used:
        plans[gpu].loads.append(Load(p.name, "CUDA context", CUDA_CONTEXT))
    result.host.append(Load(p.name, "process", PROCESS_BASE["torch"]))


def _pick(gpus: list[str], device: str) -> str:
    _, _, number = device.partition(":")
    index = int(number) if number.isdigit() else 0
    return gpus[index] if index < len(gpus) else gpus[0]


def _index_build(p: Placement, capacity: int, cfg: Any, rows: int | None, dim: int | None,
                 kind: str | None) -> list[GpuPlan]:
    """The one-shot build: encoding passages in batches of 512 (its command's --batch-size)
    on its GPU, before the long-running services start."""
    if not p.gpus:
        return []
    spec = read_index_spec(cfg.retriever.index_dir, rows, dim, kind)
    params, name = encoder_params(spec)
    batch, seq, h = 512, 512, encoder_hidden(name)
    work = batch * seq * (8 * h + 2 * 4 * h) + batch * 12 * seq * seq * 2
    plan = GpuPlan(p.gpus[0], capacity)
    plan.loads += [Load(p.name, f"encoder ({name})", 2 * params, "fp16"),
                   Load(p.name, "encoding batch", work, f"{batch} passages x {seq} tokens"),
                   Load(p.name, "CUDA context", CUDA_CONTEXT)]
    return [plan]


# --------------------------------------------------------------------------- advice

def _advise(plan: NodePlan, g: GpuPlan) -> None:
    target = int(TIGHT * g.capacity)
    learner_here = [x for x in g.loads if x.what.startswith("rank ")]
    others = sum(x.bytes for x in g.loads if not x.what.startswith("rank "))
    est = plan.learner
    if learner_here and est is not None:
        cfg = plan.learner_config
        budget = target - others
        setup = est.setup
        floor = longest_trajectory(cfg.rollout)
        ckpt = setup if setup.gradient_checkpointing else \
            replace(setup, gradient_checkpointing=True)
        if not setup.gradient_checkpointing:
            g.advice.append(
                f"model.gradient_checkpointing=true: activations "
                f"{gib(_item(estimate_learner(setup), 'activations'))} -> "
                f"{gib(_item(estimate_learner(ckpt), 'activations'))}")
        micro = micro_batch_that_fits(ckpt, budget, floor)
        if micro is not None and micro < setup.micro_tokens:
            after = estimate_learner(replace(ckpt, micro_tokens=micro))
            g.advice.append(
                f"learner.micro_batch_tokens={micro}: learner peak {gib(est.peak)} -> "
                f"{gib(after.peak)} (the longest trajectory is {floor:,} tokens)")
        elif micro is None:
            smallest = estimate_learner(replace(ckpt, micro_tokens=floor))
            g.advice.append(
                f"no learner.micro_batch_tokens fits: even {floor:,} (the longest trajectory) "
                f"peaks at {gib(smallest.peak)} beside {gib(others)} of other services; "
                f"the GPU would need {gib((smallest.peak + others) / TIGHT)}")
            ranks = ranks_that_fit(replace(ckpt, micro_tokens=floor), budget)
            if ranks is not None:
                g.advice.append(f"a learner on {ranks} GPUs of this size fits (ZeRO-3 "
                                f"partitions its states; torchrun --nproc-per-node={ranks})")
            if not setup.lora_rank:
                lora = replace(ckpt, micro_tokens=floor, lora_rank=LORA_RANK_ADVICE)
                lora_est = estimate_learner(lora)
                if lora_est.peak <= budget:
                    g.advice.append(
                        f"learner.lora.rank={LORA_RANK_ADVICE}: trains "
                        f"{lora_est.trained / 1e6:.0f} M parameters, peak "
                        f"{gib(lora_est.peak)} (changes what is trained: docs/learner.md LoRA)")
    for load in g.loads:
        if load.what == "vLLM" and load.service in plan.vllm:
            v = plan.vllm[load.service]
            rest = g.total - load.bytes
            if rest >= target:
                continue  # the others alone exceed the GPU: their own lines say what to change
            if rest > 0 and not v.setup.kv_cache_gib:
                room = round((target - rest) / g.capacity - 0.005, 2)
                trial = estimate_vllm(replace(v.setup, utilization=room)) if room > 0 else None
                if trial is not None and not trial.problems:
                    g.advice.append(
                        f"rollout.gpu_memory_utilization={room:g}: KV cache {gib(v.kv)} -> "
                        f"{gib(trial.kv)} ({trial.kv_tokens:,} tokens)")
                else:
                    g.advice.append(f"{load.service} cannot share this GPU: the "
                                    f"{gib(g.capacity - rest)} the others leave do not hold "
                                    "vLLM's weights and one max_model_len sequence")
            elif v.problems:
                g.advice.append("rollout.gpu_memory_utilization higher, rollout.max_model_len "
                                f"lower (now {v.max_model_len:,}), or a larger GPU")
        if load.what.startswith("index (") and plan.index is not None:
            host = index_bytes(plan.index)
            sq8 = index_bytes(replace(plan.index, kind="ivf-sq8", factory=None), on_gpu=True)
            g.advice.append(f"retriever.index_device=cpu: frees {gib(load.bytes)} here, "
                            f"takes {gib(host)} of host memory (or build ivf-sq8: {gib(sq8)})")


def _item(est: LearnerEstimate, name: str) -> int:
    return sum(i.bytes for i in est.items if i.name == name)
