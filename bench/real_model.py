"""A real pretrained model on the Search-R1 recipe: SmolLM2-135M-Instruct, zero-shot.

The synthetic world's answers are fictional, so a model can only get them right by searching.
This plays the world's held-out questions greedily through Forage's agent loop (the transformers
engine, the model's chat template, Search-R1's prompt and tags, a real retriever process on the
world's index) and reports what the model does before any training:

- format: the fraction of questions answered with a well-formed `<answer> ... </answer>`;
- searches per question, invalid turns per question, response tokens per question;
- EM, scored as the scorer scores `qa_em` (Search-R1's exact match on the last answer);
- a tally of how trajectories ended, and a few decoded examples.

    .venv/bin/python bench/real_model.py [--questions 64] [--out runs/real-model]

The model is imported once with `forage model import` (services/tasks/model_import.py) and the
world built once with `forage data synth`; both are reused from --out. The last line printed is
`zero_shot_em: <EM in points>`.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def forage(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def ensure_world(world: Path, seed: int) -> None:
    if (world / "test.parquet").exists() and (world / "index").is_dir():
        return
    subprocess.run(forage("data", "synth", "--out", str(world), "--set", f"data.seed={seed}",
                          "--quiet"), cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def start_retriever(index: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen(forage("retriever", "serve", "--index", str(index), "--port",
                                   str(port)), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the retriever exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/retrieve"
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("the retriever did not answer /healthz within 180 s")


def zero_shot(model_dir: Path, world: Path, questions: int, batch: int, max_turns: int,
              tokens_per_turn: int, threads: int, *, device: str = "cpu", topk: int = 3,
              settings=None) -> dict:
    """Greedy play of the first `questions` held-out questions by the model in `model_dir`.
    `settings` (a LoopSettings) replaces max_turns / tokens_per_turn and this bench's budgets:
    bench/real_learn.py passes the RL run's own, so its figures compare with the learner's
    evaluations."""
    import torch

    from services.learner.prompts import group_from_row
    from services.rollout.agent import AgentLoop, LoopSettings
    from services.rollout.retrieval import RetrieverClient
    from services.rollout.transformers_engine import TransformersEngine
    from services.scorer.rewards.qa import qa_em
    from services.tasks.datasets import load_rows

    torch.set_num_threads(threads)
    rows = load_rows(world / "test.parquet", limit=questions)
    groups = [group_from_row(row, f"q{i}", 1, kind="eval") for i, row in enumerate(rows)]
    engine = TransformersEngine.from_pretrained(str(model_dir), device=device,
                                                max_batch_size=batch, seed=0)
    server, url = start_retriever(world / "index")
    try:
        if settings is None:
            settings = LoopSettings(max_turns=max_turns, max_tokens_per_turn=tokens_per_turn,
                                    max_obs_length=400, max_response_length=2048)
        agent = AgentLoop(engine, settings, RetrieverClient(url, topk=topk))
        started = time.perf_counter()
        trajectories = agent.run(groups)
        wall = time.perf_counter() - started
        agent.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    tok = engine.tokenizer
    scores, examples = [], []
    for group, traj in zip(groups, trajectories, strict=True):
        text = tok.decode(traj.response_ids.tolist(), skip_special_tokens=True)
        scores.append(qa_em(text, group.ground_truth))
        if len(examples) < 3:
            examples.append({"question": group.prompt[-1]["content"][-120:],
                             "response": text[:400], "em": scores[-1]})
    n = len(trajectories)
    policy_tokens = sum(t.num_policy_tokens for t in trajectories)
    return {
        "model": str(model_dir), "questions": n, "wall_s": round(wall, 1),
        "em": sum(scores) / n,
        "format": sum(t.finish_reason == "answer" for t in trajectories) / n,
        "searches_per_question": sum(t.num_searches for t in trajectories) / n,
        "invalid_per_question": sum(t.num_invalid for t in trajectories) / n,
        "response_tokens_per_question": sum(len(t.response_ids) for t in trajectories) / n,
        "policy_tokens_per_s": round(policy_tokens / wall, 1),
        "finish_reasons": dict(collections.Counter(t.finish_reason for t in trajectories)),
        "examples": examples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "real-model")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--tokens-per-turn", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the synthetic world's seed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from services.tasks.model_import import import_gguf

    model_dir = args.out / "smollm2-135m-instruct"
    import_gguf(model_dir)
    world = args.out / f"world-{args.seed}"
    ensure_world(world, args.seed)
    result = zero_shot(model_dir, world, args.questions, args.batch, args.max_turns,
                       args.tokens_per_turn, args.threads)
    (args.out / "zero_shot.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))
    for example in result["examples"]:
        print(f"--- em {example['em']}: ...{example['question']}\n{example['response']}")
    print(f"zero_shot_em: {100 * result['em']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
