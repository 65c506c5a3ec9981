"""Hostile input to the rewards and to POST /score (issue 14 item 5): answer-tag parsing is
linear (1 MB of `<answer>` took minutes with the old lazy regex), every reward /score reaches
runs in the killable pool with its time limit (a custom reward that sleeps is cut off), bodies
over `scorer.max_body_bytes` are refused with 413, and the schema lists the data sources."""

from __future__ import annotations

import re
import textwrap
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config.scorer import ScorerSection
from services.scorer.app import HttpServer, create_app
from services.scorer.pool import RewardPool
from services.scorer.rewards import RewardTable, compute_score
from services.scorer.rewards.qa import qa_em_format
from services.scorer.rewards.text import last_answer, tag_contents
from services.scorer.scoring import Scorer

MEGABYTE = 1_000_000
QA_GT = {"target": ["Paris"]}

# ---------------------------------------------------------------- linear parsing


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">",
                                 "x", " ", "\n", "<information>", "</information>"]),
                max_size=30).map("".join),
       st.sampled_from(["answer", "information"]))
def test_tag_contents_is_what_the_lazy_regex_found(text, tag):
    """The old pattern is the oracle: same blocks, same order, on any mix of tag fragments."""
    oracle = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    assert tag_contents(text, tag) == oracle


def test_tag_contents_on_ordinary_responses():
    text = "<think>x</think><answer> Paris </answer> then <answer>Lyon</answer><answer>open"
    assert tag_contents(text, "answer") == [" Paris ", "Lyon"]
    assert last_answer(text) == "Lyon"
    assert last_answer("<answer><answer> a </answer>") == "<answer> a"  # lazy from the first
    assert tag_contents("no tags", "answer") == []


HOSTILE_TEXTS = {
    "open answer tags": "<answer>" * (MEGABYTE // 8),
    "one open tag, then text": "<answer>" + "x" * MEGABYTE,
    "open information tags": "<think>x</think>" + "<information>" * (MEGABYTE // 13),
    "closed pairs": "<answer></answer>" * (MEGABYTE // 17),
    "assistant markers": "<|im_start|>assistant" * (MEGABYTE // 21) + "<answer>",
}
REWARDS = {
    "qa_em": lambda text: compute_score("nq", text, QA_GT),
    "qa_em_format": lambda text: qa_em_format(text, QA_GT),
    "qa_em_format search_r1": lambda text: qa_em_format(text, QA_GT, mode="search_r1"),
    "qa_f1": lambda text: compute_score(
        "nq", text, QA_GT, table=RewardTable({"nq": [{"function": "qa_f1"}]})),
    "countdown": lambda text: compute_score("countdown", text, {"target": 3, "numbers": [1, 2]}),
}


@pytest.mark.parametrize("shape", list(HOSTILE_TEXTS))
@pytest.mark.parametrize("reward", list(REWARDS))
def test_a_megabyte_of_tags_is_scored_at_once(reward, shape):
    """64 KB of `<answer>` took 2.3 s with `<answer>(.*?)</answer>` (quadratic): a megabyte
    would have taken about ten minutes per reward call."""
    started = time.perf_counter()
    value = REWARDS[reward](HOSTILE_TEXTS[shape])
    elapsed = time.perf_counter() - started
    assert isinstance(value, float)
    assert elapsed < 2.0, f"{reward} on {shape}: {elapsed:.2f}s"


# ---------------------------------------------------------------- POST /score

SLEEPY = textwrap.dedent("""
    import time

    def sleepy(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(120)
        return 1.0

    def echo_length(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str))
""")
POOL_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def sleepy_module(tmp_path_factory):
    """A users' reward module on sys.path (spawned pool workers inherit sys.path)."""
    import sys

    directory = tmp_path_factory.mktemp("rewards")
    (directory / "forage_sleepy_rewards.py").write_text(SLEEPY)
    sys.path.insert(0, str(directory))
    yield "forage_sleepy_rewards"
    sys.path.remove(str(directory))
    sys.modules.pop("forage_sleepy_rewards", None)


@pytest.fixture(scope="module")
def server(sleepy_module):
    """/score over a real pool (one worker, 2 s limit) with two users' rewards, neither marked
    `isolated` (before issue 14 they ran on the HTTP thread without a limit)."""
    table = RewardTable({"slow_task": [{"function": f"{sleepy_module}:sleepy"}],
                         "length_task": [{"function": f"{sleepy_module}:echo_length"}]})
    pool = RewardPool(num_workers=1, timeout_s=POOL_TIMEOUT_S).start()
    scorer = Scorer(table, pool=pool, inner_timeout_s=1)
    http = HttpServer(create_app(scorer, ScorerSection(max_body_bytes=1_200_000))).start()
    yield http.url
    http.stop()
    pool.close()


def test_a_slow_users_reward_is_cut_off_and_the_next_request_is_served(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        started = time.monotonic()
        reply = client.post("/score", json={"data_source": "slow_task", "solution_str": "x"})
        elapsed = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"score": 0.0, "components": {"forage_sleepy_rewards:sleepy": 0.0},
                                "timeouts": 1}
        assert elapsed < POOL_TIMEOUT_S + 10, elapsed  # not the reward's 120 s
        reply = client.post("/score", json={"data_source": "length_task",
                                            "solution_str": "four"})
        assert reply.status_code == 200 and reply.json()["score"] == 4.0
        reply = client.post("/score", json={"data_source": "nq",
                                            "solution_str": "<answer>Paris</answer>",
                                            "ground_truth": QA_GT})
        assert reply.json()["score"] == 1.0


def test_a_megabyte_of_answer_tags_over_http(server):
    body = {"data_source": "nq", "solution_str": "<answer>" * (MEGABYTE // 8),
            "ground_truth": QA_GT}
    started = time.monotonic()
    reply = httpx.post(f"{server}/score", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert reply.json()["score"] == 0.0 and reply.json()["timeouts"] == 0
    assert elapsed < 2.0, elapsed


def test_an_oversized_body_is_413(server):
    text = "x" * 1_300_000
    reply = httpx.post(f"{server}/score", timeout=60,
                       json={"data_source": "nq", "solution_str": text, "ground_truth": "x"})
    assert reply.status_code == 413
    assert reply.json() == {"detail": "body: larger than 1200000 bytes"}

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"data_source": "nq", "solution_str": "'
        for _ in range(20):
            yield b"x" * 100_000
        yield b'"}'

    reply = httpx.post(f"{server}/score", content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"data_source": "nq", "solution_str": "<answer>x</answer>",
          "ground_truth": {"target": [2**64]}}, 422, "cannot send the item"),
        ({"data_source": "nq", "solution_str": "\ud800", "ground_truth": QA_GT}, 422,
         "cannot send the item"),
        ({"data_source": "nq", "solution_str": "<answer>x</answer>",
          "ground_truth": {"wrong": 1}}, 422, "target"),
        ({"data_source": "nowhere", "solution_str": "x"}, 404, "known:"),
        ({"data_source": "nq"}, 422, "solution_str"),
        ({"data_source": "nq", "solution_str": "x", "groundtruth": "Paris"}, 422, "groundtruth"),
    ],
)
def test_bad_items_are_4xx_naming_the_problem(server, body, status, words):
    import json

    content = json.dumps(body).encode()  # json.dumps keeps the lone surrogate as \ud800
    reply = httpx.post(f"{server}/score", content=content, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert words in json.dumps(reply.json()["detail"])


def test_deep_nesting_is_a_4xx(server):
    deep = "[" * 100_000 + "]" * 100_000
    content = ('{"data_source": "nq", "solution_str": "x", "ground_truth": ' + deep + "}")
    reply = httpx.post(f"{server}/score", content=content.encode(), timeout=60,
                       headers={"content-type": "application/json"})
    assert 400 <= reply.status_code < 500 and reply.json()["detail"]
    medium = "[" * 900 + '"Paris"' + "]" * 900  # parses: scored like any ground truth
    content = '{"data_source": "nq", "solution_str": "x", "ground_truth": ' + medium + "}"
    reply = httpx.post(f"{server}/score", content=content.encode(), timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json()["score"] == 0.0


def test_openapi_lists_the_data_sources(server):
    schema = httpx.get(f"{server}/openapi.json", timeout=30).json()
    field = schema["components"]["schemas"]["ScoreBody"]["properties"]["data_source"]
    assert {"nq", "countdown", "synth_math", "slow_task", "length_task"} <= set(field["enum"])
    assert {"404", "413", "422"} <= set(schema["paths"]["/score"]["post"]["responses"])
