"""`rollout.retrieval_cache` (docs/rollout.md, "Recorded retrieval"): a replica records every
/retrieve result in `forage eval`'s store, or replays them; a missing query fails its own
trajectory; a store of another index stops the replica at startup; replicas share one file.

The record/replay test plays the real agent loop against the session's real retriever process
(`retriever_url` in tests/rollout/conftest.py); the rest are unit tests."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.retrieval_store import (
    QueryFailed,
    QueryRejected,
    Replay,
    Store,
    StoreError,
    check_index,
    encode,
    replay_settings,
    retrieval_tag,
    settings_key,
)
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.retrieval import RetrieverClient
from services.rollout.retrieval_cache import RetrievalCacheError, open_cache

from .test_agent import scripted

REPO = Path(__file__).resolve().parents[2]
SEARCH = "<think> I need {0} </think>\n<search> {0} </search>"
ANSWER = "<think> done </think>\n<answer> Corvale </answer>"


def group(n: int) -> PromptGroup:
    return PromptGroup(uid="g1", data_source="nq", ground_truth={"target": ["Corvale"]}, n=n,
                       prompt=[{"role": "user", "content": "Where was Brixol born?"}])


def config(mode: str, path: Path, index: Path | str, url: str = "http://127.0.0.1:9/retrieve",
           *more: str):
    return load_config(None, [f"retriever.url={url}", "retriever.topk=2",
                              f"rollout.retrieval_cache.mode={mode}",
                              f"rollout.retrieval_cache.path={path}",
                              f"rollout.retrieval_cache.index={index}",
                              "rollout.retrieval_cache.wait_s=5", *more], environ={})


def fake_index(where: Path, count: int = 4, build_key: str = "a") -> Path:
    """An index directory as far as the identity goes: its manifest only."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "index_type": "flat", "count": count, "build_key": build_key,
         "checksums": {"index.faiss": build_key}, "params": {}}))
    return where


def served_index(tmp_path_factory) -> Path:
    """The directory the session's retriever process serves (tests/rollout/conftest.py)."""
    found = sorted(tmp_path_factory.getbasetemp().glob("retriever*/index/manifest.json"))
    assert found, "the retriever_url fixture's index was not found"
    return found[0].parent


def play(engine, retriever, scripts) -> list:
    scripted(engine, scripts)
    loop = AgentLoop(engine, LoopSettings(scheduling="lockstep"), retriever)
    try:
        return loop.run([group(n=len(scripts))])
    finally:
        loop.close()


def test_record_then_replay_on_a_real_retriever(engine, retriever_url, dead_retriever_url,
                                                tmp_path, tmp_path_factory):
    index = served_index(tmp_path_factory)
    db = tmp_path / "retrieval.sqlite"
    client = RetrieverClient(retriever_url, topk=2, timeout_s=10, retries=1, backoff_s=0.01)
    recording = open_cache(config("record", db, index, retriever_url), client)
    scripts = [[SEARCH.format("Brixol"), ANSWER], [SEARCH.format("Tamra"), ANSWER], [ANSWER]]
    recorded = play(engine, recording, scripts)
    recording.close()
    assert [t.finish_reason for t in recorded] == ["answer"] * 3
    assert [t.num_searches for t in recorded] == [1, 1, 0]

    # Keyed by what the retriever reports it serves (its settings and query precision), and
    # read by `forage eval`'s replay, so eval replays a training store.
    import httpx

    from services.eval.retrieval import read_identity, replay_identity

    health = httpx.get(retriever_url.replace("/retrieve", "/healthz"), timeout=10).json()
    identity, _ = read_identity(index)
    assert health["search_settings"]["query_dtype"] == health["query_dtype"]
    store = Store(db, create=False)
    assert store.identities() == [(identity, settings_key(health["search_settings"]))]
    assert replay_identity(store, str(index)) == (identity, health["search_settings"])
    assert Replay(store, identity, health["search_settings"], 2).retrieve(["Brixol"])[0][0][
        "document"]["contents"].startswith('"Brixol"')
    store.close()
    # Each search turn records who answered it: the key's identity, settings and top-k.
    assert recorded[0].turns[0].index == retrieval_tag(identity, health["search_settings"], 2)

    # Replay: the retriever is never asked (the URL has nobody behind it), same tokens.
    replaying = open_cache(config("replay", db, index, dead_retriever_url), None)
    replayed = play(engine, replaying, scripts)
    assert [t.response_ids.tolist() for t in replayed] == \
        [t.response_ids.tolist() for t in recorded]
    # Retrieval health: a recording asks the retriever (no cache hit), a replay is all hits,
    # and both see the same passages (Tamra's does not name the gold Corvale).
    searched = [(t.turns[0].retrieval, u.turns[0].retrieval)
                for t, u in zip(recorded[:2], replayed[:2], strict=True)]
    assert [(r.cached, p.cached) for r, p in searched] == [(False, True)] * 2
    assert [(r.gold, r.passages) for r, _ in searched] == [(True, 2), (False, 2)]
    assert all((r.gold, r.passages, r.empty) == (p.gold, p.passages, p.empty)
               for r, p in searched)
    # A query the store lacks fails its own trajectory (finish_reason error), not the batch.
    missing = play(engine, replaying, [[SEARCH.format("Osric"), ANSWER], *scripts[:2]])
    replaying.close()
    assert [t.finish_reason for t in missing] == ["error", "answer", "answer"]
    assert "'Osric'" in missing[0].error and "is not in" in missing[0].error


def test_recording_checks_the_retriever_serves_the_named_index(retriever_url, tmp_path):
    other = fake_index(tmp_path / "other", count=99)
    client = RetrieverClient(retriever_url, topk=2)
    with pytest.raises(RetrievalCacheError, match="not the same index"):
        open_cache(config("record", tmp_path / "r.sqlite", other, retriever_url), client)


def test_a_store_of_another_index_is_a_startup_error(tmp_path):
    db = tmp_path / "r.sqlite"
    store = Store(db, create=True)
    store.put("flat-0000000000000000", settings_key({"search_params": {}}), 2,
              [("Brixol", [{"document": {"contents": "x"}, "score": 1.0}])])
    store.close()
    index = fake_index(tmp_path / "index")
    for mode in ("record", "replay"):
        with pytest.raises(RetrievalCacheError, match="another index"):
            open_cache(config(mode, db, index), None)


def test_startup_errors_name_what_is_missing(tmp_path):
    index = fake_index(tmp_path / "index")
    with pytest.raises(RetrievalCacheError, match="no retrieval store"):
        open_cache(config("replay", tmp_path / "none.sqlite", index), None)
    with pytest.raises(RetrievalCacheError, match="set rollout.retrieval_cache.index"):
        open_cache(config("record", tmp_path / "r.sqlite", ""), None)
    with pytest.raises(RetrievalCacheError, match="has no manifest.json"):
        open_cache(config("record", tmp_path / "r.sqlite", tmp_path), None)
    (tmp_path / "junk.sqlite").write_text("not a database, " * 100)
    with pytest.raises(RetrievalCacheError, match="not a retrieval store"):
        open_cache(config("record", tmp_path / "junk.sqlite", index), None)
    assert open_cache(load_config(None, [], environ={}), None) is None  # off by default


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.retrieval_cache.mode=record"], "mode record needs path"),
    (["rollout.retrieval_cache.mode=replay", "rollout.retrieval_cache.path=r.sqlite",
      "rollout.use_search=false"], "use_search is off"),
    (["rollout.retrieval_cache.mode=always"], "'off', 'record', 'replay' or 'cache'"),
    (["rollout.retrieval_cache.mode=cache"], "mode cache needs path"),
    (["rollout.retrieval_cache.max_bytes=-1"], "max_bytes: Input should be greater than or "
                                               "equal to 0"),
])
def test_the_option_is_validated_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, environ={})
    assert load_config(None, ["rollout.retrieval_cache.mode=off"],
                       environ={}).rollout.retrieval_cache.mode == "off"


def test_replay_gives_a_missing_query_its_own_failure(tmp_path):
    store = Store(tmp_path / "r.sqlite", create=True)
    settings = {"search_params": {}}
    store.put("flat-a", settings_key(settings), 2, [("Brixol", QueryRejected("too long"))])
    assert replay_settings(store, "flat-a") == settings
    with pytest.raises(StoreError, match="other search settings"):
        replay_settings(store, "flat-a", {"nprobe": 8})
    with pytest.raises(StoreError, match="another index"):
        check_index(store, "flat-b", "replay")
    got = Replay(store, "flat-a", settings, 2, fail_missing=True).retrieve(["Brixol", "Tamra"])
    assert got[0] == QueryRejected("too long") and isinstance(got[1], QueryFailed)
    with pytest.raises(StoreError, match="'Tamra'"):
        Replay(store, "flat-a", settings, 2).retrieve(["Tamra"])
    store.close()


WRITER = """
import sys
from services.common.retrieval_store import Store
store = Store(sys.argv[1], create=True)
for batch in range(60):
    store.put("flat-a", "{}", 2, [(f"{sys.argv[2]}-{batch}-{i}",
                                   [{"document": {"contents": "x" * 200}, "score": 0.5}])
                                  for i in range(20)])
store.close()
"""


def test_two_processes_write_one_store(tmp_path):
    """Two replicas recording into one file at once: every batch of both is kept."""
    db = tmp_path / "shared.sqlite"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), name], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    with sqlite3.connect(db) as check:
        assert check.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 2 * 60 * 20
        assert check.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_the_replica_plays_through_the_cache(engine, tmp_path):
    """RolloutWorker wires rollout.retrieval_cache into its agent loop (no Redis needed)."""
    from services.rollout.worker import RolloutWorker

    index = fake_index(tmp_path / "index")
    from services.common.retrieval_store import index_identity, read_index_manifest

    store = Store(tmp_path / "r.sqlite", create=True)
    store.put(index_identity(read_index_manifest(index)),
              settings_key({"search_params": {}}), 2, [("Brixol", [])])
    store.close()
    worker = RolloutWorker(config("replay", tmp_path / "r.sqlite", index), engine=engine)
    assert worker.loop.retriever is worker._retrieval_cache
    assert worker.loop.retriever.retrieve(["Brixol"]) == [[]]
    worker._retrieval_cache.close()


# ---------------------------------------------------------------- mode cache (read-through)


def asked_so_far(retriever_url: str) -> float:
    """Queries the retriever process has answered (its forage_retriever_queries_total)."""
    import httpx

    text = httpx.get(retriever_url.replace("/retrieve", "/metrics"), timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("forage_retriever_queries_total "))


def row_bytes(db: Path) -> tuple[int, int]:
    """(the rows' bytes recounted from scratch, what the store's running count says)."""
    with sqlite3.connect(db) as check:
        counted = sum(len(str(a).encode()) + len(str(b).encode()) + len(str(q).encode())
                      + len(str(r).encode()) + 16 for a, b, q, r in check.execute(
                          "SELECT index_id, settings, query, result FROM results"))
        return counted, check.execute("SELECT bytes FROM cache_usage").fetchone()[0]


def test_cache_mode_asks_the_retriever_once_per_distinct_query(engine, retriever_url,
                                                               tmp_path, tmp_path_factory):
    """A GRPO group's samples searching the same words ask the retriever once; the next batch
    of them asks nothing and its search turns are cache hits (retrieval health); a later run
    (a new cache on the same file) hits too; /metrics counts hits and misses."""
    from prometheus_client import REGISTRY

    def counted(result: str) -> float:
        return REGISTRY.get_sample_value("forage_rollout_retrieval_cache_queries_total",
                                         {"result": result}) or 0.0

    index = served_index(tmp_path_factory)
    db = tmp_path / "shared" / "cache.sqlite"
    client = RetrieverClient(retriever_url, topk=2, timeout_s=10, retries=1, backoff_s=0.01)
    cache = open_cache(config("cache", db, index, retriever_url), client)
    scripts = [[SEARCH.format("Brixol"), ANSWER], [SEARCH.format("Brixol"), ANSWER],
               [SEARCH.format("Tamra"), ANSWER]]
    before, hits0, misses0 = asked_so_far(retriever_url), counted("hit"), counted("miss")
    first = play(engine, cache, scripts)
    assert asked_so_far(retriever_url) - before == 2  # Brixol once, Tamra once
    second = play(engine, cache, scripts)
    assert asked_so_far(retriever_url) - before == 2  # nothing more
    assert [t.turns[0].retrieval.cached for t in first + second] == [False] * 3 + [True] * 3
    assert [t.response_ids.tolist() for t in second] == [t.response_ids.tolist() for t in first]
    assert (cache.hits, cache.misses, cache.asked) == (3, 3, 2)
    assert (counted("hit") - hits0, counted("miss") - misses0) == (3, 3)
    cache.close()

    later = open_cache(config("cache", db, index, retriever_url),
                       RetrieverClient(retriever_url, topk=2, timeout_s=10))
    got = later.retrieve(["Tamra", "Velden"])
    assert later.last_hits == [True, False]
    assert got[0][0]["document"]["contents"].startswith('"Tamra"')
    assert asked_so_far(retriever_url) - before == 3  # Velden only
    later.close()
    counted_bytes, kept = row_bytes(db)
    assert counted_bytes == kept > 0
    # The cache's file is a store record and replay read as before (eviction aside).
    replaying = open_cache(config("replay", db, index, retriever_url), None)
    assert replaying.retrieve(["Brixol"])[0][0]["document"]["contents"].startswith('"Brixol"')
    replaying.close()
    # A bound lowered since applies when a replica opens the file (a row is far over 1 byte).
    lowered = open_cache(config("cache", db, index, retriever_url,
                                "rollout.retrieval_cache.max_bytes=1"),
                         RetrieverClient(retriever_url, topk=2))
    assert (lowered.evictions, lowered.bytes) == (3, 0)
    lowered.close()


def test_the_bound_evicts_least_recently_used_rows(tmp_path):
    """max_bytes bounds the rows' bytes: past it the least recently used rows go (a row read
    is used again), and the running count equals a recount; record's put never evicts."""
    db = tmp_path / "cache.sqlite"
    store = Store(db, create=True)
    store.put("flat-a", "{}", 2, [("recorded", [])])  # rows before the cache: used at 0
    store.enable_cache()
    store.enable_cache()  # idempotent (every replica calls it)
    doc = [{"document": {"contents": "x" * 1000}, "score": 0.5}]
    for t in range(1, 6):
        store.cache_put("flat-a", "{}", 2, [(f"q{t}", doc)], used_at=t, max_bytes=0)
    assert store.lookup("flat-a", "{}", 2, ["q1", "q1", "nope"], used_at=10) == {"q1": doc}
    size = len("flat-a{}q1") + len(encode(doc)) + 16  # each cached row's bytes
    _, evicted, used = store.cache_put("flat-a", "{}", 2, [("q6", doc)], used_at=11,
                                       max_bytes=4 * size)
    with sqlite3.connect(db) as check:
        kept = sorted(q for (q,) in check.execute("SELECT query FROM results"))
    assert kept == ["q1", "q4", "q5", "q6"] and evicted == 3  # recorded, q2, q3 went
    assert row_bytes(db) == (used, used) and used <= 4 * size
    # A differing answer is refused, never written over the stored one.
    held, _, _ = store.cache_put("flat-a", "{}", 2, [("q6", [])], used_at=12, max_bytes=0)
    assert held[0].held == doc
    store.close()


def test_a_conflict_serves_the_live_answer_and_warns_once(retriever_url, tmp_path,
                                                          tmp_path_factory, caplog):
    """Another replica writes another answer under the same key between this one's lookup
    and its write (the key misses a setting): the live answer is served, one warning names
    it, the stored row stays."""
    index = served_index(tmp_path_factory)
    db = tmp_path / "cache.sqlite"
    client = RetrieverClient(retriever_url, topk=2, timeout_s=10)
    cache = open_cache(config("cache", db, index, retriever_url), client)
    backend = cache.backend
    other = Store(db, create=False)

    class OtherReplicaFirst:
        def retrieve(self, queries):
            other.put(backend.index_id, backend.settings, 2, [(q, []) for q in queries])
            return client.retrieve(queries)

    backend.inner = OtherReplicaFirst()
    with caplog.at_level("WARNING", logger="forage.rollout.retrieval_cache"):
        got = cache.retrieve(["Osric", "Velden"])
    assert [r[0]["document"]["contents"][:7] for r in got] == ['"Osric"', '"Velden']
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "'Osric'" in warned[0] and "serving the live" in warned[0]
    assert cache.conflicts == 2 and other.get(backend.index_id, backend.settings, 2,
                                              "Osric") == []
    other.close()
    cache.close()


CACHE_REPLICA = """
import sys
from services.common.retrieval_store import ReadThrough, Store
from services.rollout.retrieval import RetrieverClient
store = Store(sys.argv[1], create=True)
store.enable_cache()
client = RetrieverClient(sys.argv[2], topk=2, timeout_s=30)
cache = ReadThrough(client, store, "flat-shared", {"search_params": {}}, 2, int(sys.argv[3]))
names = ["Brixol", "Tamra", "Velden", "Osric"]
for batch in range(40):
    queries = [f"{names[(batch + i) % 4]} {batch % 7}" for i in range(4)]
    for query, result in zip(queries, cache.retrieve(queries)):
        assert result[0]["document"]["contents"].startswith('"' + query.split()[0]), query
store.close()
"""


def test_two_cache_replicas_share_one_file(retriever_url, tmp_path):
    """Two processes in cache mode on one file, with a bound small enough to evict while the
    other writes: both answer every query right, and the rows' running byte count stays
    exact and under the bound."""
    db = tmp_path / "shared.sqlite"
    bound = 4_000  # about 11 of the 28 distinct queries' rows
    procs = [subprocess.Popen([sys.executable, "-c", CACHE_REPLICA, str(db), retriever_url,
                               str(bound)], cwd=REPO, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    counted_bytes, kept = row_bytes(db)
    assert counted_bytes == kept and 0 < kept <= bound
    with sqlite3.connect(db) as check:
        assert 0 < check.execute("SELECT COUNT(*) FROM results").fetchone()[0] < 28  # evicted
