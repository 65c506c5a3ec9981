"""`forage eval`: Search-R1's evaluation of one or more models in one or more modes.

    forage eval --model DIR [--model DIR ...] --data FILE [--data FILE ...]
                --mode direct|rag|agent [--mode ...] [--index DIR | --retriever-url URL]
                --out OUT [--retrieval live|record|replay] [--protocol tags|tool_calls]
                [--limit N] [--engine transformers|vllm] [--set rollout.KEY=VALUE] ...
    forage eval --model DIR --data FILE --mode agent --out OUT --namespace NS [--redis URL]

Writes OUT/eval.json, OUT/eval.md and OUT/samples.jsonl (docs/eval.md). Torch and the engine
are imported by the handler only, so `forage eval --help` stays quick. A user mistake is one
line on stderr and exit code 2; a retriever that stops answering mid-run is exit code 75 (run
the same command again: finished questions are kept).
"""

from __future__ import annotations

import argparse
import os
import sys

from services.eval.prompts import MODES

RETRIEVAL_MODES = ("live", "record", "replay")


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(bad) or repr(text)} "
                                         f"(choose from {', '.join(MODES)})")
    return modes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def register(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", action="append", required=True, metavar="DIR",
        help="HF model directory (repeat for several models; each is a block of table rows)")
    add("--data", action="append", required=True, metavar="FILE",
        help="questions: Search-R1/verl parquet, FlashRAG .jsonl, or `forage data synth`'s "
             "test.parquet (repeat for several files)")
    add("--mode", action="append", type=_modes, required=True, metavar="MODE",
        help="direct, rag or agent; repeat or comma-separate for several")
    add("--out", required=True, help="output directory (a rerun with it resumes)")
    add("--index", default=None, metavar="DIR",
        help="index to search in this process; with --retriever-url, or with --retrieval "
             "replay, only its identity is read (from its manifest)")
    add("--retriever-url", default=None, metavar="URL",
        help="a running retriever's /retrieve URL (`forage retriever serve`)")
    add("--retrieval", choices=RETRIEVAL_MODES, default="live",
        help="live (default), record (store every result under OUT), replay (from the store, "
             "no index or retriever needed)")
    add("--store", default=None, metavar="FILE",
        help="the retrieval store (default OUT/retrieval.sqlite)")
    add("--data-source", default=None,
        help="data source of FlashRAG files (default: implied by the path, nq/test.jsonl -> nq)")
    add("--limit", type=_positive, default=None, help="at most N questions per data source")
    add("--topk", type=_positive, default=None, help="passages per search (default 3)")
    add("--max-turns", type=_positive, default=4, help="agent search rounds (default 4)")
    add("--max-tokens-per-turn", type=_positive, default=None,
        help="tokens one turn may generate (default 500, Search-R1's)")
    add("--max-obs-length", type=_positive, default=None,
        help="tokens of one <information> block; longer ones are cut (default 500)")
    add("--max-response-length", type=_positive, default=None,
        help="tokens of the whole response, observations included (default 2048)")
    add("--max-prompt-length", type=_positive, default=None,
        help="prompt tokens kept; a longer prompt keeps its last ones, as in training "
             "(default 4096)")
    add("--batch-size", type=_positive, default=32,
        help="questions played together (with --namespace: published and unanswered at once)")
    add("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    add("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    add("--top-k", type=int, default=0,
        help="top-k sampling when --temperature > 0 (0: off)")
    add("--seed", type=int, default=0, help="sampling seed")
    add("--protocol", choices=("tags", "tool_calls"), default=None,
        help="agent rows: tags (Search-R1's <search>/<answer>, default) or tool_calls (the "
             "search tool through the model's chat template, docs/rollout.md)")
    add("--evidence-probe", action="store_true",
        help="agent rows: force each searching trajectory's answer after its information "
             "blocks real, empty and swapped for another question's (docs/eval.md)")
    add("--evidence-samples", type=_positive, default=None, metavar="K",
        help="forced answers per variant and trajectory, at temperature 1 (default 3)")
    add("--engine", choices=("transformers", "vllm"), default="transformers",
        help="generation engine, built by the rollout's factory: transformers (default) or "
             "vllm (a GPU node with the gpu extra)")
    add("--set", action="append", default=[], metavar="rollout.KEY=VALUE", dest="engine_set",
        help="another engine setting, with the rollout's config keys (e.g. "
             "rollout.gpu_memory_utilization=0.5, rollout.vllm_engine_args.kv_cache_dtype=fp8)")
    add("--device", default="cpu", help="cpu (default) or cuda[:N]")
    add("--namespace", default=None, metavar="NS",
        help="play mode agent on the running rollout replicas (`forage rollout serve`) that "
             "serve this Redis stream namespace, instead of an engine in this process")
    add("--redis", default=None, metavar="URL",
        help="with --namespace: the replicas' Redis (default: REDIS_URL, else "
             "redis://127.0.0.1:6379/0)")
    add("--replica-timeout", type=float, default=60.0, metavar="S",
        help="with --namespace: how long to wait for a replica's heartbeat, and for one to "
             "take the first question (default 60)")
    add("--dtype", default="auto", help="auto (float32 on CPU), bfloat16, float16, float32")
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from services.common.cli_errors import TEMPORARY_FAILURE, USAGE_ERROR
    from services.common.config import ConfigError
    from services.eval.evaluate import EvalError, EvalRequest, run
    from services.eval.replicas import REPLICA_FLAGS, ReplicaError, Target
    from services.eval.runner import EvalSettings, PlayError

    modes = list(dict.fromkeys(m for group in args.mode for m in group))
    if args.temperature < 0:
        print("forage eval: error: --temperature must be 0 (greedy) or above", file=sys.stderr)
        return USAGE_ERROR
    if args.evidence_samples is not None and not args.evidence_probe:
        print("forage eval: error: --evidence-samples needs --evidence-probe", file=sys.stderr)
        return USAGE_ERROR
    if args.redis is not None and args.namespace is None:
        print("forage eval: error: --redis needs --namespace (the namespace the replicas "
              "serve)", file=sys.stderr)
        return USAGE_ERROR
    # The flags the replicas' config decides default to None, so that with --namespace a flag
    # given (and only one given) must equal what the replicas play.
    given = {key for key in REPLICA_FLAGS if getattr(args, key) is not None}
    defaults = EvalSettings()
    settings = EvalSettings(
        max_turns=args.max_turns, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, batch_size=args.batch_size,
        evidence_probe=args.evidence_probe, evidence_samples=args.evidence_samples or 3,
        **{key: getattr(args, key) if key in given else getattr(defaults, key)
           for key in REPLICA_FLAGS})
    replicas = None
    if args.namespace is not None:
        url = args.redis or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
        replicas = Target(url=url, namespace=args.namespace, timeout_s=args.replica_timeout)
    request = EvalRequest(models=args.model, data=args.data, modes=modes, out=args.out,
                          index=args.index, retriever_url=args.retriever_url,
                          retrieval=args.retrieval, store=args.store,
                          data_source=args.data_source, limit=args.limit, device=args.device,
                          dtype=args.dtype, engine=args.engine,
                          engine_settings=list(args.engine_set), settings=settings,
                          replicas=replicas, given=given)
    try:
        doc = run(request)
    except (EvalError, ConfigError) as exc:
        print(f"forage eval: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except (PlayError, ReplicaError) as exc:
        print(f"forage eval: error: {exc}", file=sys.stderr)
        return TEMPORARY_FAILURE
    for row in doc["rows"]:
        print(f"{row['label']}: EM {row['em']['average']:.3f} (average over "
              f"{len(row['em']) - 2} data source(s)), {row['n']['all']} questions, searches/q "
              f"{row['searches']['all']:.2f}")
        if "replicas" in row:
            r = row["replicas"]
            print(f"  played by the replicas of namespace {r['namespace']}: model(s) "
                  f"{', '.join(r['models']) or 'not reported'}, policy version(s) "
                  f"{', '.join(map(str, r['policy_versions']))}")
        if "evidence" in row:
            e = row["evidence"]
            gaps = e["gap"]
            print(f"  evidence probe: {e['probed']} probed, {e['skipped_no_search']} without a "
                  f"search; real - none {_signed(gaps['real_minus_none'])}, real - swapped "
                  f"{_signed(gaps['real_minus_swapped'])}")
    print(f"wrote {args.out}/eval.json, eval.md, samples.jsonl (forage inspect {args.out})")
    return 0
