"""Part 2: the transformers rollout engine on CUDA. Tokens/s of Forage's agent loop (continuous
batching, its own KV cache) against plain batched `model.generate` decoding the same thing:
the same batch of prompts (the loop's own prompt token ids), exactly the same number of new
tokens, EOS ignored and greedy decoding on both sides, each side warmed up on that batch and
timed best of its runs. Greedy makes the two outputs comparable token for token, so the report
also says how many sequences came out identical. Model: Qwen2.5-0.5B-shaped, random weights,
bf16.

Why greedy and not sampling: the two sides sample differently (the engine inverts each row's
CDF with one random number, generate calls torch.multinomial), so a sampled comparison times
the samplers as well as the decoding, and its outputs cannot be checked against each other.

    python bench/gpu/engine_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PartReport, part_main, peak_memory_gib, say, synchronize, torch_device  # noqa: E402
from models import shaped_model  # noqa: E402


def best_time(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """One warm-up call, then the fastest of `repeats` timed calls, and the last call's result
    (the same every time: greedy)."""
    run()
    best, result = float("inf"), None
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        result = run()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def generate_greedy(model: Any, tokenizer: Any, prompt_ids: list[list[int]],
                    new_tokens: int) -> Callable[[], list[list[int]]]:
    """A call of `model.generate` on `prompt_ids` (left-padded, on the model's device): greedy,
    exactly `new_tokens` each. EOS is ignored by giving generate a configuration without one;
    generate fills an unset EOS from the model's own configuration, so that is swapped for
    the call rather than passed beside it (min_new_tokens would not do: it bans EOS, which
    changes the greedy choice where the engine, ignoring EOS, may pick it)."""
    import torch
    from transformers import GenerationConfig

    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")
    enc = {key: value.to(model.device) for key, value in enc.items()}
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id, use_cache=True)
    width = enc["input_ids"].shape[1]

    def call() -> list[list[int]]:
        own, model.generation_config = model.generation_config, config
        try:
            with torch.inference_mode():
                out = model.generate(**enc, generation_config=config)
        finally:
            model.generation_config = own
        return out[:, width:].tolist()

    return call


def greedy_against_generate(engine: Any, batch: int, new_tokens: int,
                            repeats: int) -> dict[str, Any]:
    """The agent loop and `model.generate` on the same `batch` prompts, `new_tokens` each."""
    from rollout import prompts

    from services.common.trajectory import PromptGroup
    from services.rollout.agent import AgentLoop, LoopSettings

    groups = [PromptGroup(uid=f"s{i}", data_source="math", prompt=text, ground_truth="", n=1)
              for i, text in enumerate(prompts(engine.tokenizer, batch, 0))]
    engine.eos_ids = frozenset()  # EOS ignored: every sequence makes exactly new_tokens
    settings = LoopSettings(use_search=False, max_turns=0, stop_strings=(), temperature=0.0,
                            max_tokens_per_turn=new_tokens, max_response_length=new_tokens)
    agent = AgentLoop(engine, settings)
    loop_s, trajectories = best_time(lambda: agent.run(groups), repeats)
    loop_out = [[int(x) for x in t.response_ids] for t in trajectories]
    prompt_ids = [[int(x) for x in t.prompt_ids] for t in trajectories]
    generate = generate_greedy(engine.model, engine.tokenizer, prompt_ids, new_tokens)
    gen_s, gen_out = best_time(generate, repeats)
    lengths = {len(seq) for seq in loop_out + gen_out}
    if lengths != {new_tokens}:
        raise RuntimeError(f"sequences of {sorted(lengths)} tokens, not {new_tokens}: "
                           "EOS was not ignored on one side")
    tokens = batch * new_tokens
    same = sum(a == b for a, b in zip(loop_out, gen_out, strict=True))
    positions = sum(x == y for a, b in zip(loop_out, gen_out, strict=True)
                    for x, y in zip(a, b, strict=True))
    return {"decoding": "greedy", "eos": "ignored", "tokens": tokens,
            "agent_loop_s": loop_s, "generate_s": gen_s,
            "agent_loop_tokens_per_s": tokens / loop_s, "generate_tokens_per_s": tokens / gen_s,
            "agent_loop_step_ms": 1000 * loop_s / new_tokens,
            "generate_step_ms": 1000 * gen_s / new_tokens,
            "ratio": gen_s / loop_s, "identical_sequences": same,
            "identical_token_share": positions / tokens}


def measure(args: argparse.Namespace, report: PartReport) -> None:
    import torch

    from services.rollout.transformers_engine import TransformersEngine

    shape = "toy" if args.dry_run else "qwen2.5-0.5b"
    settings = [(4, 8, 1)] if args.dry_run else [(16, 128, 2)]
    torch.manual_seed(0)
    device = torch_device()
    model_dir = shaped_model(shape)
    for batch, new_tokens, repeats in settings:
        report.stage(f"{shape}, batch {batch} x {new_tokens} new tokens")
        engine = TransformersEngine.from_pretrained(str(model_dir), device=device,
                                                    max_batch_size=batch, seed=0)
        figures = greedy_against_generate(engine, batch, new_tokens, repeats)
        result = {"shape": shape, "batch": batch, "new_tokens": new_tokens,
                  "dtype": str(engine.model.dtype).removeprefix("torch."),
                  **{k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
                  "peak_memory_gib": peak_memory_gib()}
        say(f"engine: {result}")
        report.add(result)
        del engine


def main(argv: list[str] | None = None) -> int:
    return part_main("engine", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
