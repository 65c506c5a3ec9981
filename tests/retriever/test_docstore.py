"""The document store serves passage N of a large corpus with bounded memory."""

from __future__ import annotations

import json

import psutil
import pytest

from services.retriever.corpus import iter_corpus, scan_corpus
from services.retriever.docstore import DocStore, DocStoreError, DocStoreWriter

ROWS = 150_000


def _row(n: int) -> dict:
    return {"id": f"p{n}", "title": f"Passage {n}",
            "text": f"Text of passage number {n}. " + "filler words " * 8}


@pytest.fixture(scope="module")
def large_store(tmp_path_factory):
    directory = tmp_path_factory.mktemp("docstore")
    corpus = directory / "corpus.jsonl"
    with open(corpus, "w") as handle:
        for n in range(ROWS):
            handle.write(json.dumps(_row(n)) + "\n")
    stats = scan_corpus(corpus)
    assert stats.rows == ROWS
    writer = DocStoreWriter(directory, stats.rows)
    for doc in iter_corpus(corpus):
        writer.add(doc)
    writer.close()
    return directory


@pytest.mark.slow
def test_serves_any_row_without_loading_the_corpus(large_store):
    docs_bytes = (large_store / "docs.jsonl").stat().st_size
    assert docs_bytes > 20 * 1024 * 1024
    process = psutil.Process()
    before = process.memory_info().rss
    store = DocStore(large_store)
    assert len(store) == ROWS
    for n in (0, 1, 77_777, ROWS // 2, ROWS - 1):
        doc = store.get(n)
        row = _row(n)
        assert doc == {"id": row["id"], "contents": f'"{row["title"]}"\n{row["text"]}'}
    grown = process.memory_info().rss - before
    assert grown < docs_bytes / 4, f"RSS grew by {grown} bytes for a {docs_bytes}-byte store"
    with pytest.raises(IndexError):
        store.get(ROWS)
    store.close()


def test_truncated_store_is_refused(tmp_path):
    writer = DocStoreWriter(tmp_path, 3)
    for n in range(3):
        writer.add({"id": str(n), "contents": f"doc {n}"})
    writer.close()
    assert DocStore(tmp_path).get(2) == {"id": "2", "contents": "doc 2"}
    with open(tmp_path / "docs.jsonl", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(DocStoreError, match="truncated"):
        DocStore(tmp_path)
    (tmp_path / "docs.offsets.npy").write_bytes(b"garbage")
    with pytest.raises(DocStoreError, match="offsets"):
        DocStore(tmp_path)


def test_resume_truncates_to_the_checkpoint(tmp_path):
    writer = DocStoreWriter(tmp_path, 4)
    writer.add({"id": "0", "contents": "a"})
    writer.add({"id": "1", "contents": "b"})
    writer.flush()
    checkpoint = (writer.rows, writer.bytes)
    writer.add({"id": "2", "contents": "lost in a crash"})
    writer.close()
    resumed = DocStoreWriter(tmp_path, 4, resume_rows=checkpoint[0], resume_bytes=checkpoint[1])
    resumed.add({"id": "2", "contents": "c"})
    resumed.add({"id": "3", "contents": "d"})
    resumed.close()
    store = DocStore(tmp_path)
    assert [store.get(n)["contents"] for n in range(4)] == ["a", "b", "c", "d"]
