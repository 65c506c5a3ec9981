"""Schemathesis against both HTTP apps, as real server processes on loopback (issue 14,
"Target"): requests generated from each app's own OpenAPI schema, valid ones and invalid ones,
must never get a server error, every 4xx must carry a message, and every 200 must have the
documented shape. The scorer's schema lists its data sources (an enum), so the generated
requests reach every reward function: the built-in table, the format-aware QA reward in both
modes, token F1, and math_verify in the pool.

Bounded: a fixed number of examples per app and mode (derandomized, so a failure reproduces),
small request limits in the retriever's config so no generated request is slow on CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from services.common.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FORAGE = [sys.executable, "-m", "services.cli"]
EXAMPLES = {GenerationMode.POSITIVE: 150, GenerationMode.NEGATIVE: 100}


def start(args: list[str], health: str, log: Path, timeout: float = 120) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([*FORAGE, *args], cwd=REPO, env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{args[:2]} exited with {process.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(process)
    raise RuntimeError(f"{args[:2]} did not become healthy:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz_retriever")
    corpus = directory / "corpus.jsonl"
    topics = ["river", "castle", "dragon", "harbor", "forest", "bakery", "library", "mine"]
    corpus.write_text("".join(
        f'{{"id": {i}, "title": "{topic.title()} {i}", "text": "The {topic} number {i} '
        f'stands near the {topics[(i + 3) % len(topics)]}."}}\n'
        for i, topic in enumerate(topics * 5)))
    index = directory / "index"
    subprocess.run([*FORAGE, "retriever", "build-index", "--corpus", str(corpus), "--out",
                    str(index), "--no-progress", "--log-level", "WARNING"], cwd=REPO,
                   check=True, capture_output=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    config = directory / "run.yaml"
    config.write_text("retriever:\n  max_batch: 8\n  max_topk: 10\n  max_queries_per_request: 16\n"
                      "  max_query_chars: 200\n  max_request_chars: 1200\n"
                      "  max_body_bytes: 65536\nlog_level: WARNING\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(["retriever", "serve", "--config", str(config), "--index", str(index),
                     "--port", str(port)], f"{url}/healthz", directory / "serve.log")
    yield url
    # uvicorn re-raises the SIGTERM it handled after its graceful shutdown
    assert stop(process) in (0, -signal.SIGTERM), (directory / "serve.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, tiny_policy_dir, redis_url):
    directory = tmp_path_factory.mktemp("fuzz_scorer")
    port = free_port()
    config = directory / "run.yaml"
    config.write_text(
        "log_level: WARNING\n"
        "scorer:\n"
        f"  tokenizer_path: {tiny_policy_dir}\n"
        f"  port: {port}\n"
        "  num_workers: 1\n"
        "  math_timeout_s: 2.0\n"
        "  max_body_bytes: 65536\n"
        "  rewards:\n"
        "    fuzz_format: [{function: qa_em_format}]\n"
        "    fuzz_search_r1: [{function: qa_em_format, options: {mode: search_r1}}]\n"
        "    fuzz_f1: [{function: qa_f1}, {function: qa_subem, weight: 0.5}]\n"
        f"redis:\n  url: {redis_url}\n  namespace: fuzz-{port}\n"
    )
    url = f"http://127.0.0.1:{port}"
    process = start(["scorer", "serve", "--config", str(config)], f"{url}/healthz",
                    directory / "serve.log")
    yield url
    assert stop(process) == 0, (directory / "serve.log").read_text()[-3000:]


def has_message(response) -> bool:
    """A 4xx names its problem: a non-empty `detail` string, or FastAPI's list of field errors
    each with a `msg`."""
    try:
        detail = response.json().get("detail")
    except ValueError:
        return False
    if isinstance(detail, str):
        return bool(detail.strip())
    return isinstance(detail, list) and bool(detail) and all(
        isinstance(item, dict) and item.get("msg") for item in detail)


def fuzz(base_url: str, path: str, mode: GenerationMode, check_ok) -> dict[int, int]:
    """Run the generated cases of one operation; returns how many got each status."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        sent = repr(case.body)[:300]
        assert response.status_code < 500, f"{response.status_code} for {sent}: {response.text}"
        if response.status_code >= 400:
            assert has_message(response), f"{response.status_code} without a message: {sent}"
        else:
            assert response.status_code == 200, sent
            check_ok(case, response.json())

    run()
    return statuses


def check_retrieve(case, body) -> None:
    queries = case.body["queries"]
    assert len(body["result"]) == len(queries)
    for per_query in body["result"]:
        for item in per_query:
            doc = item["document"] if "document" in item else item
            assert isinstance(doc["id"], str) and isinstance(doc["contents"], str)


def check_score(case, body) -> None:
    assert set(body) == {"score", "components", "timeouts"}
    assert body["score"] is None or isinstance(body["score"], float | int)
    assert isinstance(body["components"], dict) and body["components"]
    assert isinstance(body["timeouts"], int) and body["timeouts"] >= 0


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda mode: mode.value)
def test_retrieve_never_answers_5xx(retriever, mode):
    statuses = fuzz(retriever, "/retrieve", mode, check_retrieve)
    if mode is GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > EXAMPLES[mode] // 2, statuses  # most reach the index
    else:
        assert sum(n for status, n in statuses.items() if status >= 400) > 0, statuses


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda mode: mode.value)
def test_score_never_answers_5xx(scorer, mode):
    statuses = fuzz(scorer, "/score", mode, check_score)
    if mode is GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, statuses  # some reach a reward and are scored
    else:
        assert sum(n for status, n in statuses.items() if status >= 400) > 0, statuses
    health = httpx.get(f"{scorer}/healthz", timeout=10)
    assert health.status_code == 200  # still serving after every case


def test_the_scorer_schema_reaches_every_data_source(scorer):
    schema = httpx.get(f"{scorer}/openapi.json", timeout=30).json()
    sources = schema["components"]["schemas"]["ScoreBody"]["properties"]["data_source"]["enum"]
    assert {"nq", "countdown", "synth_math", "gsm8k", "fuzz_format", "fuzz_search_r1",
            "fuzz_f1"} <= set(sources)


def test_scorer_body_limit_from_the_config(scorer):
    reply = httpx.post(f"{scorer}/score", timeout=30,
                       json={"data_source": "nq", "solution_str": "x" * 70_000,
                             "ground_truth": "x"})
    assert reply.status_code == 413 and reply.json()["detail"] == "body: larger than 65536 bytes"
