"""Document store at scale: memory of the build's streaming pass and of a serving docstore.

    .venv/bin/python bench/docstore_scale.py [--n 1000000] [--words 80] [--formats jsonl,parquet]

Synthetic passages (seed 0): `--words` words drawn from a 5000-word vocabulary, a title of
three words, ids "0".."N-1"; written once as JSON Lines (id + title + text, the FlashRAG
shape) and as Parquet (same columns, 16384-row groups). Each measurement runs in its own
child process, so its peak RSS (VmHWM) is its own:

- build: `iter_corpus` → `DocStoreWriter`, the pass `build-index` makes over the corpus
  (without the encoder), for each format; peak RSS, seconds, and bytes written
  (docs.jsonl + docs.offsets.npy);
- serve: `DocStore` opened as the server opens it (memory-mapped), then `--lookups` (20000)
  random `get(row)`s; RSS (VmRSS, counting mapped pages it touched, shared with the page
  cache), and RssAnon (private memory) before opening and after the lookups;
- baseline: a child that imports the same modules and does nothing, for comparison.

The corpus (about 0.6 GB at 1M × 80 words) and the store are written under `--dir` (a temp
directory by default, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 5000
GROUP_ROWS = 16384


def _status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _peak() -> int:
    """VmHWM, the peak resident set (ru_maxrss would carry the forking parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def make(directory: Path, n: int, words: int, formats: list[str]) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = [f"w{i:04d}{'abcdefghij'[i % 10] * (i % 7)}" for i in range(VOCAB)]
    writer = None
    handle = open(directory / "corpus.jsonl", "w") if "jsonl" in formats else None  # noqa: SIM115
    if "parquet" in formats:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])
        writer = pq.ParquetWriter(directory / "corpus.parquet", schema)
    for start in range(0, n, GROUP_ROWS):
        rows = min(GROUP_ROWS, n - start)
        picks = rng.integers(0, VOCAB, size=(rows, words + 3))
        ids = [str(start + i) for i in range(rows)]
        titles = [" ".join(vocab[j] for j in row[:3]) for row in picks]
        texts = [" ".join(vocab[j] for j in row[3:]) + "." for row in picks]
        if handle is not None:
            handle.writelines(json.dumps({"id": i, "title": t, "text": x}) + "\n"
                              for i, t, x in zip(ids, titles, texts, strict=True))
        if writer is not None:
            writer.write_table(pa.table({"id": ids, "title": titles, "text": texts},
                                        schema=schema))
    if handle is not None:
        handle.close()
    if writer is not None:
        writer.close()


def build(corpus: Path, out: Path) -> dict:
    from services.retriever.corpus import iter_corpus, scan_corpus
    from services.retriever.docstore import DOCS_FILE, OFFSETS_FILE, DocStoreWriter

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = scan_corpus(corpus).rows
    scanned = time.monotonic() - started
    writer = DocStoreWriter(out, rows)
    for doc in iter_corpus(corpus):
        writer.add(doc)
    writer.close()
    return {"rows": rows, "scan_s": round(scanned, 1),
            "seconds": round(time.monotonic() - started, 1), "peak_rss": _peak(),
            "docs_bytes": (out / DOCS_FILE).stat().st_size,
            "offsets_bytes": (out / OFFSETS_FILE).stat().st_size,
            "corpus_bytes": corpus.stat().st_size}


def serve(store: Path, lookups: int) -> dict:
    import numpy as np

    from services.retriever.docstore import DocStore

    before = _status()
    started = time.monotonic()
    docs = DocStore(store)
    opened = _status()
    open_s = time.monotonic() - started
    rows = np.random.default_rng(1).integers(0, len(docs), size=lookups)
    started = time.monotonic()
    for row in rows:
        docs.get(int(row))
    per_get = (time.monotonic() - started) / lookups
    after = _status()
    return {"rows": len(docs), "open_ms": round(open_s * 1000, 1),
            "get_us": round(per_get * 1e6, 1), "before": before, "opened": opened,
            "after": after, "peak_rss": _peak()}


def baseline() -> dict:
    import numpy as np  # noqa: F401

    import services.retriever.corpus  # noqa: F401
    import services.retriever.docstore  # noqa: F401

    return {"after": _status(), "peak_rss": _peak()}


def _child(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _mb(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--words", type=int, default=80)
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "build":
            print(json.dumps(build(Path(rest[0]), Path(rest[1]))))
        elif what == "serve":
            print(json.dumps(serve(Path(rest[0]), int(rest[1]))))
        else:
            print(json.dumps(baseline()))
        return
    formats = [f for f in args.formats.split(",") if f]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        started = time.monotonic()
        make(directory, args.n, args.words, formats)
        print(f"corpus: {args.n:,} passages × {args.words} words, written in "
              f"{time.monotonic() - started:.0f}s")
        base = _child("baseline")
        print(f"baseline child (imports only): VmRSS {_mb(base['after']['VmRSS'])}, "
              f"peak {_mb(base['peak_rss'])}")
        store = None
        for fmt in formats:
            corpus = directory / f"corpus.{fmt}"
            out = directory / f"store-{fmt}"
            result = _child("build", str(corpus), str(out))
            print(f"build from {fmt}: {result['rows']:,} rows in {result['seconds']}s "
                  f"(scan {result['scan_s']}s); peak RSS {_mb(result['peak_rss'])}; corpus "
                  f"{_mb(result['corpus_bytes'])} → docs.jsonl {_mb(result['docs_bytes'])} + "
                  f"offsets {_mb(result['offsets_bytes'])}")
            if store is None:
                store = out
            else:
                same = all((store / name).read_bytes() == (out / name).read_bytes()
                           for name in ("docs.offsets.npy",))
                print(f"  offsets identical to the {formats[0]} store: {same}")
        result = _child("serve", str(store), str(args.lookups))
        b, o, a = result["before"], result["opened"], result["after"]
        print(f"serve: open {result['open_ms']} ms, get {result['get_us']} µs/row over "
              f"{args.lookups:,} random rows; VmRSS {_mb(b['VmRSS'])} → {_mb(o['VmRSS'])} "
              f"(opened) → {_mb(a['VmRSS'])} (after lookups); RssAnon {_mb(b['RssAnon'])} → "
              f"{_mb(a['RssAnon'])}, RssFile {_mb(b['RssFile'])} → {_mb(a['RssFile'])}")


if __name__ == "__main__":
    main()
