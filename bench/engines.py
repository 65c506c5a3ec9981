"""vLLM beside the transformers engine on one real model: speed and train-inference mismatch.

For each engine (`vllm`, `transformers`) and rollout dtype (float32, bfloat16), in one run on
the same machine and the same prompts:

1. single-turn: --batch sequences of exactly --new-tokens tokens each (EOS ignored, sampled at
   temperature 1), generated tokens/s; best of --repeats.
2. multi-turn: Search-R1 prompts through the model's chat template, the agent loop with a
   local stand-in retriever of fixed latency (bench/rollout.py's), --groups x --n sampled
   trajectories; policy tokens/s.
3. mismatch: the multi-turn trajectories' policy tokens, their log-probs as the engine sampled
   them against the learner's recomputation (services/learner/logprobs.token_logprobs on the
   transformers model in float32, as the CPU learner trains): mean and max |delta log p|, the
   token importance ratio exp(learner - rollout) (std, min, max), and what Forage's rollout
   correction reports for them (verl's `rollout_corr/*` metrics, token IS capped at 2).

Last line: `ratio: <vllm / transformers single-turn> <vllm / transformers multi-turn>` at
float32. Default model: SmolLM2-135M-Instruct imported from its packaged GGUF file.

Each row runs in a process of its own: vLLM's CPU backend sets thread counts, OpenMP binding
and CPU affinity for the process that starts it (with its default VLLM_CPU_OMP_THREADS_BIND=auto
on 2 cores: one core for vLLM, the other reserved), and an engine measured after it in the same
process ran on what was left (the transformers engine at a quarter of its speed).

    .venv/bin/python bench/engines.py [--model DIR] [--engines vllm transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from services.common.formats import search_r1_prompt  # noqa: E402
from services.common.trajectory import PromptGroup  # noqa: E402
from services.rollout.agent import AgentLoop, LoopSettings  # noqa: E402
from services.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from services.rollout.retrieval import RetrieverClient  # noqa: E402

NAMES = ["Brixol", "Tamra", "Velden", "Osric", "Quill", "Marrow", "Zephyr", "Lunet"]


def start_engine(kind: str, model: str, dtype: str, batch: int, eager: bool):
    if kind == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(model, dtype=dtype, enforce_eager=eager,
                                          max_batch_size=batch, kv_cache_gib=2.0, seed=0)
    from services.rollout.transformers_engine import TransformersEngine

    return TransformersEngine.from_pretrained(model, dtype=dtype, max_batch_size=batch, seed=0)


def single_turn(engine, batch: int, new_tokens: int, repeats: int) -> float:
    """Generated tokens/s of `batch` sequences of exactly `new_tokens` tokens (best run)."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]
    best = 0.0
    for _ in range(repeats):
        requests = [GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(
            temperature=1.0, max_tokens=new_tokens, ignore_eos=True)) for _ in range(batch)]
        start = time.perf_counter()
        outputs = engine.generate(requests)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        assert tokens == batch * new_tokens, (tokens, batch * new_tokens)
        best = max(best, tokens / elapsed)
    return best


def multi_turn(engine, url: str, groups: int, n: int, turn_tokens: int):
    """(policy tokens/s, trajectories) of sampled Search-R1 trajectories."""
    batch = [PromptGroup(uid=f"g{i}", data_source="nq", ground_truth={"target": ["City1"]}, n=n,
                         prompt=[{"role": "user", "content": search_r1_prompt(
                             f"Where was {NAMES[i % len(NAMES)]} born? Search first.")}])
             for i in range(groups)]
    settings = LoopSettings(max_turns=3, max_tokens_per_turn=turn_tokens, max_obs_length=96,
                            max_response_length=512, temperature=1.0)
    retriever = RetrieverClient(url, topk=2, timeout_s=5, retries=1, backoff_s=0.01)
    loop = AgentLoop(engine, settings, retriever)
    start = time.perf_counter()
    trajectories = loop.run(batch)
    elapsed = time.perf_counter() - start
    loop.close()
    policy = sum(int(t.loss_mask.sum()) for t in trajectories)
    return policy / elapsed, trajectories


def mismatch(trajectories, model_dir: str) -> dict[str, float]:
    """The learner's float32 log-probs of every policy token against the engine's."""
    from transformers import AutoModelForCausalLM

    from services.learner.algorithms.rollout_correction import rollout_correction
    from services.learner.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    learner, rollout = [], []
    for t in trajectories:
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        with torch.no_grad():
            logp = token_logprobs(model(ids).logits.float(), ids)[0, len(t.prompt_ids):]
        mask = torch.as_tensor(t.loss_mask) > 0
        learner.append(logp[mask])
        rollout.append(torch.as_tensor(t.rollout_logprobs, dtype=torch.float32)[mask])
    train, sampled = torch.cat(learner), torch.cat(rollout)
    gap = (train - sampled).abs()
    ratio = torch.exp(train - sampled)
    _, _, corr = rollout_correction(train[None], sampled[None], torch.ones(1, len(train)),
                                    rollout_is="token", rollout_is_threshold=2.0)
    out = {"tokens": float(len(train)), "mean_abs_dlogp": gap.mean().item(),
           "max_abs_dlogp": gap.max().item(), "ratio_std": ratio.std().item(),
           "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item()}
    out.update({k: float(v) for k, v in corr.items()})
    return out


def measure_row(args: argparse.Namespace, model: str, kind: str, dtype: str) -> dict:
    """One engine at one dtype, in this process: start, single turn, multi-turn, mismatch."""
    from rollout import start_retriever  # bench/rollout.py's stand-in retriever

    proc, url = start_retriever(args.retrieve_ms / 1000)
    try:
        start = time.perf_counter()
        engine = start_engine(kind, model, dtype, args.batch * 2, not args.compiled)
        started = time.perf_counter() - start
        single = single_turn(engine, args.batch, args.new_tokens, args.repeats)
        multi, trajectories = multi_turn(engine, url, args.groups, args.n, args.turn_tokens)
        if hasattr(engine, "close"):
            engine.close()
        del engine
    finally:
        proc.terminate()
    return {"engine": kind, "dtype": dtype, "start_s": started, "single_tok_s": single,
            "multi_policy_tok_s": multi, "threads_bind": os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND", "auto"), "compiled": bool(args.compiled),
            **mismatch(trajectories, model)}


def default_model() -> str:
    from services.tasks.model_import import import_gguf

    out = ROOT / "runs" / "bench-smollm2"
    import_gguf(out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engines", nargs="+", default=["vllm", "transformers"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--retrieve-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM without enforce_eager (its compiled graphs)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # ENGINE:DTYPE, in a child process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    if args.row:
        kind, dtype = args.row.split(":")
        print(json.dumps(measure_row(args, model, kind, dtype)), flush=True)
        return
    rows = []
    for dtype in args.dtypes:
        for kind in args.engines:
            argv = [a for a in sys.argv[1:]]
            if args.model is None:
                argv += ["--model", model]
            done = subprocess.run([sys.executable, __file__, *argv, "--row", f"{kind}:{dtype}"],
                                  stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{kind} {dtype}: the row's process exited {done.returncode}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'engine':12} {'dtype':9} {'start s':>8} {'1-turn tok/s':>13} {'multi tok/s':>12} "
          f"{'mean|dlogp|':>12} {'max|dlogp|':>11} {'ratio std':>10} {'ratio min..max':>16}")
    for r in rows:
        print(f"{r['engine']:12} {r['dtype']:9} {r['start_s']:8.1f} {r['single_tok_s']:13.1f} "
              f"{r['multi_policy_tok_s']:12.1f} {r['mean_abs_dlogp']:12.2e} "
              f"{r['max_abs_dlogp']:11.2e} {r['ratio_std']:10.2e} "
              f"{r['ratio_min']:7.3f}..{r['ratio_max']:<7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    by = {(r["engine"], r["dtype"]): r for r in rows}
    v, t = by.get(("vllm", "float32")), by.get(("transformers", "float32"))
    if v and t:
        print(f"ratio: {v['single_tok_s'] / t['single_tok_s']:.2f} "
              f"{v['multi_policy_tok_s'] / t['multi_policy_tok_s']:.2f}")


if __name__ == "__main__":
    main()
