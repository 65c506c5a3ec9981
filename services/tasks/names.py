"""Made-up names for the synthetic world: no model can know facts about them without searching.

Easy worlds (the CPU demo) draw every name part from a small closed vocabulary that the
tokenizer keeps as single tokens; hard worlds use longer names that BPE splits into pieces.
"""

from __future__ import annotations

import random

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "l", "m", "n", "p", "r", "s", "t", "th",
           "v", "z", "c", "h", "j", "kl", "pr", "st", "tr", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia", "y"]
_CODAS = ["", "", "", "n", "r", "l", "s", "x", "th", "m", "nd", "rk", "v"]

# Common short English words a made-up name must not collide with (they would carry meaning
# for the retriever's encoder and for readers).
_AVOID = {"bond", "born", "land", "made", "many", "mile", "more", "most", "name", "town", "trade",
          "than", "them", "then", "there", "this", "what", "when", "where", "which", "with"}


_SIMPLE_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br",
                  "dr", "tr", "st", "th"]
_SIMPLE_VOWELS = ["a", "e", "i", "o", "u"]
_SIMPLE_CODAS = ["", "n", "r", "l", "s", "x", "m"]


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _simple_word(rng: random.Random, syllables: int) -> str:
    """Readable CV-CV(C) words ("Morvan", "Tesil"), for the easy world."""
    parts = [rng.choice(_SIMPLE_ONSETS) + rng.choice(_SIMPLE_VOWELS) for _ in range(syllables)]
    return "".join(parts) + rng.choice(_SIMPLE_CODAS)


def make_names(rng: random.Random, count: int, syllables: tuple[int, int],
               taken: set[str], simple: bool = False) -> list[str]:
    """`count` unique capitalised names of `syllables` (min, max) syllables, none in `taken`.

    Names are also kept from being prefixes of one another, so a search for one name never
    matches the start of another by accident.
    """
    names: list[str] = []
    attempts = 0
    while len(names) < count:
        attempts += 1
        if attempts > 200_000:
            raise RuntimeError(f"could not draw {count} distinct names")
        n = rng.randint(*syllables)
        word = _simple_word(rng, n) if simple else "".join(_syllable(rng) for _ in range(n))
        if not 4 <= len(word) <= 12 or word in _AVOID:
            continue
        name = word.capitalize()
        lowered = name.lower()
        if any(lowered.startswith(t.lower()) or t.lower().startswith(lowered) for t in taken):
            continue
        taken.add(name)
        names.append(name)
    return names
