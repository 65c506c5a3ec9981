"""`forage data synth | countdown | math | convert | check`."""

from __future__ import annotations

import argparse
import json
import sys

from services.common.cli_args import add_config_args, config_from_args
from services.common.stdio import result_stdout


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")

    synth = sub.add_parser("synth", help="a synthetic search world: corpus, questions, SFT set")
    synth.add_argument("--out", required=True, help="output directory")
    synth.add_argument("--seed", type=int, default=None, help="world seed (default data.seed)")
    synth.add_argument("--size", choices=["small", "medium"], default=None,
                       help="entity counts (default data.synth_size)")
    synth.add_argument("--hard", action="store_true", default=None,
                       help="sub-word names, longer passages, top-3 (GPU preset)")
    synth.add_argument("--no-sft", action="store_true", help="skip index + sft.parquet")
    synth.add_argument("--sft-mix", default=None,
                       help="strategy weights, e.g. good=0.4,guess=0.3,sloppy=0.3")
    synth.add_argument("--sft-topk", type=int, default=None,
                       help="passages per search in demonstrations (default: world's)")
    synth.add_argument("--sft-heldout", type=int, default=None,
                       help="train questions held out of sft.parquet for the skill measurement "
                            "(default 64, or 10%% when fewer; 0: none)")
    synth.add_argument("--index-type", default="flat", help="retriever index type for SFT")
    synth.add_argument("--encoder", default=None, help="sentence-transformers model directory")
    synth.add_argument("--quiet", action="store_true", help="no progress bars")
    synth.add_argument("--protocol", choices=["tags", "tool_calls"], default=None,
                       help="how the policy acts in prompts and demonstrations: Search-R1's "
                            "tags or Hermes tool calls (default rollout.protocol)")
    synth.add_argument("--template", default=None,
                       help="tool_calls: model or tokenizer directory whose chat template "
                            "renders the demonstrations (default model.tokenizer_path or "
                            "model.path when it exists, else the tiny policy's)")
    add_config_args(synth, required=False)
    synth.set_defaults(handler=_synth)

    for name, help_text in (("countdown", "Countdown problems (TinyZero)"),
                            ("math", "GSM8K-style word problems with \\boxed{} answers")):
        gen = sub.add_parser(name, help=help_text)
        gen.add_argument("--out", required=True, help="output parquet file")
        gen.add_argument("--count", type=int, default=1000, help="rows to write (1000)")
        gen.add_argument("--seed", type=int, default=0, help="random seed (0)")
        gen.add_argument("--split", default="train", help="extra_info.split (train)")
        gen.set_defaults(handler=_generate, task=name)

    conv = sub.add_parser("convert", help="FlashRAG / GSM8K (jsonl or parquet) -> Search-R1 / "
                                           "verl parquet")
    conv.add_argument("--format", dest="fmt", choices=["flashrag", "gsm8k"], required=True,
                      help="input layout: FlashRAG QA ({question, golden_answers}) or GSM8K")
    conv.add_argument("--input", required=True, help="JSON Lines file, or parquet (*.parquet)")
    conv.add_argument("--out", required=True, help="output parquet file")
    conv.add_argument("--data-source", default=None,
                      help="data_source column (flashrag: the dataset, i.e. the folder of "
                           "nq/train.jsonl or the stem of nq.jsonl; gsm8k: openai/gsm8k)")
    conv.add_argument("--split", default=None,
                      help="extra_info.split (default: the file name when it is a split, "
                           "e.g. test.jsonl, else train)")
    conv.set_defaults(handler=_convert)

    check = sub.add_parser("check", help="validate a parquet the learner will read: every bad "
                                          "row, empty target and unknown data source")
    check.add_argument("path", help="the parquet file")
    check.add_argument("--kind", choices=["rl", "sft"], default="rl",
                       help="rl: prompts with reward_model (default); sft: prompt + segments")
    check.add_argument("--max-rows", type=int, default=20,
                       help="row numbers listed per problem (20; 0: all)")
    add_config_args(check, required=False)  # scorer.rewards may add data sources
    check.set_defaults(handler=_check)


def _synth(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.tasks.synth import synthesize

    cfg = config_from_args(args)
    setup_logging("tasks", cfg.run_id, cfg.log_level)
    protocol = args.protocol or cfg.rollout.protocol
    tools = tuple(cfg.rollout.tools)
    if protocol == "tool_calls" and not all(isinstance(t, str) for t in tools):
        others = [t for t in tools if not isinstance(t, str)]
        print("forage data synth: error: tool_calls demonstrations declare built-in tools "
              f"only; rollout.tools has {others}", file=sys.stderr)
        return 2
    with result_stdout():  # libraries' prints go to stderr: stdout is the JSON alone
        summary = synthesize(
            args.out,
            seed=cfg.data.seed if args.seed is None else args.seed,
            size=args.size or cfg.data.synth_size,
            hard=cfg.data.synth_hard if args.hard is None else args.hard,
            sft=not args.no_sft,
            sft_mix=args.sft_mix or cfg.data.sft_mix,
            sft_topk=args.sft_topk or cfg.data.sft_topk,
            index_type=args.index_type,
            encoder=args.encoder,
            show_progress=not args.quiet,
            sft_heldout=args.sft_heldout,
            protocol=protocol,
            tools=tools,
            template=(args.template or _template_dir(cfg)) if protocol == "tool_calls" else None,
        )
    print(json.dumps(summary, indent=1))
    return 0


def _template_dir(cfg: object) -> str | None:
    """The run's tokenizer directory when it already exists (its chat template renders the
    demonstrations), else None (the tiny policy's template, which `forage model init` gives
    the policy it builds after the world)."""
    from pathlib import Path

    model = getattr(cfg, "model", None)
    source = getattr(model, "tokenizer_path", None) or getattr(model, "path", None)
    if source and (Path(source) / "tokenizer_config.json").is_file():
        return str(source)
    return None


def _generate(args: argparse.Namespace) -> int:
    from services.tasks.datasets import write_rows

    if args.task == "countdown":
        from services.tasks.countdown import countdown_rows as make
    else:
        from services.tasks.math_word import math_rows as make
    path = write_rows(args.out, make(args.count, args.seed, args.split))
    print(f"wrote {args.count} {args.task} rows to {path}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from services.common.data_sources import known_data_sources
    from services.tasks.convert import convert
    from services.tasks.datasets import DatasetError, data_sources_of

    try:
        path = convert(args.fmt, args.input, args.out, args.data_source, args.split)
    except (DatasetError, OSError) as exc:
        print(f"forage data convert: error: {exc}", file=sys.stderr)
        return 2
    sources = sorted(data_sources_of(path))
    print(f"wrote {path} (data_source: {', '.join(sources)})")
    unknown = [s for s in sources if s not in known_data_sources()]
    if unknown:
        print(f"warning: no built-in reward function for data_source {', '.join(unknown)}: add "
              f"it under scorer.rewards in the run config, or convert with --data-source NAME",
              file=sys.stderr)
    return 0


def _check(args: argparse.Namespace) -> int:
    from services.tasks.data_check import check_dataset
    from services.tasks.datasets import DatasetError

    cfg = config_from_args(args)
    try:
        report = check_dataset(args.path, kind=args.kind, rewards=cfg.scorer.rewards)
    except DatasetError as exc:
        print(f"forage data check: error: {exc}", file=sys.stderr)
        return 2
    if not report.ok:
        if report.problems:
            print(f"forage data check: error: {args.path}: {report.rows_with_problems} of "
                  f"{report.rows} {args.kind} rows are bad", file=sys.stderr)
            for line in report.lines(args.max_rows):
                print(f"  {line}", file=sys.stderr)
        unknown = report.unknown_sources_line(args.max_rows)
        if unknown:
            print(f"forage data check: error: {unknown}", file=sys.stderr)
        return 2
    sources = ", ".join(sorted(report.sources))
    described = f"; data sources: {sources}" if sources else ""
    print(f"{args.path}: {report.rows} valid {args.kind} rows{described}")
    return 0
