"""The synthetic search world: fictional entities, a corpus about them, and questions.

Why it is shaped this way (issue 5, "sized for a tiny model"):
- Every question's answer is stated in the corpus, in the passage of the entity the question
  (or its second hop) is about, and nowhere else in that form; a policy that searches the right
  entity can answer, one that guesses scores near 1 / (number of possible values).
- Two-hop questions name an entity whose passage gives a *bridge* entity (a founder, a city),
  and only the bridge's passage holds the answer, so they need two searches.
- Entities are split into train and test; a question mentions only entities of its split and
  bridges only through entities of its split, so test questions reward a strategy, not facts
  remembered from training. Attribute values (cities, countries, occupations, ...) are a shared
  closed vocabulary, like real-world place names.
- Distractor passages mention an entity without its attribute (and with a wrong city), so the
  retriever's top 1 is not always right.
- Easy worlds keep every name part and every answer a single token of a closed vocabulary
  (`whole_words` tells the tokenizer builder); hard worlds use longer sub-word names, longer
  passages and expect top-3 retrieval.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from services.common.formats import corpus_contents, normalize_question, search_r1_prompt
from services.tasks.names import make_names

OCCUPATIONS = ["painter", "chemist", "pilot", "baker", "lawyer", "farmer", "sculptor", "nurse",
               "sailor", "architect", "banker", "poet"]
INDUSTRIES = ["textile", "shipping", "mining", "software", "brewing", "robotics", "fishing",
              "printing", "insurance", "glassware"]
GENRES = ["comedy", "thriller", "western", "musical", "documentary", "horror", "romance",
          "fantasy"]
COMPANY_SUFFIXES = ["Works", "Labs", "Group", "Motors", "Foods", "Systems"]
FILM_NOUNS = ["Dawn", "Tide", "Road", "Song", "Gate", "Winter"]

# Entity counts per size. People are first x last combinations (so every name part is seen in
# training and test names are new combinations); companies and films are root x word.
SIZES: dict[str, dict[str, int]] = {
    "small": {"first": 16, "last": 16, "people": 160, "cities": 24, "countries": 6,
              "company_roots": 14, "companies": 40, "film_roots": 12, "films": 30,
              "distractors": 60},
    "medium": {"first": 40, "last": 40, "people": 800, "cities": 60, "countries": 12,
               "company_roots": 40, "companies": 160, "film_roots": 30, "films": 120,
               "distractors": 300},
}

TEST_FRACTION = 0.2
DATA_SOURCE_SINGLE = "synth_single"
DATA_SOURCE_MULTI = "synth_multihop"
ABILITY = "fact-reasoning"


@dataclass
class Entity:
    name: str
    kind: str  # person | city | country | company | film
    split: str  # train | test | shared
    facts: dict[str, str] = field(default_factory=dict)
    doc_id: str = ""


@dataclass
class World:
    seed: int
    size: str
    hard: bool
    entities: dict[str, Entity]
    corpus: list[dict[str, Any]]
    doc_facts: dict[str, dict[str, str]]  # doc id -> {relation or "mentions_<kind>": value}
    questions: list[dict[str, Any]]
    whole_words: list[str]
    value_types: dict[str, list[str]]  # answer type -> its closed vocabulary
    recommended_topk: int

    def metadata(self) -> dict[str, Any]:
        """world.json: everything the SFT builder and the tests need, in plain JSON."""
        return {
            "seed": self.seed,
            "size": self.size,
            "hard": self.hard,
            "recommended_topk": self.recommended_topk,
            "whole_words": self.whole_words,
            "value_types": self.value_types,
            "entities": {
                name: {"kind": e.kind, "split": e.split, "facts": e.facts, "doc_id": e.doc_id}
                for name, e in self.entities.items()
            },
            "doc_facts": self.doc_facts,
            "counts": {
                "docs": len(self.corpus),
                "train_questions": sum(q["split"] == "train" for q in self.questions),
                "test_questions": sum(q["split"] == "test" for q in self.questions),
            },
        }


# Question templates: (relation path, answer type, phrasings). The first element of the path
# is read from the subject's passage; a second one from the bridge's passage.
QUESTION_TEMPLATES: dict[str, list[tuple[tuple[str, ...], str, list[str]]]] = {
    "person": [
        (("born_in",), "city", ["Where was {s} born", "In which city was {s} born"]),
        (("occupation",), "occupation", ["What is the occupation of {s}",
                                         "What does {s} do for a living"]),
        (("born_in", "country"), "country", ["In which country was {s} born"]),
    ],
    "city": [
        (("country",), "country", ["In which country is {s}", "{s} is a city in which country"]),
    ],
    "company": [
        (("headquarters",), "city", ["Where is {s} headquartered",
                                     "In which city is {s} based"]),
        (("industry",), "industry", ["What industry is {s} in"]),
        (("founder", "born_in"), "city", ["Where was the founder of {s} born"]),
        (("founder", "occupation"), "occupation", ["What is the occupation of the founder of {s}"]),
        (("headquarters", "country"), "country", ["In which country is {s} headquartered"]),
    ],
    "film": [
        (("genre",), "genre", ["What genre is the film {s}"]),
        (("filmed_in",), "city", ["Where was the film {s} shot"]),
        (("director", "born_in"), "city", ["Where was the director of the film {s} born"]),
        (("filmed_in", "country"), "country", ["In which country was the film {s} shot"]),
    ],
}


def build_world(seed: int = 0, size: str = "small", hard: bool = False) -> World:
    """Deterministic for (seed, size, hard)."""
    if size not in SIZES:
        raise ValueError(f"unknown world size {size!r}; choose one of {sorted(SIZES)}")
    counts = SIZES[size]
    rng = random.Random(f"forage-world-{seed}-{size}-{hard}")
    syllables = (3, 4) if hard else (2, 2)
    simple = not hard
    taken = {w.capitalize() for w in OCCUPATIONS + INDUSTRIES + GENRES}
    taken.update(COMPANY_SUFFIXES + FILM_NOUNS)
    firsts = make_names(rng, counts["first"], syllables, taken, simple)
    lasts = make_names(rng, counts["last"], syllables, taken, simple)
    cities = make_names(rng, counts["cities"], syllables, taken, simple)
    countries = make_names(rng, counts["countries"], syllables, taken, simple)
    company_roots = make_names(rng, counts["company_roots"], syllables, taken, simple)
    film_roots = make_names(rng, counts["film_roots"], syllables, taken, simple)

    entities: dict[str, Entity] = {}

    def split_of(items: list[str]) -> dict[str, str]:
        order = items[:]
        rng.shuffle(order)
        n_test = max(1, round(len(order) * TEST_FRACTION))
        return {name: ("test" if i < n_test else "train") for i, name in enumerate(order)}

    for country in countries:
        entities[country] = Entity(country, "country", "shared")
    city_split = split_of(cities)
    for i, city in enumerate(cities):
        # every country gets cities; the first city of each country is its capital
        country = countries[i % len(countries)]
        entities[city] = Entity(city, "city", city_split[city], {"country": country})
    for i, country in enumerate(countries):
        entities[country].facts["capital"] = cities[i]

    def city_for(split: str) -> str:
        # Half the time a city of the entity's own split, so each split has enough two-hop
        # questions bridging through its own cities; otherwise any city, so every city is an
        # answer somewhere in training.
        if rng.random() < 0.5:
            return rng.choice([c for c in cities if city_split[c] == split])
        return rng.choice(cities)

    people = _combinations(rng, firsts, lasts, counts["people"])
    person_split = split_of(people)
    for person in people:
        entities[person] = Entity(person, "person", person_split[person], {
            "born_in": city_for(person_split[person]),
            "occupation": rng.choice(OCCUPATIONS),
        })
    train_people = [p for p in people if person_split[p] == "train"]
    test_people = [p for p in people if person_split[p] == "test"]

    companies = _combinations(rng, company_roots, COMPANY_SUFFIXES, counts["companies"])
    company_split = split_of(companies)
    for company in companies:
        pool = test_people if company_split[company] == "test" else train_people
        entities[company] = Entity(company, "company", company_split[company], {
            "founder": rng.choice(pool),
            "headquarters": city_for(company_split[company]),
            "industry": rng.choice(INDUSTRIES),
        })
    films = _combinations(rng, film_roots, FILM_NOUNS, counts["films"])
    film_split = split_of(films)
    for film in films:
        pool = test_people if film_split[film] == "test" else train_people
        entities[film] = Entity(film, "film", film_split[film], {
            "director": rng.choice(pool),
            "filmed_in": city_for(film_split[film]),
            "genre": rng.choice(GENRES),
        })

    corpus, doc_facts = _write_corpus(rng, entities, people, cities, counts["distractors"], hard)
    questions = _write_questions(rng, entities)
    value_types = {
        "city": sorted(cities),
        "country": sorted(countries),
        "occupation": list(OCCUPATIONS),
        "industry": list(INDUSTRIES),
        "genre": list(GENRES),
    }
    whole_words: list[str] = []
    if not hard:
        whole_words = sorted(set(firsts + lasts + cities + countries + company_roots + film_roots
                                 + COMPANY_SUFFIXES + FILM_NOUNS + OCCUPATIONS + INDUSTRIES
                                 + GENRES))
    return World(seed, size, hard, entities, corpus, doc_facts, questions, whole_words,
                 value_types, recommended_topk=3 if hard else 1)


def _combinations(rng: random.Random, heads: list[str], tails: list[str], count: int) -> list[str]:
    """`count` distinct "head tail" names, each head used about equally often."""
    pairs = [f"{h} {t}" for h in heads for t in tails]
    if count > len(pairs):
        raise ValueError(f"only {len(pairs)} combinations for {count} names")
    rng.shuffle(pairs)
    chosen: list[str] = []
    used_heads: dict[str, int] = {}
    cap = -(-count // len(heads))  # ceil: spread heads evenly
    for pair in pairs:
        head = pair.split(" ")[0]
        if used_heads.get(head, 0) >= cap:
            continue
        used_heads[head] = used_heads.get(head, 0) + 1
        chosen.append(pair)
        if len(chosen) == count:
            break
    return sorted(chosen)


_PERSON_TEXTS = [
    "{s} was born in {born_in}. {s} works as {occupation}.",
    "Born in {born_in}, {s} is {occupation}.",
    "{s} is {occupation}. {s} was born in the city of {born_in}.",
]
def _with_articles(facts: dict[str, str]) -> dict[str, str]:
    """Facts plus "a"/"an" for the common nouns the templates put after an article."""
    out = dict(facts)
    for key in ("occupation", "industry", "genre"):
        if key in facts:
            out[key] = ("an " if facts[key][0] in "aeiou" else "a ") + facts[key]
    return out


_CITY_TEXTS = [
    "{s} is a city in {country}.",
    "The city of {s} lies in {country}.",
]
_COUNTRY_TEXTS = ["{s} is a country. Its capital is {capital}."]
_COMPANY_TEXTS = [
    "{s} is {industry} company founded by {founder}. It is headquartered in {headquarters}.",
    "{founder} founded {s}, {industry} company based in {headquarters}.",
]
_FILM_TEXTS = [
    "{s} is {genre} film directed by {director}. It was shot in {filmed_in}.",
    "{s}, {genre} film, was directed by {director} and shot in {filmed_in}.",
]
_DISTRACTOR_TEXTS = [
    ("Festival of {city}", "{person} and {other} met at the festival of {city}."),
    ("Visit to {city}", "{person} once travelled to {city} to meet {other}."),
    ("{city} exhibition", "An exhibition in {city} showed the work of {person}."),
]
_FILLER = [
    "Little else is recorded about the early years.",
    "Local archives hold several letters on the subject.",
    "The name is sometimes spelled differently in old records.",
    "Historians still debate some of the details.",
]


def _write_corpus(rng: random.Random, entities: dict[str, Entity], people: list[str],
                  cities: list[str], n_distractors: int, hard: bool,
                  ) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    templates = {"person": _PERSON_TEXTS, "city": _CITY_TEXTS, "country": _COUNTRY_TEXTS,
                 "company": _COMPANY_TEXTS, "film": _FILM_TEXTS}
    rows: list[tuple[str, str, dict[str, str]]] = []
    owners: list[Entity | None] = []
    for entity in entities.values():
        text = rng.choice(templates[entity.kind]).format(s=entity.name, **_with_articles(entity.facts))
        if hard:
            text += " " + " ".join(rng.sample(_FILLER, 2))
        rows.append((entity.name, text, dict(entity.facts)))
        owners.append(entity)
    for _ in range(n_distractors):
        person, other = rng.sample(people, 2)
        # a city that is NOT the person's birthplace: reading it as one is wrong
        city = rng.choice([c for c in cities if c != entities[person].facts["born_in"]])
        title, text = rng.choice(_DISTRACTOR_TEXTS)
        rows.append((title.format(city=city),
                     text.format(person=person, other=other, city=city),
                     {"mentions_city": city}))
        owners.append(None)
    order = list(range(len(rows)))
    rng.shuffle(order)
    corpus: list[dict[str, Any]] = []
    doc_facts: dict[str, dict[str, str]] = {}
    for doc_index, row_index in enumerate(order):
        title, text, facts = rows[row_index]
        doc_id = str(doc_index)
        corpus.append({"id": doc_id, "contents": corpus_contents(title, text)})
        doc_facts[doc_id] = facts
        owner = owners[row_index]
        if owner is not None:
            owner.doc_id = doc_id
    return corpus, doc_facts


def _write_questions(rng: random.Random, entities: dict[str, Entity]) -> list[dict[str, Any]]:
    """Every (subject, template) pair once, with a phrasing drawn at random."""
    questions: list[dict[str, Any]] = []
    for entity in entities.values():
        for path, answer_type, phrasings in QUESTION_TEMPLATES.get(entity.kind, []):
            hops = [entity]
            value = entity.facts[path[0]]
            if len(path) == 2:
                bridge = entities[value]
                if bridge.split not in (entity.split, "shared"):
                    continue  # bridge only through entities of the question's own split
                hops.append(bridge)
                value = bridge.facts[path[1]]
                if value in entity.facts.values():
                    continue  # the first passage would state the answer: not really two-hop
            question = normalize_question(rng.choice(phrasings).format(s=entity.name))
            questions.append({
                "question": question,
                "answer": value,
                "answer_type": answer_type,
                "subject": entity.name,
                "relation": "/".join(path),
                "hops": len(path),
                "bridge": hops[1].name if len(hops) == 2 else "",
                "gold_doc_ids": [h.doc_id for h in hops],
                "split": entity.split,
            })
    questions.sort(key=lambda q: (q["split"], q["subject"], q["relation"]))
    return questions


def question_row(question: dict[str, Any], index: int) -> dict[str, Any]:
    """A Search-R1 parquet row (reference/search_r1.md 3) with our extras in extra_info."""
    return {
        "data_source": DATA_SOURCE_MULTI if question["hops"] == 2 else DATA_SOURCE_SINGLE,
        "prompt": [{"role": "user", "content": search_r1_prompt(question["question"])}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": {"target": [question["answer"]]}},
        "extra_info": {
            "split": question["split"],
            "index": index,
            "question": question["question"],
            "answer_type": question["answer_type"],
            "subject": question["subject"],
            "bridge": question["bridge"],
            "relation": question["relation"],
            "hops": question["hops"],
            "gold_doc_ids": list(question["gold_doc_ids"]),
        },
    }


def split_rows(world: World, split: str) -> list[dict[str, Any]]:
    """Rows of one split, shuffled deterministically (so single and two-hop interleave)."""
    chosen = [q for q in world.questions if q["split"] == split]
    random.Random(f"rows-{world.seed}-{split}").shuffle(chosen)
    return [question_row(q, i) for i, q in enumerate(chosen)]
