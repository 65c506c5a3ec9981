"""A corpus as JSON Lines, gzipped JSON Lines or Parquet streams into the same docstore, the same
dense and BM25 indexes and the same answers; a bad record names its file and row."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from services.retriever.build import build_index
from services.retriever.corpus import CorpusError, iter_corpus, scan_corpus
from services.retriever.searcher import Searcher
from tests.suite_rules import import_or_skip

pa = import_or_skip("pyarrow", "a dependency of forage (make install)")
pq = import_or_skip("pyarrow.parquet", "a dependency of forage (make install)")

ROWS = 200
QUERIES = ["a castle with stone walls", "fresh bread in the morning", "zyxquorble",
           "telescope and comets", "wolves in the oak forest"]


def _write_parquet(path, items, row_group_size=64):
    """The same rows as columns: id as a string, null where a row lacks a field."""
    columns = {
        "id": [str(item["id"]) for item in items],
        "title": [item.get("title") for item in items],
        "text": [item.get("text") for item in items],
        "contents": [item.get("contents") for item in items],
    }
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tools):
    base = tmp_path_factory.mktemp("formats")
    plain = base / "corpus.jsonl"
    items = tools.make_corpus(plain, rows=ROWS, seed=5)
    gz = base / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    parquet = base / "corpus.parquet"
    _write_parquet(parquet, items)
    return {"jsonl": plain, "jsonl.gz": gz, "parquet": parquet}


def test_every_format_reads_the_same_docs(corpora):
    docs = {name: list(iter_corpus(path)) for name, path in corpora.items()}
    assert len(docs["jsonl"]) == ROWS
    assert docs["jsonl.gz"] == docs["jsonl"]
    assert docs["parquet"] == docs["jsonl"]
    for name, path in corpora.items():
        assert scan_corpus(path).rows == ROWS, name


def test_parquet_resume_skips_row_groups(corpora):
    everything = list(iter_corpus(corpora["jsonl"]))
    for skip in (0, 63, 64, 150, ROWS - 1, ROWS):
        assert list(iter_corpus(corpora["parquet"], skip=skip)) == everything[skip:]


@pytest.mark.parametrize("kind", ["flat", "bm25"])
def test_every_format_builds_the_same_index_and_answers(corpora, tmp_path, kind):
    answers, stores = {}, {}
    # The encoder is the slow part: the dense build compares Parquet with plain JSON Lines
    # (test_build.py already builds gzipped and plain JSON Lines into the same index).
    names = ["jsonl", "parquet"] if kind == "flat" else list(corpora)
    for name in names:
        path = corpora[name]
        out = build_index(path, tmp_path / f"{kind}-{name}", kind, show_progress=False)
        stores[name] = ((out / "docs.jsonl").read_bytes(), (out / "docs.offsets.npy").read_bytes())
        searcher = Searcher.load(out)
        answers[name] = [[(doc["id"], doc["contents"], round(score, 5)) for doc, score in hits]
                         for hits in searcher.search_many(QUERIES, [5] * len(QUERIES))]
    for name in names:
        assert stores[name] == stores["jsonl"], name
        assert answers[name] == answers["jsonl"], name
    assert answers["jsonl"][2][0][0] == "137"  # the planted keyword's passage


def test_bad_jsonl_record_names_file_and_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "contents": "a"}\n{"id": 2}\n')
    with pytest.raises(CorpusError, match=rf"{path}: row 2: needs 'contents'"):
        list(iter_corpus(path))


def test_bad_parquet_record_names_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    ids = [str(i) for i in range(100)]
    contents = ["passage"] * 100
    contents[77] = None  # no contents and no title+text column
    pq.write_table(pa.table({"id": ids, "contents": contents}), path, row_group_size=32)
    with pytest.raises(CorpusError, match=rf"{path}: row 78: needs 'contents'"):
        list(iter_corpus(path))
    with pytest.raises(CorpusError, match=rf"{path}: row 78: needs 'contents'"):
        build_index(path, tmp_path / "out", "bm25", show_progress=False)
    assert not (tmp_path / "out").exists()

    null_id = tmp_path / "null_id.parquet"
    pq.write_table(pa.table({"id": ["a", None], "contents": ["x", "y"]}), null_id)
    with pytest.raises(CorpusError, match=rf"{null_id}: row 2: missing 'id'"):
        list(iter_corpus(null_id))


def test_parquet_columns_are_checked_before_reading(tmp_path):
    no_id = tmp_path / "no_id.parquet"
    pq.write_table(pa.table({"contents": ["x"]}), no_id)
    with pytest.raises(CorpusError, match="no 'id' column"):
        scan_corpus(no_id)
    binary = tmp_path / "binary.parquet"
    pq.write_table(pa.table({"id": ["1"], "contents": ["x"], "blob": [b"\x00"]}), binary)
    with pytest.raises(CorpusError, match="column 'blob' has type binary"):
        list(iter_corpus(binary))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 not really")
    with pytest.raises(CorpusError, match=rf"corpus {garbage}: not a readable Parquet file"):
        scan_corpus(garbage)


def test_extra_parquet_columns_pass_through(tmp_path):
    path = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"id": [7], "contents": ["x"], "score": [0.5],
                             "tags": [["a", "b"]]}), path)
    assert list(iter_corpus(path)) == [{"id": "7", "contents": "x", "score": 0.5,
                                        "tags": ["a", "b"]}]


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["1"], "contents": ["x"]}), path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(CorpusError, match=r"needs the pyarrow package \(pip install pyarrow\)"):
        scan_corpus(path)


def test_parquet_docstore_line_is_what_jsonl_gives(tmp_path):
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": ["9"], "title": ["T"], "text": ["body"]}), path)
    plain = tmp_path / "one.jsonl"
    plain.write_text(json.dumps({"id": "9", "title": "T", "text": "body"}) + "\n")
    assert list(iter_corpus(path)) == list(iter_corpus(plain))
