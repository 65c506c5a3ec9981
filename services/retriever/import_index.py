"""Import an index built by Search-R1's own code: its FAISS file and its JSON Lines corpus.

Search-R1 publishes a prebuilt e5 Flat index of wiki-18 (`e5_Flat.index`, 21M passages) and
the corpus it was built from (`wiki-18.jsonl`, one `{"id", "contents"}` row per passage, row N
being vector N). Encoding those passages again takes hours on GPUs; `import_index` makes a
Forage index directory from the two files without encoding a single passage:

- the FAISS file goes into the directory as it is: a hard link where the filesystem allows
  (no copy, no extra disk), else a symbolic link to its absolute path, or a copy when asked;
- the document store is written from the corpus in one streaming pass (rows must match the
  index's vectors one for one: a count that differs is an error, not a silent shift);
- the manifest records how queries must be encoded to land next to those passages: the
  encoder directory, its pooling, the query and passage prefixes, normalisation and the
  query's token limit. The defaults are Search-R1's e5 settings (mean pooling over the last
  hidden states, "query: " / "passage: ", L2-normalised, 256 query tokens).

Index kinds: an inner-product Flat (what Search-R1 ships), HNSW-Flat or IVF-Flat; the HNSW and
IVF search settings stored in the file (efSearch, nprobe) become the manifest's, so searches
run as they did in Search-R1's server. The FAISS file is opened memory-mapped to read its
shape, never loaded into memory here.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

from services.retriever.build import (
    BuildError,
    check_out_dir_is_ours,
    out_dir_lock,
    progress_bar,
    swap_into_place,
)
from services.retriever.corpus import CorpusError, iter_corpus
from services.retriever.docstore import DOCS_FILE, OFFSETS_FILE, DocStoreError, DocStoreWriter
from services.retriever.encoder import POOLINGS
from services.retriever.indexes import FAISS_FILE
from services.retriever.manifest import FORMAT_VERSION, MANIFEST_FILE, checksums, write_json_atomic
from services.retriever.search_r1_encoding import (
    PASSAGE_PREFIX,
    POOLING,
    QUERY_MAX_LENGTH,
    QUERY_PREFIX,
)

log = logging.getLogger("forage.retriever.import")

LINK_MODES = ("link", "copy")

# The first four bytes of a FAISS file name its index class; these are the ones imported.
_KINDS = {b"IxFI": "flat", b"IxF2": "flat", b"IHNf": "hnsw", b"IwFl": "ivf"}
_METRIC_INNER_PRODUCT = 0


class IndexImportError(BuildError):
    """Inputs that cannot make an index; the message is one line naming the file."""


def faiss_shape(path: Path) -> tuple[str, int, int, dict[str, int]]:
    """(Forage index kind, vectors, dimension, search params) of a FAISS file, read
    memory-mapped; IndexImportError for a file that is not a FAISS index or not one Forage serves."""
    if not path.exists():
        raise IndexImportError(f"FAISS index {path} does not exist")
    if not path.is_file():
        raise IndexImportError(f"FAISS index {path} is not a file")
    with open(path, "rb") as handle:
        head = handle.read(4 + 4 + 8 + 8 + 8 + 1 + 4)
    fourcc = head[:4]
    if len(head) < 37 or not fourcc.isalnum() or not fourcc.startswith(b"I"):
        raise IndexImportError(f"{path} is not a FAISS index file (it starts with {head[:8]!r})")
    kind = _KINDS.get(fourcc)
    if kind is None:
        raise IndexImportError(
            f"{path}: FAISS index class {fourcc.decode('ascii')!r} is not imported (an "
            "inner-product Flat, HNSW-Flat or IVF-Flat index is; build other kinds with "
            "`forage retriever build-index`)")
    metric = struct.unpack("<i", head[33:37])[0]
    if metric != _METRIC_INNER_PRODUCT:
        raise IndexImportError(f"{path}: the index uses FAISS metric {metric}, not inner product "
                           "(Search-R1's indexes are inner-product; Forage scores by it)")
    import faiss

    flag = faiss.IO_FLAG_MMAP if kind == "ivf" else getattr(faiss, "IO_FLAG_MMAP_IFC", 0)
    try:
        owner = faiss.read_index(str(path), flag)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "unreadable"
        raise IndexImportError(f"{path} is not a readable FAISS index ({reason[-200:]})") from None
    index = faiss.downcast_index(owner)  # `owner` keeps the C++ object alive meanwhile
    params: dict[str, int] = {}
    if kind == "hnsw":
        params = {"hnsw_m": int(index.hnsw.nb_neighbors(1)),
                  "ef_construction": int(index.hnsw.efConstruction),
                  "ef_search": int(index.hnsw.efSearch)}
    elif kind == "ivf":
        params = {"nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    shape = (kind, int(index.ntotal), int(index.d), params)
    del index, owner
    return shape


def import_index(
    faiss_path: str | Path,
    corpus: str | Path,
    out_dir: str | Path,
    encoder: str,
    query_prefix: str = QUERY_PREFIX,
    passage_prefix: str = PASSAGE_PREFIX,
    pooling: str = POOLING,
    normalize: bool = True,
    query_max_length: int | None = QUERY_MAX_LENGTH,
    link: str = "link",
    show_progress: bool = True,
) -> Path:
    """Make the Forage index directory `out_dir` from a FAISS file and its corpus (module
    docstring) and return it. Raises IndexImportError / CorpusError with a one-line reason."""
    from services.retriever.encoder import Encoder, encoder_fingerprint, encoder_name

    started = time.monotonic()
    if pooling not in POOLINGS:
        raise IndexImportError(f"--pooling {pooling!r}: one of {', '.join(POOLINGS)}")
    if link not in LINK_MODES:
        raise IndexImportError(f"link mode {link!r}: one of {', '.join(LINK_MODES)}")
    faiss_path, corpus = Path(faiss_path).expanduser(), Path(corpus).expanduser()
    out_dir = Path(out_dir).expanduser().resolve()
    if not corpus.exists():
        raise IndexImportError(f"corpus {corpus} does not exist")
    if not corpus.is_file():
        raise IndexImportError(f"corpus {corpus} is not a file")
    kind, count, dim, params = faiss_shape(faiss_path)
    if count == 0:
        raise IndexImportError(f"FAISS index {faiss_path} holds no vectors")
    try:
        model = Encoder(encoder, pooling=pooling, normalize=normalize,
                        max_length=query_max_length, query_prefix=query_prefix,
                        passage_prefix=passage_prefix)
    except FileNotFoundError as exc:
        raise IndexImportError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise IndexImportError(f"cannot load encoder {encoder}: {exc}") from None
    if model.dim != dim:
        raise IndexImportError(
            f"encoder {model.path} makes {model.dim}-d vectors ({pooling} pooling) but "
            f"{faiss_path} holds {dim}-d vectors: give the encoder the index was built with")
    encoder_path = model.path
    del model

    with out_dir_lock(out_dir):
        check_out_dir_is_ours(out_dir)
        stage = out_dir.parent / f".{out_dir.name}.partial"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        try:
            _write_docstore(corpus, stage, count, faiss_path, show_progress)
            how = _place_faiss(faiss_path, stage / FAISS_FILE, link)
            files: dict[str, int | None] = {
                name: (stage / name).stat().st_size for name in (FAISS_FILE, DOCS_FILE,
                                                                 OFFSETS_FILE)}
            sums = checksums(stage, list(files))
            settings = {
                "query_prefix": query_prefix, "passage_prefix": passage_prefix,
                "pooling": pooling, "normalize": bool(normalize),
                "query_max_length": query_max_length,
            }
            build_key = {
                "format_version": FORMAT_VERSION, "imported": True,
                "faiss": sums[FAISS_FILE], "docs": sums[DOCS_FILE], "rows": count,
                "encoder": encoder_path, "encoder_fingerprint": encoder_fingerprint(encoder_path),
                "index_type": kind, "params": params, **settings,
            }
            manifest: dict[str, Any] = {
                "format_version": FORMAT_VERSION,
                "index_type": kind,
                "count": count,
                "dim": dim,
                "encoder": encoder_path,
                "encoder_name": encoder_name(encoder_path),
                **settings,
                "params": params,
                "corpus": {"path": str(corpus.resolve()), "bytes": corpus.stat().st_size},
                "imported_from": {"faiss": str(faiss_path.resolve()), "placed_by": how},
                "files": files,
                "checksums": sums,
                "build_key": build_key,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 3),
            }
            write_json_atomic(stage / MANIFEST_FILE, manifest)
            swap_into_place(stage, out_dir)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    log.info("imported %s index of %d passages into %s (FAISS file %s; %.1fs)", kind, count,
             out_dir, how, time.monotonic() - started)
    return out_dir


def _write_docstore(corpus: Path, stage: Path, count: int, faiss_path: Path,
                    show_progress: bool) -> None:
    """The document store of `corpus`, which must have exactly `count` rows (vector N is row
    N): one pass, stopped at the first row past `count`."""
    writer = DocStoreWriter(stage, count)
    bar = progress_bar(show_progress, count, "docstore")
    try:
        for doc in iter_corpus(corpus):
            if writer.rows == count:
                rows = count + sum(1 for _ in iter_corpus(corpus, skip=count))
                raise _rows_differ(corpus, rows, faiss_path, count)
            writer.add(doc)
            if bar:
                bar.update(1)
    except DocStoreError as exc:
        raise IndexImportError(str(exc)) from None
    finally:
        writer.close()
        if bar:
            bar.close()
    if writer.rows != count:
        raise _rows_differ(corpus, writer.rows, faiss_path, count)


def _rows_differ(corpus: Path, rows: int, faiss_path: Path, count: int) -> IndexImportError:
    return IndexImportError(
        f"corpus {corpus} has {rows} passages but {faiss_path} holds {count} vectors: they "
        "must be the same rows, in the same order")


def _place_faiss(source: Path, target: Path, link: str) -> str:
    """Put the FAISS file at `target` unchanged: "hard link", "symlink" or "copy"."""
    source = source.resolve()
    if link == "copy":
        shutil.copyfile(source, target)
        return "copy"
    try:
        os.link(source, target)
        return "hard link"
    except OSError:  # another filesystem, or links not allowed there
        os.symlink(source, target)
        return "symlink"


__all__ = ["CorpusError", "IndexImportError", "faiss_shape", "import_index"]
