"""Rollout throughput benchmark. Same model and prompts for both sides of each ratio.

1. single-turn: generated tokens/s of the agent loop (no tool) ÷ tokens/s of a plain batched
   `model.generate` producing the same number of tokens (EOS disabled on both sides, so both
   produce exactly batch × max_new_tokens). Target ≥ 0.8.
2. multi-turn: trajectories that need 1 to 4 searches (scripted turns of varied length; the
   model still runs a forward pass for every token), policy tokens/s of the continuous loop ÷
   tokens/s of the lockstep loop (all trajectories advance turn by turn, each batch decodes
   until its longest member is done, one /retrieve per round — Search-R1's schedule). Target
   ≥ 1.5. The retriever is a local HTTP server with a fixed latency (--retrieve-ms), so the
   number measures scheduling, not the index. A second, stronger baseline (turn barrier but the
   engine refills slots within a turn, as vLLM would) is printed for information.
3. multi-turn against plain `model.generate`: the same trajectories replayed through a
   Search-R1-style loop on `model.generate` (each round, every unfinished trajectory's whole
   context, left-padded, in batches of --batch; forced to the same turn tokens; stop strings
   `</search>` / `</answer>`; the same observation tokens appended; one /retrieve per round).
   Both sides process exactly the same tokens. Ratio: continuous ÷ that.

Last line: `ratio: <single-turn> <multi-turn> <multi-turn against model.generate>`.

    .venv/bin/python bench/rollout.py [--model DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.trajectory import PromptGroup  # noqa: E402
from services.rollout.agent import AgentLoop, LoopSettings  # noqa: E402
from services.rollout.retrieval import RetrieverClient  # noqa: E402
from services.rollout.transformers_engine import TransformersEngine  # noqa: E402

RETRIEVER_SCRIPT = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
latency = float(sys.argv[1])
docs = [{"id": str(i), "contents": f'"Name{i}"\nName{i} was born in City{i}.'} for i in range(3)]
class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(latency)
        k = body.get("topk") or 3
        result = [[{"document": d, "score": 1.0} for d in docs[:k]] for _ in body["queries"]]
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        return
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def start_retriever(latency_s: float) -> tuple[subprocess.Popen, str]:
    """A stand-in retriever in its own process (as the real one is), fixed latency per call."""
    proc = subprocess.Popen([sys.executable, "-c", RETRIEVER_SCRIPT, str(latency_s)],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}/retrieve"


def prompts(tokenizer, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = ["Brixol", "Tamra", "Velden", "Osric", "Quill", "Marrow", "Zephyr", "Lunet"]
    return [f"Answer the given question. Question: Where was {rng.choice(names)} born?\n"
            for _ in range(count)]


def bench_single_turn(engine: TransformersEngine, batch: int, new_tokens: int,
                      repeats: int = 3) -> dict[str, float]:
    """Agent loop vs plain `model.generate`: tokens/s of each and their ratio (key `ratio`)."""
    tok = engine.tokenizer
    texts = prompts(tok, batch, 0)
    groups = [PromptGroup(uid=f"s{i}", data_source="math", prompt=t, ground_truth="", n=1)
              for i, t in enumerate(texts)]
    engine.eos_ids = frozenset()  # exactly new_tokens per sample on both sides
    settings = LoopSettings(use_search=False, max_turns=0, stop_strings=(),
                            max_tokens_per_turn=new_tokens, max_response_length=new_tokens)
    agent = AgentLoop(engine, settings)
    agent.run(groups[:2])  # warm-up
    loop_time = float("inf")
    for _ in range(repeats):  # best of `repeats` (shared machine)
        start = time.perf_counter()
        trajs = agent.run(groups)
        loop_time = min(loop_time, time.perf_counter() - start)
    loop_tokens = sum(len(t.response_ids) for t in trajs)
    assert loop_tokens == batch * new_tokens, loop_tokens

    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    # on the model's device: CPU inputs to a CUDA model make every decoding step cross devices
    enc = {key: value.to(engine.model.device) for key, value in enc.items()}
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                  temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        engine.model.generate(**{k: v[:2] for k, v in enc.items()}, **kwargs)
        gen_time = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = engine.model.generate(**enc, **kwargs)
            gen_time = min(gen_time, time.perf_counter() - start)
    gen_tokens = (out.shape[1] - enc["input_ids"].shape[1]) * batch
    assert gen_tokens == loop_tokens
    loop_tps, gen_tps = loop_tokens / loop_time, gen_tokens / gen_time
    print(f"single-turn: agent loop {loop_tps:.0f} tok/s ({loop_time:.2f}s), "
          f"model.generate {gen_tps:.0f} tok/s ({gen_time:.2f}s), {loop_tokens} tokens each")
    return {"agent_loop_tokens_per_s": loop_tps, "generate_tokens_per_s": gen_tps,
            "agent_loop_s": loop_time, "generate_s": gen_time, "tokens": loop_tokens,
            "ratio": loop_tps / gen_tps}


def multi_turn_scripts(tokenizer, count: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    filler = "I should look this up and think about what the passage says".split()
    scripts = []
    for _ in range(count):
        turns = []
        for _ in range(rng.randint(1, 4)):
            words = " ".join(rng.choice(filler) for _ in range(rng.randint(2, 90)))
            turns.append(f"<think> {words} </think>\n<search> Name{rng.randint(0, 9)} </search>")
        words = " ".join(rng.choice(filler) for _ in range(rng.randint(2, 90)))
        turns.append(f"<think> {words} </think>\n<answer> City1 </answer>")
        scripts.append([tokenizer.encode(t, add_special_tokens=False) for t in turns])
    return scripts


def run_multi(engine, url, scheduling: str, refill: bool, groups, scripts
              ) -> tuple[float, int, list]:
    engine.refill = refill
    index = {}

    def forced(request):
        state = request.tag[1]
        key = (state.group.uid, state.index)
        script = scripts[index.setdefault(key, len(index)) % len(scripts)]
        return script[min(len(state.turns), len(script) - 1)]

    engine.forced_tokens = forced
    settings = LoopSettings(max_turns=4, max_tokens_per_turn=400, max_obs_length=200,
                            max_response_length=4096, scheduling=scheduling)
    agent = AgentLoop(engine, settings, RetrieverClient(url, topk=2))
    start = time.perf_counter()
    trajs = agent.run(groups)
    elapsed = time.perf_counter() - start
    agent.close()
    tokens = sum(t.num_policy_tokens for t in trajs)
    assert all(t.finish_reason == "answer" for t in trajs), [t.finish_reason for t in trajs]
    return tokens / elapsed, tokens, trajs


def turn_segments(traj) -> list[tuple[list[int], list[int]]]:
    """A trajectory's response as (policy turn tokens, observation tokens after it) pairs, cut
    at the spans its own `turns` record."""
    response = traj.response_ids.tolist()
    nexts = [turn.start for turn in traj.turns[1:]] + [len(response)]
    return [(response[turn.start : turn.end], response[turn.end : following])
            for turn, following in zip(traj.turns, nexts, strict=True)]


class ForceTurn:
    """A `model.generate` logits processor that makes each row produce its scripted turn
    (the same tokens the engine was forced to), then EOS; the model still runs every step."""

    def __init__(self, scripts: list[list[int]], start: int, eos: int) -> None:
        self.scripts, self.start, self.eos = scripts, start, eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        forced = [script[step] if step < len(script) else self.eos for script in self.scripts]
        scores.fill_(float("-inf"))
        scores[torch.arange(len(forced)), torch.tensor(forced)] = 0.0
        return scores


def run_generate_multi(engine, url: str, trajs, batch: int) -> tuple[float, int]:
    """Search-R1's turn loop on plain `model.generate`, replaying `trajs` token for token:
    no KV kept across turns (each round re-reads the whole context), no slot refill within
    a round (a batch decodes until its last row stops). Returns (policy tokens/s, tokens)."""
    from transformers import LogitsProcessorList

    model, tok = engine.model, engine.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    segments = [turn_segments(t) for t in trajs]
    contexts = [t.prompt_ids.tolist() for t in trajs]
    client = RetrieverClient(url, topk=2)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad,
                  stop_strings=["</search>", "</answer>"], tokenizer=tok)
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for round_ in range(max(len(s) for s in segments)):
            active = [i for i, s in enumerate(segments) if len(s) > round_]
            for first in range(0, len(active), batch):
                rows = active[first : first + batch]
                enc = tok.pad({"input_ids": [contexts[i] for i in rows]}, padding=True,
                              padding_side="left", return_tensors="pt")
                ids, mask, width = enc["input_ids"], enc["attention_mask"], enc["input_ids"].shape[1]
                scripts = [segments[i][round_][0] for i in rows]
                force = ForceTurn(scripts, width, eos)
                out = model.generate(input_ids=ids.to(engine.device),
                                     attention_mask=mask.to(engine.device),
                                     max_new_tokens=max(len(s) for s in scripts) + 1,
                                     logits_processor=LogitsProcessorList([force]), **kwargs)
                produced = out[:, width:].tolist()
                assert all(p[: len(s)] == s for p, s in zip(produced, scripts, strict=True))
                tokens += sum(len(s) for s in scripts)
            queries = [trajs[i].turns[round_].query for i in active
                       if trajs[i].turns[round_].action == "search"]
            if queries:  # one /retrieve per round, as in Search-R1's loop
                client.retrieve(queries)
            for i in active:
                policy, observation = segments[i][round_]
                contexts[i] += policy + observation
    elapsed = time.perf_counter() - start
    client.close()
    return tokens / elapsed, tokens


def bench_multi_turn(
    engine, batch: int, groups_n: int, n: int, latency_s: float, repeats: int
) -> float:
    server, url = start_retriever(latency_s)
    try:
        engine.eos_ids = frozenset()
        texts = prompts(engine.tokenizer, groups_n, 1)
        groups = [PromptGroup(uid=f"m{i}", data_source="nq", prompt=t, ground_truth="", n=n)
                  for i, t in enumerate(texts)]
        scripts = multi_turn_scripts(engine.tokenizer, groups_n * n, 2)
        _, _, warm = run_multi(engine, url, "continuous", True, groups[:1], scripts)  # warm-up
        run_generate_multi(engine, url, warm[:2], batch)
        best = {"continuous": 0.0, "lockstep": 0.0, "refill": 0.0, "generate": 0.0}
        for _ in range(repeats):  # interleaved, best of `repeats`: the machine is shared
            cont, tokens, trajs = run_multi(engine, url, "continuous", True, groups, scripts)
            lock, _, _ = run_multi(engine, url, "lockstep", False, groups, scripts)
            lock_refill, _, _ = run_multi(engine, url, "lockstep", True, groups, scripts)
            generate, generated = run_generate_multi(engine, url, trajs, batch)
            assert generated == tokens, (generated, tokens)
            for key, value in (("continuous", cont), ("lockstep", lock), ("refill", lock_refill),
                               ("generate", generate)):
                best[key] = max(best[key], value)
        cont, lock, lock_refill = best["continuous"], best["lockstep"], best["refill"]
        generate = best["generate"]
    finally:
        server.terminate()
        server.wait()
    print(f"multi-turn ({groups_n * n} trajectories, 1-4 searches, batch {batch}, "
          f"{tokens} policy tokens): continuous {cont:.0f} tok/s, lockstep {lock:.0f} tok/s, "
          f"lockstep with in-turn refill {lock_refill:.0f} tok/s "
          f"(continuous/that = {cont / lock_refill:.2f}), Search-R1's loop on model.generate "
          f"{generate:.0f} tok/s (continuous/that = {cont / generate:.2f})")
    return cont / lock, cont / generate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model dir (default: the tiny test policy)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--retrieve-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = args.model
    if model_dir is None:
        from services.tasks.tiny_policy import make_test_policy

        model_dir = str(make_test_policy(Path(tempfile.gettempdir()) / "forage-bench-tiny-policy"))
    engine = TransformersEngine.from_pretrained(model_dir, device=args.device,
                                                max_batch_size=args.batch, seed=0)
    print(f"model {model_dir} on {args.device}, {args.threads} thread(s)")
    single = bench_single_turn(engine, args.batch, args.new_tokens)["ratio"]
    multi, against_generate = bench_multi_turn(engine, args.batch, args.groups, args.n,
                                               args.retrieve_ms / 1000, args.repeats)
    print(f"ratio: {single:.2f} {multi:.2f} {against_generate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
