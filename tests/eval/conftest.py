"""A tiny evaluation world for `forage eval`'s tests, built once per session: six people and
the city each was born in, a FAISS flat index over them (the real encoder), the same questions
in FlashRAG's JSON Lines layout (nq/test.jsonl) and in Search-R1's parquet layout (hotpotqa),
and the session's tiny policy (`tiny_policy_dir` in tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FORAGE = [sys.executable, "-m", "services.cli"]
REPO = Path(__file__).resolve().parents[2]


def forage(*args: str, timeout: float = 300, one_thread: bool = False
           ) -> subprocess.CompletedProcess:
    """`forage ARGS` as a user runs it, from the repository root, output captured;
    `one_thread`: with OMP_NUM_THREADS=1 (a child beside another process on the 2 cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1") if one_thread else None
    return subprocess.run([*FORAGE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)

PEOPLE = [("Brixol", "Corvale"), ("Tamra", "Dunmore"), ("Velden", "Ashby"),
          ("Osric", "Pellam"), ("Marrow", "Ilford"), ("Quenby", "Harrow")]


def write_flashrag(path: Path, people=PEOPLE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"test_{i}", "question": f"where was {name} born",
                                        "golden_answers": [city]}) + "\n"
                            for i, (name, city) in enumerate(people)))
    return path


def write_search_r1(path: Path, people=PEOPLE) -> Path:
    """Search-R1's nq_search.py layout: FlashRAG's columns kept, plus the verl ones."""
    from services.common.formats import search_r1_prompt
    from services.tasks.datasets import write_rows

    rows = [{"id": f"dev_{i}", "question": f"Which city was {name} born in?",
             "golden_answers": [city], "data_source": "hotpotqa",
             "prompt": [{"role": "user", "content": search_r1_prompt(f"Which city was {name} "
                                                                     "born in?")}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": [city]}},
             "extra_info": {"split": "dev", "index": i}}
            for i, (name, city) in enumerate(people)]
    return write_rows(path, rows)


def build_index(work: Path, people=PEOPLE, name: str = "index") -> Path:
    from services.retriever.build import build_index as build

    corpus = work / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{who}"\n{who} was born in '
                                          f"{city}. {who} founded a company in {1900 + 7 * i}."})
                              + "\n" for i, (who, city) in enumerate(people)))
    return build(corpus, work / name, "flat", show_progress=False)


@pytest.fixture(scope="session")
def eval_world(tmp_path_factory, tiny_policy_dir) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("eval-world")
    return {"work": work, "policy": Path(tiny_policy_dir), "index": build_index(work),
            "flashrag": write_flashrag(work / "nq" / "test.jsonl"),
            "search_r1": write_search_r1(work / "hotpotqa_dev.parquet")}


def scripted(engine) -> dict[str, int]:
    """Script some turns through the engine's own `forced_tokens` hook (the rest the tiny
    random policy writes itself): the agent's first turn searches the person's name, and
    its second answers right for every other person; direct answers right for every third
    question, rag for every other one. Returns a counter of questions started."""
    started = {"questions": 0}

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    def forced(request):
        if request.tag[0] != "turn":
            return None
        state = request.tag[1]
        question = state.group.extra["question"]
        number = next(i for i, (name, _) in enumerate(PEOPLE) if name in question)
        name, city = PEOPLE[number]
        turn = len(state.turns)
        if turn == 0:
            started["questions"] += 1
        content = str(state.group.prompt[-1]["content"])
        if "<search> query </search>" in content:  # the agent's Search-R1 prompt
            if turn == 0:
                return encode(f"<search> {name} </search>")
            if turn == 1 and number % 2 == 0:
                return encode(f"<answer> {city} </answer>")
            return None
        every = 2 if "Documents:" in content else 3
        if number % every == 0:
            return encode(f"<answer> {city} </answer>")
        return None

    engine.forced_tokens = forced
    return started
