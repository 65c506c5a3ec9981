"""Index build: corpus → document store + (embeddings →) FAISS or BM25 index + manifest.

Why the build is shaped this way:
- Streaming: the corpus is read line by line twice (checksum + row count, then docs and
  embeddings), and embeddings go to an on-disk matrix, so memory does not grow with the corpus.
- Reuse: a finished index whose manifest records the same inputs (corpus checksum, encoder,
  prefixes, index type and parameters) is returned as is. An interrupted build left its work
  in a staging directory with a checkpoint every `checkpoint_rows` rows; a rerun with the same
  corpus and encoder resumes there, and embeddings are shared between dense index types.
- Atomicity: everything is written into `.<name>.partial/` next to the output; the manifest is
  written last and the directory is renamed into place, so `serve` can never load a half index.
- Cleanup: a build that fails on its input (a bad corpus row) or before its first checkpoint
  removes its staging directory; one interrupted (Ctrl-C, kill) or failing later (out of
  memory, disk full) keeps it for the rerun to resume, and says so. The `.<name>.lock` file
  goes with the build that held it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from services.retriever.corpus import CorpusError, iter_corpus, scan_corpus
from services.retriever.docstore import DOCS_FILE, OFFSETS_FILE, DocStoreWriter
from services.retriever.indexes import (
    BM25_DIR,
    FAISS_FILE,
    NAMED_TYPES,
    REFINE_FILE,
    BM25Index,
    IndexSpecError,
    build_dense,
    build_factory,
    check_factory,
    default_params,
    is_dense,
    is_factory,
    refine_params,
)
from services.retriever.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    IndexLoadError,
    check_index_dir,
    checksums,
    read_manifest,
    write_json_atomic,
)

log = logging.getLogger("forage.retriever.build")

EMBEDDINGS_FILE = "embeddings.npy"
PROGRESS_FILE = "progress.json"
STAGE_KEY_FILE = "stage_key.json"

__all__ = ["BuildError", "CorpusError", "build_index"]


class BuildError(RuntimeError):
    """A build that cannot proceed (bad arguments, an output path that is not ours)."""


def build_index(
    corpus: str | Path,
    out_dir: str | Path,
    index_type: str = "flat",
    encoder: str | None = None,
    query_prefix: str = "",
    passage_prefix: str = "",
    batch_size: int = 64,
    device: str = "cpu",
    show_progress: bool = True,
    params: dict[str, int | str] | None = None,
    checkpoint_rows: int | None = None,
    refine: bool = False,
    k_factor: int | None = None,
) -> Path:
    """Build (or reuse) the index of `corpus` in `out_dir` and return `out_dir`.

    `index_type` is a named kind (flat, hnsw, ivf, bm25, or a preset: ivf-pq, ivf-sq8,
    ivf-sqfp16, hnsw-sq8) or a FAISS index-factory string ("IVF4096,PQ64").
    `params` overrides index knobs (hnsw_m, ef_construction, ef_search, nlist, nprobe;
    train_size, train_seed for factory kinds); `checkpoint_rows` is how often an interrupted
    build can resume (default 16 batches). `refine` keeps the float32 embeddings beside a
    compressed index for exact re-ranking of `k_factor` × k candidates (indexes.py).
    """
    if not isinstance(index_type, str) or not index_type.strip():
        raise BuildError(f"index type {index_type!r}: give one of {', '.join(NAMED_TYPES)} "
                         "or a FAISS index-factory string")
    if batch_size < 1:
        raise BuildError("batch_size must be at least 1")
    corpus, out_dir = Path(corpus).resolve(), Path(out_dir).resolve()
    dense = is_dense(index_type)
    started = time.monotonic()
    try:
        reranking = refine_params(index_type, refine, k_factor)
    except ValueError as exc:
        raise BuildError(str(exc)) from None
    factory_dim = None
    model = None
    if is_factory(index_type):
        # Before the corpus scan (minutes for wiki-18): a factory string FAISS rejects for this
        # encoder's dimension is refused at once. The dimension needs the encoder loaded; the
        # streaming pass then uses this copy rather than loading it again.
        from services.retriever.encoder import Encoder, resolve_encoder

        model = Encoder(resolve_encoder(encoder), device=device, passage_prefix=passage_prefix,
                        batch_size=batch_size)
        factory_dim = model.dim
        try:
            check_factory(index_type, factory_dim)
        except IndexSpecError as exc:
            raise BuildError(str(exc)) from None

    stats = scan_corpus(corpus, show_progress=show_progress)
    if stats.rows == 0:
        raise CorpusError(f"corpus {corpus} has no rows")
    try:
        index_params = {**default_params(index_type, stats.rows, factory_dim, params),
                        **(params or {}), **reranking}
    except ValueError as exc:
        raise BuildError(f"--index {index_type!r}: {exc}") from None
    stage_key: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "corpus_sha256": stats.sha256,
        "rows": stats.rows,
    }
    encoder_path = None
    if dense:
        from services.retriever.encoder import (
            encoder_fingerprint,
            encoder_name,
            resolve_encoder,
        )

        encoder_path = resolve_encoder(encoder)
        stage_key.update(
            encoder=encoder_path,
            encoder_fingerprint=encoder_fingerprint(encoder_path),
            passage_prefix=passage_prefix,
        )
    build_key = {
        **stage_key,
        "index_type": index_type,
        "params": index_params,
        "query_prefix": query_prefix if dense else "",
    }

    with out_dir_lock(out_dir):
        reused = _reusable(out_dir, build_key)
        if reused:
            log.info("index in %s is up to date with its inputs; reusing it", out_dir)
            return out_dir
        check_out_dir_is_ours(out_dir)
        stage = out_dir.parent / f".{out_dir.name}.partial"
        _prepare_stage(stage, stage_key)

        with _cleanup_on_failure(stage):
            dim = _write_docs_and_embeddings(
                corpus, stage, stats.rows, encoder_path, passage_prefix, batch_size, device,
                show_progress, checkpoint_rows or batch_size * 16, dense, model,
            )
            files: dict[str, int | None] = {}
            if dense:
                vectors = np.load(stage / EMBEDDINGS_FILE, mmap_mode="r")
                if is_factory(index_type):
                    index = _build_factory(index_type, vectors, index_params, show_progress)
                else:
                    bar = progress_bar(show_progress, stats.rows, f"add to {index_type} index")
                    index = build_dense(index_type, vectors, index_params,
                                        progress=bar.update if bar else None)
                    if bar:
                        bar.close()
                import faiss

                faiss.write_index(index, str(stage / FAISS_FILE))
                del index, vectors
                files[FAISS_FILE] = (stage / FAISS_FILE).stat().st_size
                if reranking:  # the embeddings become the re-ranking matrix: no copy
                    os.replace(stage / EMBEDDINGS_FILE, stage / REFINE_FILE)
                    files[REFINE_FILE] = (stage / REFINE_FILE).stat().st_size
            else:
                bm25 = BM25Index.build(_docstore_texts(stage), stats.rows, show_progress)
                bm25.save(stage / BM25_DIR)
                for child in sorted((stage / BM25_DIR).iterdir()):
                    files[f"{BM25_DIR}/{child.name}"] = child.stat().st_size
            for name in (DOCS_FILE, OFFSETS_FILE):
                files[name] = (stage / name).stat().st_size
            for name in (EMBEDDINGS_FILE, PROGRESS_FILE, STAGE_KEY_FILE):
                (stage / name).unlink(missing_ok=True)

            manifest = {
                "format_version": FORMAT_VERSION,
                "index_type": index_type,
                "count": stats.rows,
                "dim": dim,
                "encoder": encoder_path,
                "encoder_name": encoder_name(encoder_path) if encoder_path else None,
                "query_prefix": build_key["query_prefix"],
                "passage_prefix": passage_prefix if dense else "",
                "params": index_params,
                "corpus": {"path": str(corpus), "sha256": stats.sha256, "bytes": stats.size_bytes},
                "files": files,
                "checksums": checksums(stage, list(files)),
                "build_key": build_key,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 3),
            }
            write_json_atomic(stage / MANIFEST_FILE, manifest)
            swap_into_place(stage, out_dir)
    log.info("built %s index of %d passages in %s (%.1fs)", index_type, stats.rows, out_dir,
             time.monotonic() - started)
    return out_dir


def _build_factory(index_type: str, vectors: np.ndarray, params: dict[str, Any],
                   show_progress: bool):
    """Train and fill a factory-string index; FAISS's own refusal (too few training vectors for
    the lists or centroids asked for) is a BuildError naming the kind, not a traceback. The
    embeddings stay in the stage, so a rerun after Ctrl-C here re-trains without re-encoding."""
    factory = str(params["factory"])
    rows = vectors.shape[0]
    log.info("building %s (%s) over %d vectors", index_type, factory, rows)
    bar = progress_bar(show_progress, rows, f"add to {factory}")
    try:
        return build_factory(factory, vectors, params, progress=bar.update if bar else None,
                             log=log.info)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "failed"
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", reason)
        raise BuildError(f"--index {index_type!r} ({factory}) cannot be built over {rows} "
                         f"vectors: {reason}") from None
    finally:
        if bar:
            bar.close()


def _write_docs_and_embeddings(
    corpus: Path, stage: Path, rows: int, encoder_path: str | None, passage_prefix: str,
    batch_size: int, device: str, show_progress: bool, checkpoint_rows: int, dense: bool,
    loaded: Any = None,
) -> int | None:
    """The streaming pass, checkpointed: docs and embeddings of rows [0, done) are durable."""
    progress_path = stage / PROGRESS_FILE
    done, done_bytes = 0, 0
    if progress_path.exists():
        saved = json.loads(progress_path.read_text())
        done, done_bytes = int(saved["rows"]), int(saved["bytes"])
    if done == rows and not dense:
        return None
    model = None
    dim = None
    embeddings = None
    if dense:
        from services.retriever.encoder import Encoder

        model = loaded or Encoder(encoder_path, device=device, passage_prefix=passage_prefix,
                                  batch_size=batch_size)
        dim = model.dim
        emb_path = stage / EMBEDDINGS_FILE
        if done and emb_path.exists():
            embeddings = np.lib.format.open_memmap(emb_path, mode="r+")
            if embeddings.shape != (rows, dim):
                raise BuildError(f"{emb_path}: shape {embeddings.shape} does not match; "
                                 f"delete {stage} and rebuild")
        else:
            done, done_bytes = 0, 0
            embeddings = np.lib.format.open_memmap(emb_path, mode="w+", dtype=np.float32,
                                                   shape=(rows, dim))
    if done == rows:
        return dim
    if done:
        log.info("resuming an interrupted build at row %d of %d", done, rows)
    writer = DocStoreWriter(stage, rows, resume_rows=done, resume_bytes=done_bytes)
    bar = progress_bar(show_progress, rows, "encode" if dense else "docstore", initial=done)
    try:
        chunk: list[dict[str, Any]] = []
        for doc in iter_corpus(corpus, skip=done):
            chunk.append(doc)
            if len(chunk) >= checkpoint_rows:
                _write_chunk(chunk, writer, model, embeddings, progress_path, bar)
                chunk = []
        if chunk:
            _write_chunk(chunk, writer, model, embeddings, progress_path, bar)
        if writer.rows != rows:
            raise CorpusError(f"corpus {corpus} changed during the build "
                              f"({writer.rows} rows read, {rows} counted)")
    finally:
        writer.close()
        if bar:
            bar.close()
        if embeddings is not None:
            embeddings.flush()
    return dim


def _write_chunk(chunk, writer: DocStoreWriter, model, embeddings, progress_path: Path,
                 bar) -> None:
    start = writer.rows
    if model is not None:
        vectors = model.encode_passages([doc["contents"] for doc in chunk])
        embeddings[start : start + len(chunk)] = vectors
        embeddings.flush()
    for doc in chunk:
        writer.add(doc)
    writer.flush()
    write_json_atomic(progress_path, {"rows": writer.rows, "bytes": writer.bytes})
    if bar:
        bar.update(len(chunk))


def _docstore_texts(stage: Path) -> Iterator[str]:
    with open(stage / DOCS_FILE, "rb") as handle:
        for line in handle:
            yield json.loads(line)["contents"]


def progress_bar(show: bool, total: int, desc: str, initial: int = 0):
    """A passage-counting tqdm bar, or None when progress is off (`--no-progress`, a log file):
    the index build and `import-index` show their long passes the same way."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="passage", unit_scale=True, desc=desc)


def _reusable(out_dir: Path, build_key: dict[str, Any]) -> bool:
    if not (out_dir / MANIFEST_FILE).exists():
        return False
    try:
        if read_manifest(out_dir).get("build_key") != build_key:
            return False
        check_index_dir(out_dir)
    except IndexLoadError as exc:
        log.warning("existing index in %s is unusable (%s); rebuilding", out_dir, exc)
        return False
    return True


def check_out_dir_is_ours(out_dir: Path) -> None:
    """Never replace a directory that is not an index: `--out` pointing at a data folder must
    not delete the user's files."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists():
        raise BuildError(
            f"output {out_dir} is a non-empty directory that is not an index; choose a new path"
        )


def _prepare_stage(stage: Path, stage_key: dict[str, Any]) -> None:
    key_path = stage / STAGE_KEY_FILE
    if stage.exists():
        try:
            same = json.loads(key_path.read_text()) == stage_key
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(stage)
        else:
            (stage / MANIFEST_FILE).unlink(missing_ok=True)
    stage.mkdir(parents=True, exist_ok=True)
    write_json_atomic(key_path, stage_key)


def swap_into_place(stage: Path, out_dir: Path) -> None:
    """Replace `out_dir` with the finished `stage` by renames, so a reader sees the old index or
    the new one, never a half-written one; the old one is deleted after."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(stage, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _resumable_rows(stage: Path) -> int:
    """Rows of the streaming pass a rerun would not redo (0: nothing worth keeping)."""
    try:
        return int(json.loads((stage / PROGRESS_FILE).read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@contextmanager
def _cleanup_on_failure(stage: Path):
    """Remove the staging directory of a build that failed with nothing a rerun could resume
    (a bad corpus: its fixed version has another checksum, so the stage would be discarded
    anyway). Interruptions (KeyboardInterrupt, SystemExit) keep it: resuming is the point."""
    try:
        yield
    except CorpusError:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    except Exception:
        rows = _resumable_rows(stage)
        if rows:
            log.error("build failed; %s keeps %d encoded rows: the next run with the same "
                      "corpus and encoder resumes there (delete it to start over)", stage, rows)
        else:
            shutil.rmtree(stage, ignore_errors=True)
        raise


@contextmanager
def out_dir_lock(out_dir: Path):
    """One build per output at a time (two would share the staging directory).

    The lock file is removed by the build that holds it, while it still holds it; a build that
    locked a file someone removed meanwhile (its inode is no longer the path's) tries again.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    while True:
        handle = open(lock_path, "a")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise BuildError(f"another build of {out_dir} is running ({lock_path})") from None
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # the previous holder removed this file after we opened it
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()
