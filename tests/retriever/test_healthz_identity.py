"""/healthz reports the served index's identity (the retrieval store's key), and a replica's
`rollout.retrieval_cache` uses it when the index directory is not at hand; over real HTTP
against the session's retriever process (`server` in tests/retriever/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.common.config import load_config
from services.common.retrieval_store import (
    Store,
    index_identity,
    search_settings,
    settings_key,
)
from services.rollout.retrieval import RetrieverClient
from services.rollout.retrieval_cache import RetrievalCacheError, open_cache


def manifest_of(index: Path) -> dict:
    return json.loads((index / "manifest.json").read_text())


def cache_config(url: str, mode: str, path: Path, index: str = ""):
    return load_config(None, [f"retriever.url={url}", "retriever.topk=2",
                              f"rollout.retrieval_cache.mode={mode}",
                              f"rollout.retrieval_cache.path={path}",
                              f"rollout.retrieval_cache.index={index}",
                              "rollout.retrieval_cache.wait_s=5"], environ={})


def test_healthz_reports_the_identity_the_store_keys_on(server, flat_index):
    reply = httpx.get(f"{server}/healthz", timeout=10)
    assert reply.headers["X-Forage-Service"] == "retriever"  # what `forage up` checks
    health = reply.json()
    manifest = manifest_of(flat_index)
    assert health["index_id"] == index_identity(manifest)
    # the server's query precision is part of it (the fixture's retriever.query_dtype)
    assert health["search_settings"] == search_settings(manifest, query_dtype="float32")
    assert health["index_id"].startswith("flat-")


def test_a_replica_without_the_index_folder_records_under_the_served_identity(
        server, flat_index, tmp_path):
    url = f"{server}/retrieve"
    db = tmp_path / "r.sqlite"
    cache = open_cache(cache_config(url, "record", db), RetrieverClient(url, topk=2))
    try:
        found = cache.retrieve(["castle on a hill"])
    finally:
        cache.close()
    assert len(found[0]) == 2
    manifest = manifest_of(flat_index)
    store = Store(db, create=False)
    # The same key as the folder path gives: a store recorded either way replays either way.
    assert store.identities() == [(index_identity(manifest),
                                   settings_key(search_settings(manifest, None, "float32")))]
    store.close()

    replay = open_cache(cache_config(url, "replay", db), None)
    try:
        assert replay.retrieve(["castle on a hill"]) == found
    finally:
        replay.close()
    # The folder path still works and keys the same.
    replay = open_cache(cache_config("http://127.0.0.1:9/retrieve", "replay", db,
                                     str(flat_index)), None)
    try:
        assert replay.retrieve(["castle on a hill"]) == found
    finally:
        replay.close()


def test_a_store_of_another_index_than_the_served_one_is_an_error(server, tmp_path):
    url = f"{server}/retrieve"
    db = tmp_path / "r.sqlite"
    store = Store(db, create=True)
    store.put("flat-0000000000000000", settings_key({"search_params": {}}), 2,
              [("castle", [{"document": {"contents": "x"}, "score": 1.0}])])
    store.close()
    for mode in ("record", "replay"):
        with pytest.raises(RetrievalCacheError, match="another index"):
            open_cache(cache_config(url, mode, db), RetrieverClient(url, topk=2))


def test_a_folder_of_another_index_than_the_served_one_is_an_error(server, tmp_path):
    """Same type and passage count, another index: only the identity tells them apart."""
    health = httpx.get(f"{server}/healthz", timeout=10).json()
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "index_type": health["index_type"], "count": health["docs"],
         "build_key": "another", "checksums": {"index.faiss": "xxh3_64:0"}, "params": {}}))
    url = f"{server}/retrieve"
    with pytest.raises(RetrievalCacheError, match="not the same index") as caught:
        open_cache(cache_config(url, "record", tmp_path / "r.sqlite", str(other)),
                   RetrieverClient(url, topk=2))
    assert health["index_id"] in str(caught.value)


def test_no_folder_and_no_retriever_names_both_ways_out(tmp_path):
    with pytest.raises(RetrievalCacheError) as caught:
        open_cache(load_config(None, ["retriever.url=http://127.0.0.1:9/retrieve",
                                      "rollout.retrieval_cache.mode=record",
                                      f"rollout.retrieval_cache.path={tmp_path / 'r.sqlite'}",
                                      "rollout.retrieval_cache.wait_s=0.5"], environ={}), None)
    message = str(caught.value)
    assert "did not answer within 0.5s" in message
    assert "set rollout.retrieval_cache.index" in message


def test_retriever_wait_names_the_index_it_waited_for(server, tools):
    import subprocess

    health = httpx.get(f"{server}/healthz", timeout=10).json()
    done = subprocess.run([tools.forage, "retriever", "wait", "--url", f"{server}/retrieve",
                           "--timeout", "10"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"(index {health['index_id']})"), done.stdout
