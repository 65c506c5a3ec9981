"""`forage plan`: will the run fit, before a GPU is rented.

    forage plan --config FILE [--config FILE2 ...] [--set k=v ...]
                [--layout FILE | --gpus N] [--gpu-memory GIB]
                [--model-config config.json] [--index-rows N --index-dim D --index-kind K]
                [--json]

Prints, per GPU, what each service holds there (the learner's weights, gradients, optimizer
states, activations and log-prob tensors; vLLM's share and the KV cache it leaves; the
retriever's index and encoder), a verdict (fits / tight / does not fit) and, where it does
not fit, the setting to change, one line each; then host memory. Exit 0 when everything fits
(tight included), 1 when something does not. The rules and their measured error:
services/common/plan.py and docs/deploy.md, "Sizing".
"""

from __future__ import annotations

import argparse
import json

from services.common.cli_args import add_config_args
from services.common.plan import GIB, gib


def register(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, required=False)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--layout", metavar="FILE",
                       help="a Compose layout (docker-compose.yml or a deploy/compose/gpus-*.yml "
                            "file): services share the GPUs its device_ids say")
    where.add_argument("--gpus", type=int, metavar="N",
                       help="no layout: the learner on N GPUs, rollout and retriever on GPUs "
                            "of their own (0: a CPU node)")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", default=None,
                        help="memory of one GPU in GiB as torch reports it (default 79.6: an "
                             "80 GB H100; an H200 is 139.8)")
    parser.add_argument("--model-config", metavar="FILE",
                        help="the model's config.json (default: model.path/config.json, else "
                             "the known public shapes by model.path's name)")
    parser.add_argument("--index-rows", type=int, metavar="N",
                        help="vectors in the index (default: its manifest, else wiki-18)")
    parser.add_argument("--index-dim", type=int, metavar="D", help="vector dimension")
    parser.add_argument("--index-kind", metavar="KIND",
                        help="build-index kind (flat, ivf-sq8, ...) or FAISS factory string")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    import sys

    from services.common.plan import PlanError
    from services.common.plan_node import make_plan

    try:
        plan = make_plan(args.config, args.overrides, layout=args.layout, gpus=args.gpus,
                         gpu_gib=args.gpu_memory, model_config=args.model_config,
                         index_rows=args.index_rows, index_dim=args.index_dim,
                         index_kind=args.index_kind)
    except PlanError as exc:
        print(f"forage plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render(plan))
    return 0 if plan.fits else 1


def render(plan) -> str:  # a NodePlan
    out = [f"forage plan: {plan.title}", f"model: {plan.shape.describe()}"]
    if plan.learner is not None:
        out += _learner_lines(plan.learner)
    for name, v in plan.vllm.items():
        out += _vllm_lines(name, v)
    for g in plan.one_shot:
        out.append(f"GPU {g.gpu} before the run (one-shot {g.loads[0].service}): "
                   f"{gib(g.total)} of {gib(g.capacity)}: {g.verdict}")
    for g in plan.gpus:
        out.append("")
        out.append(f"GPU {g.gpu} ({gib(g.capacity)}): {', '.join(g.services())}")
        for load in g.loads:
            note = f"  ({load.note})" if load.note else ""
            out.append(f"  {load.service:<11} {load.what:<34} {gib(load.bytes):>10}{note}")
        share = g.total / g.capacity if g.capacity else 0
        out.append(f"  {'total':<46} {gib(g.total):>10}  {100 * share:.0f}%  -> {g.verdict}")
        out += [f"  problem: {p}" for p in g.problems]
        out += [f"  change: {a}" for a in g.advice]
    out.append("")
    out.append(f"host memory: {gib(plan.host_total)}")
    for load in plan.host:
        note = f"  ({load.note})" if load.note else ""
        out.append(f"  {load.service:<11} {load.what:<34} {gib(load.bytes):>10}{note}")
    out += [f"problem: {p}" for p in plan.problems]
    out += [f"note: {n}" for n in plan.notes]
    out.append("")
    tight = [g.gpu for g in plan.gpus + plan.one_shot if g.verdict == "tight"]
    if not plan.fits:
        out.append("does not fit")
    elif tight:
        out.append(f"fits, tight on GPU {', '.join(tight)} (over 90%: within the estimate's "
                   "error)")
    else:
        out.append("fits")
    return "\n".join(out)


def _learner_lines(est) -> list[str]:
    s = est.setup
    lines = [f"learner: {s.ranks} rank(s), ZeRO stage {s.stage}"
             f"{' (bf16 runs stage 0 as 1)' if s.bf16 and s.zero_stage == 0 else ''}, "
             f"{'bf16' if s.bf16 else 'fp32'}, gradient checkpointing "
             f"{'on' if s.gradient_checkpointing else 'off'}, micro-batch {s.micro_tokens:,} "
             f"tokens, trains {est.trained / 1e6:,.1f} M parameters"
             + (f" (LoRA rank {s.lora_rank})" if s.lora_rank else "")]
    for item in est.items:
        note = f"  ({item.note})" if item.note else ""
        lines.append(f"  {item.name:<22} {gib(item.bytes):>10}{note}")
    per_tok = (f"  activations per token: {est.per_token_no_ckpt / 1024:,.0f} KiB without "
               f"checkpointing, {est.per_token_ckpt / 1024:,.1f} KiB with (layer inputs; + one "
               "layer recomputed)")
    lines += [per_tok,
              f"  peak per rank {gib(est.peak)}; optimizer step {gib(est.step_peak)}"]
    return lines


def _vllm_lines(name: str, v) -> list[str]:
    s = v.setup
    lines = [f"{name} (vLLM): {gib(v.budget)} of the GPU = weights {gib(v.weights)} + "
             f"activations {gib(v.activation)} + graphs/context {gib(v.overhead)} + KV cache "
             f"{gib(v.kv)}",
             f"  KV cache: {v.kv_per_token / 1024:.0f} KiB a token -> {v.kv_tokens:,} tokens; "
             f"max_num_seqs {s.max_num_seqs:,} x max_model_len {v.max_model_len:,} needs "
             f"{gib(s.max_num_seqs * v.max_model_len * v.kv_per_token)}, x the longest "
             f"trajectory ({s.trajectory_tokens:,}) "
             f"{gib(s.max_num_seqs * s.trajectory_tokens * v.kv_per_token)}"]
    lines += [f"  problem: {p}" for p in v.problems]
    lines += [f"  warning: {w}" for w in v.warnings]
    return lines


__all__ = ["GIB", "register", "render"]
