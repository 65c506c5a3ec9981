"""`forage eval`: Search-R1's evaluation of one or more models in one or more modes.

    forage eval --model DIR [--model DIR ...] --data FILE [--data FILE ...]
                --mode direct|rag|agent [--mode ...] [--index DIR | --retriever-url URL]
                --out OUT [--retrieval live|record|replay] [--protocol tags|tool_calls]
                [--limit N] [--engine transformers|vllm] [--set rollout.KEY=VALUE] ...
    forage eval --model DIR --data FILE --mode agent --out OUT --namespace NS [--redis URL]
    forage eval --run RUN_DIR [--step N] [any flag above, to change what the run did]

Writes OUT/eval.json, OUT/eval.md and OUT/samples.jsonl (docs/eval.md). Torch and the engine
are imported by the handler only, so `forage eval --help` stays quick. A user mistake is one
line on stderr and exit code 2; a retriever that stops answering mid-run is exit code 75 (run
the same command again: finished questions are kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

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
    add("--run", default=None, metavar="RUN_DIR",
        help="evaluate a run's checkpoint as the run's own evaluation did: its held-out "
             "questions, index, agent-loop settings and mode agent from RUN_DIR/config.yaml "
             "(any flag given still wins; docs/eval.md)")
    add("--step", type=int, default=None, metavar="N",
        help="with --run: the checkpoint of step N (default: the latest; 0: the policy the "
             "run started from)")
    add("--model", action="append", default=None, metavar="DIR",
        help="HF model directory (repeat for several models; each is a block of table rows)")
    add("--data", action="append", default=None, metavar="FILE",
        help="questions: Search-R1/verl parquet, FlashRAG .jsonl, or `forage data synth`'s "
             "test.parquet (repeat for several files)")
    add("--mode", action="append", type=_modes, default=None, metavar="MODE",
        help="direct, rag or agent; repeat or comma-separate for several (--run: agent)")
    add("--out", default=None,
        help="output directory (a rerun with it resumes; --run: RUN_DIR/eval/step_N)")
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
    add("--max-turns", type=_positive, default=None, help="agent search rounds (default 4)")
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
    add("--temperature", type=float, default=None, help="0 (default) is greedy")
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
             "vllm (the gpu extra on a GPU node, vLLM's CPU build elsewhere: docs/vllm-cpu.md)")
    add("--set", action="append", default=[], metavar="rollout.KEY=VALUE", dest="engine_set",
        help="another engine setting, with the rollout's config keys (e.g. "
             "rollout.gpu_memory_utilization=0.5, rollout.vllm_engine_args.kv_cache_dtype=fp8)")
    add("--device", default="cpu",
        help="cpu (default) or cuda[:N]: the engine, and the index searched in this process "
             "(--index) unless --retriever-device places it")
    add("--retriever-device", default=None, metavar="DEVICE",
        help="where --index is searched in this process, encoder and index (default: "
             "--device), as retriever.device places `forage retriever serve`")
    add("--index-device", default=None, metavar="DEVICE",
        help="the FAISS index apart from the encoder (retriever.index_device), e.g. cpu where "
             "faiss has no GPU support")
    add("--query-dtype", default=None, choices=("auto", "float32", "float16", "bfloat16"),
        help="precision of the in-process encoder's queries (retriever.query_dtype); auto "
             "(default): float16 on CUDA, as the retriever server")
    add("--namespace", default=None, metavar="NS",
        help="play mode agent on the running rollout replicas (`forage rollout serve`) that "
             "serve this Redis stream namespace, instead of an engine in this process")
    add("--redis", default=None, metavar="URL",
        help="with --namespace: the replicas' Redis (default: REDIS_URL, else "
             "redis://127.0.0.1:6379/0)")
    add("--replica-timeout", type=float, default=60.0, metavar="S",
        help="with --namespace: how long to wait for a replica's heartbeat, and for one to "
             "take the first question (default 60)")
    add("--dtype", default=None,
        help="auto (default; float32 on CPU), bfloat16, float16, float32 (--run: the run's "
             "rollout.dtype)")
    parser.set_defaults(handler=_handle)


def _fail(message: str) -> int:
    from services.common.cli_errors import USAGE_ERROR

    print(f"forage eval: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _inputs(args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """Models, data, modes, OUT, index and engine/retrieval settings: the flags given, the
    run's (`--run`) where one is not, else forage eval's defaults. RunError on a run input
    that is missing."""
    out: dict[str, Any] = {
        "models": args.model, "data": args.data, "out": args.out, "index": args.index,
        "modes": list(dict.fromkeys(m for group in args.mode for m in group)) if args.mode
        else None, "dtype": args.dtype or "auto", "query_dtype": args.query_dtype or "auto",
        "search_params": {}, "run_questions": None, "step": None}
    if run is None:
        return out
    if out["models"] is None:
        out["step"], policy = run.checkpoint(args.step)
        out["models"] = [str(policy)]
    if out["data"] is None:
        out["data"] = run.test_files()
        out["run_questions"] = (run.config.data.max_test_items,
                                run.config.learner.eval_max_questions)
    out["modes"] = out["modes"] or ["agent"]
    searching = any(mode in ("rag", "agent") for mode in out["modes"])
    if (out["index"] is None and args.retriever_url is None and args.retrieval != "replay"
            and searching):
        out["index"] = run.index_dir()
    if out["out"] is None:
        name = f"step_{out['step']:08d}" if out["step"] is not None else "model"
        out["out"] = str(run.run_dir / "eval" / name)
    out["dtype"] = args.dtype or run.config.rollout.dtype
    out["query_dtype"] = args.query_dtype or run.config.retriever.query_dtype
    out["search_params"] = run.search_params()
    return out


def _show_differences(args: argparse.Namespace, run: Any, inputs: dict[str, Any],
                      settings: Any) -> None:
    """On stderr, each setting that differs from how the run evaluated: `--run`'s overrides,
    or, for a --model that is a run's checkpoint, everything the command line does not match."""
    from services.eval.from_run import differences, run_of_model

    runs = [run] if run is not None else [r for r in (run_of_model(m) for m in inputs["models"])
                                          if r is not None]
    seen = set()
    for info in runs:
        if info.run_dir.resolve() in seen:
            continue
        seen.add(info.run_dir.resolve())
        lines = differences(
            info, settings, data=inputs["data"], index=inputs["index"],
            retriever_url=args.retriever_url, limit=args.limit,
            run_questions=inputs["run_questions"] is not None, engine=args.engine,
            device=args.device, dtype=inputs["dtype"], query_dtype=inputs["query_dtype"],
            search_params=inputs["search_params"])
        if not lines:
            continue
        if run is not None:
            print(f"forage eval: --run {info.run_dir}: not as the run evaluated (the flags "
                  "given win):", file=sys.stderr)
        else:
            print(f"forage eval: --model is a checkpoint of run {info.run_dir}, which "
                  f"evaluated otherwise ({info.config_file}; `forage eval --run "
                  f"{info.run_dir}` evaluates as it did):", file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)


def _handle(args: argparse.Namespace) -> int:
    from services.common.cli_errors import TEMPORARY_FAILURE
    from services.common.config import ConfigError
    from services.eval.evaluate import EvalError, EvalRequest, run
    from services.eval.from_run import RunError, RunInfo
    from services.eval.replicas import REPLICA_FLAGS, ReplicaError, Target
    from services.eval.runner import EvalSettings, PlayError

    if args.temperature is not None and args.temperature < 0:
        return _fail("--temperature must be 0 (greedy) or above")
    if args.evidence_samples is not None and not args.evidence_probe:
        return _fail("--evidence-samples needs --evidence-probe")
    if args.redis is not None and args.namespace is None:
        return _fail("--redis needs --namespace (the namespace the replicas serve)")
    if args.step is not None and args.run is None:
        return _fail("--step needs --run (the run whose checkpoint of that step to evaluate)")
    if args.step is not None and args.model is not None:
        return _fail("--step picks the run's checkpoint; --model names another: give one")
    if args.step is not None and args.step < 0:
        return _fail(f"--step must be 0 or above, got {args.step}")
    if args.retriever_url is not None and (args.retriever_device or args.index_device
                                           or args.query_dtype):
        return _fail("--retriever-device, --index-device and --query-dtype place the index "
                     "searched in this process (--index); the retriever at --retriever-url "
                     "decides its own")
    info = None
    if args.run is not None:
        if args.namespace is not None:
            return _fail("--run evaluates a checkpoint in this process; drop --namespace "
                         "(the replicas play the model they serve)")
        try:
            info = RunInfo.read(args.run)
        except RunError as exc:
            return _fail(str(exc))
    else:
        missing = [flag for flag, value in (("--model", args.model), ("--data", args.data),
                                            ("--mode", args.mode), ("--out", args.out))
                   if not value]
        if missing:
            return _fail(f"{', '.join(missing)} required (or --run RUN_DIR: a run's "
                         "checkpoint, evaluated as the run evaluated it)")
    try:
        inputs = _inputs(args, info)
    except RunError as exc:
        return _fail(str(exc))
    # The flags the replicas' config decides default to None, so that with --namespace a flag
    # given (and only one given) must equal what the replicas play.
    given = {key for key in REPLICA_FLAGS if getattr(args, key) is not None}
    defaults = EvalSettings()
    base = info.settings() if info is not None else {}

    def pick(key: str) -> Any:
        value = getattr(args, key, None)
        if value is not None:
            return value
        return base.get(key, getattr(defaults, key))

    settings = EvalSettings(
        max_turns=pick("max_turns"), temperature=pick("temperature"),
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, batch_size=args.batch_size,
        evidence_probe=args.evidence_probe, evidence_samples=args.evidence_samples or 3,
        stop_strings=base.get("stop_strings", defaults.stop_strings),
        data_prompt=info is not None,  # tool_calls: the test file's prompt, as the run asked
        **{key: pick(key) for key in REPLICA_FLAGS})
    _show_differences(args, info, inputs, settings)
    if info is not None:
        step = inputs["step"]
        print(f"forage eval: --run {info.run_dir}: "
              + (f"step {step}, " if step is not None else "")
              + f"{inputs['models'][0]}; {len(inputs['data'])} test file(s); out {inputs['out']}",
              file=sys.stderr)
    replicas = None
    if args.namespace is not None:
        url = args.redis or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
        replicas = Target(url=url, namespace=args.namespace, timeout_s=args.replica_timeout)
    request = EvalRequest(models=inputs["models"], data=inputs["data"], modes=inputs["modes"],
                          out=inputs["out"], index=inputs["index"],
                          retriever_url=args.retriever_url, retrieval=args.retrieval,
                          store=args.store, data_source=args.data_source, limit=args.limit,
                          device=args.device, dtype=inputs["dtype"], engine=args.engine,
                          engine_settings=list(args.engine_set), settings=settings,
                          replicas=replicas, given=given,
                          retriever_device=args.retriever_device,
                          index_device=args.index_device, query_dtype=inputs["query_dtype"],
                          search_params=inputs["search_params"],
                          run_questions=inputs["run_questions"])
    try:
        doc = run(request)
    except (EvalError, ConfigError) as exc:
        return _fail(str(exc))
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
    if info is not None and inputs["step"] is not None:
        _show_run_eval(info, inputs["step"])
    out = inputs["out"]
    print(f"wrote {out}/eval.json, eval.md, samples.jsonl (forage inspect {out})")
    return 0


def _show_run_eval(info: Any, step: int) -> None:
    """The run's own evaluation of the same step, from its metrics.jsonl, to compare with."""
    record = info.evaluations().get(step)
    if record is None or record.get("eval/em") is None:
        print(f"the run has no evaluation of step {step} in {info.run_dir}/metrics.jsonl")
        return
    print(f"the run's own evaluation at step {step}: EM {record['eval/em']:.3f}, "
          f"{record.get('eval/n')} questions, searches/q "
          f"{record.get('eval/searches/mean', 0.0):.2f} ({info.run_dir}/metrics.jsonl)")
