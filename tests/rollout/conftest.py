"""Fixtures for the rollout tests: a tiny Qwen2 policy (the data issue's builder when it is
there, else a throwaway one built here) and a loaded engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TAGS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
        "<information>", "</information>"]


def build_throwaway_policy(out_dir: Path, seed: int = 0) -> Path:
    """Byte-level BPE tokenizer with the tags as single tokens + a 2-layer Qwen2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from services.common.formats import CORRECTIVE_MESSAGE, SEARCH_R1_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [SEARCH_R1_TEMPLATE, CORRECTIVE_MESSAGE, "Doc 1(Title: \"Zorba\") Zorba is a city."] * 20
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 pad_token="<|endoftext|>")
    hf.add_tokens(TAGS)
    hf.save_pretrained(out_dir)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id, tie_word_embeddings=True,
        initializer_range=0.5,  # varied greedy outputs, so equality tests mean something
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_policy")
    try:
        from services.tasks.tiny_policy import make_test_policy
    except ImportError:
        return build_throwaway_policy(out)
    return Path(make_test_policy(out, seed=0))


@pytest.fixture()
def engine(tiny_policy_dir):
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    return TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=4, seed=0)


# ---------------------------------------------------------------- retriever

CORPUS = [
    {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale. Brixol founded a company in 1900.'},
    {"id": "1", "contents": '"Tamra"\nTamra was born in Dunmore. Tamra founded a company in 1907.'},
    {"id": "2", "contents": '"Velden"\nVelden was born in Ashby. Velden founded a company in 1914.'},
    {"id": "3", "contents": '"Osric"\nOsric was born in Pellam. Osric founded a company in 1921.'},
]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, timeout: float, proc=None) -> None:
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"retriever exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout}s")


@pytest.fixture(scope="session")
def retriever_url(tmp_path_factory):
    """A real retriever process (`forage retriever build-index` + `serve`) on a small corpus."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("services.retriever.cli") is None:
        # Until the retriever issue lands: a protocol-faithful stand-in (keyword match).
        yield from _standin_retriever()
        return
    work = tmp_path_factory.mktemp("retriever")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    forage = [sys.executable, "-m", "services.cli", "retriever"]
    subprocess.run(forage + ["build-index", "--corpus", str(corpus), "--out", str(work / "index"),
                             "--index", "flat"], check=True, capture_output=True, timeout=300)
    port = _free_port()
    proc = subprocess.Popen(forage + ["serve", "--index", str(work / "index"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", 120, proc)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def dead_retriever_url() -> str:
    return f"http://127.0.0.1:{_free_port()}/retrieve"  # nothing listens there


def _standin_retriever():
    """A stdlib HTTP server speaking Search-R1's /retrieve over CORPUS (word overlap score)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            topk = body.get("topk") or 3
            result = []
            for query in body["queries"]:
                words = set(query.lower().split())
                ranked = sorted(CORPUS, key=lambda d: -len(words & set(d["contents"].lower()
                                                                       .replace('"', " ").split())))
                docs = ranked[:topk]
                if body.get("return_scores"):
                    result.append([{"document": d, "score": 1.0 / (i + 1)}
                                   for i, d in enumerate(docs)])
                else:
                    result.append(docs)
            data = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()
