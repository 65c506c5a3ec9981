"""GSM8K-style arithmetic word problems with integer answers and a `\\boxed{}` answer format.

Each template is a small multi-step story whose numbers are drawn so that every intermediate
and final value is a non-negative integer; the worked solution (kept in extra_info) ends in
`\\boxed{answer}`, which is what math_verify reads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

DATA_SOURCE = "synth_math"
ABILITY = "math"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_NAMES = ["Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gita", "Hugo", "Iris", "Jon", "Kai",
          "Lena", "Mia", "Noor", "Omar", "Pia"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards"]

Problem = tuple[str, str, int]  # question, worked solution, answer


def _shop(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    packs, per_pack, price = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 9)
    total = packs * per_pack
    cost = total * price
    question = (f"{name} buys {packs} packs of {item}. Each pack has {per_pack} {item}, and each "
                f"of the {item} costs ${price}. How many dollars does {name} spend?")
    solution = (f"{name} buys {packs} * {per_pack} = {total} {item}. They cost "
                f"{total} * {price} = {cost} dollars. \\boxed{{{cost}}}")
    return question, solution, cost


def _share(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends = rng.randint(2, 6)
    each = rng.randint(2, 15)
    kept = rng.randint(1, 20)
    start = friends * each + kept
    question = (f"{name} has {start} {item}. {name} keeps {kept} and shares the rest equally "
                f"among {friends} friends. How many {item} does each friend get?")
    solution = (f"{name} shares {start} - {kept} = {start - kept} {item}. Each friend gets "
                f"{start - kept} / {friends} = {each}. \\boxed{{{each}}}")
    return question, solution, each


def _savings(rng: random.Random) -> Problem:
    name = rng.choice(_NAMES)
    weekly, weeks, spent = rng.randint(3, 25), rng.randint(2, 10), rng.randint(1, 20)
    saved = weekly * weeks
    if spent > saved:
        spent = saved // 2
    left = saved - spent
    question = (f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a "
                f"gift. How many dollars does {name} have left?")
    solution = (f"{name} saves {weekly} * {weeks} = {saved} dollars. After the gift, "
                f"{saved} - {spent} = {left} dollars are left. \\boxed{{{left}}}")
    return question, solution, left


def _rows_of_chairs(rng: random.Random) -> Problem:
    rows, per_row, extra, absent = (rng.randint(3, 12), rng.randint(4, 15), rng.randint(1, 10),
                                    rng.randint(1, 9))
    seats = rows * per_row + extra
    guests = seats - absent
    question = (f"A hall has {rows} rows of {per_row} chairs and {extra} extra chairs. Every "
                f"chair is taken except {absent}. How many guests are seated?")
    solution = (f"There are {rows} * {per_row} + {extra} = {seats} chairs. Guests: "
                f"{seats} - {absent} = {guests}. \\boxed{{{guests}}}")
    return question, solution, guests


TEMPLATES: list[Callable[[random.Random], Problem]] = [_shop, _share, _savings, _rows_of_chairs]


def math_rows(count: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """verl rows; ground truth is the answer as a string (math_verify / GSM8K convention)."""
    rng = random.Random(f"math-{seed}-{split}")
    rows = []
    for index in range(count):
        question, solution, answer = rng.choice(TEMPLATES)(rng)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "question": question,
                           "solution": solution},
        })
    return rows
