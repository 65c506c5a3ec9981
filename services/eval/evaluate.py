"""One `forage eval` run: check the inputs, pick the retrieval backend, play, report.

Everything a user can get wrong (a missing file, a mode that needs an index without one, a
store recorded on another index, OUT holding another config) is checked before any model
loads and raised as EvalError, which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.redact import redact_text, redact_url
from services.common.retrieval_store import retrieval_tag
from services.eval import report
from services.eval.data import limit_per_source, load_questions
from services.eval.evidence import donors
from services.eval.from_run import select_questions
from services.eval.replicas import (
    ReplicaError,
    ReplicaPlayer,
    ReplicaSettingsError,
    Target,
    adopt_settings,
    connect,
    run_tag,
    wait_for_replicas,
)
from services.eval.results import ConfigMismatch, SampleWriter, check_config, read_samples
from services.eval.retrieval import (
    STORE_FILE,
    UNKNOWN_INDEX,
    Backend,
    Http,
    InProcess,
    Recording,
    Replay,
    RetrievalError,
    Store,
    read_identity,
    replay_identity,
    served_key,
)
from services.eval.runner import EvalSettings, Row, play_row
from services.rollout.tools import TemplateError
from services.tasks.datasets import DatasetError

RETRIEVAL_MODES = ("live", "record", "replay")


class EvalError(ValueError):
    """A user mistake or an input that cannot be evaluated; the message says which."""


@dataclass
class EvalRequest:
    models: list[str]
    data: list[str]
    modes: list[str]
    out: str
    index: str | None = None
    retriever_url: str | None = None
    retrieval: str = "live"
    store: str | None = None
    data_source: str | None = None
    limit: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    # In-process retrieval (--index without --retriever-url): where the encoder and the index
    # run (None: `device`), the index apart (None: with the encoder), the precision queries
    # are encoded in (`auto`: as the server resolves retriever.query_dtype, float16 on CUDA)
    # and the server's search overrides (nprobe, ef_search, k_factor; `--run` takes the run's).
    retriever_device: str | None = None
    index_device: str | None = None
    query_dtype: str = "auto"
    search_params: dict[str, int] = field(default_factory=dict)
    # `--run`: ask the questions the run's evaluation asked, (data.max_test_items,
    # learner.eval_max_questions) of services/eval/from_run.py's select_questions.
    run_questions: tuple[int | None, int] | None = None
    # The rollout's engine factory (services/rollout/engines.py): "transformers" or "vllm",
    # and further `rollout.KEY=VALUE` settings for it (vLLM's gpu_memory_utilization, ...).
    engine: str = "transformers"
    engine_settings: list[str] = field(default_factory=list)
    settings: EvalSettings = field(default_factory=EvalSettings)
    # Called with each engine once loaded: tests script some turns through the engine's own
    # `forced_tokens` hook (a tiny random policy never searches on its own).
    prepare_engine: Callable[[Any], None] | None = None
    # Play through running rollout replicas (services/eval/replicas.py) instead of an engine
    # here; `given` names the settings flags given on the command line, which the replicas'
    # own settings must then equal.
    replicas: Target | None = None
    given: set[str] = field(default_factory=set)


def _file_checksum(path: str) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return f"xxh3_64:{digest.hexdigest()}"


def _run_config(request: EvalRequest, models: list[dict[str, str]], questions: int,
                settings: Any, index_id: str | None) -> dict[str, Any]:
    """What OUT/config.json records of a run: a rerun with another config is refused, so
    finished lines are only ever resumed by the run that wrote them."""
    config = {
        "models": models,
        "data": [{"path": path, "checksum": _file_checksum(path)} for path in request.data],
        "data_source": request.data_source, "limit": request.limit, "modes": request.modes,
        "settings": settings.as_dict(), "index": index_id, "questions": questions,
    }
    # Only when set, so a directory written before `--run` still resumes.
    if request.run_questions is not None:
        first, cap = request.run_questions
        config["run_questions"] = {"max_test_items": first, "eval_max_questions": cap}
    return config


def retrieval_placement(request: EvalRequest) -> tuple[str, str | None, str]:
    """(device, index device, resolved query dtype) of the in-process searcher."""
    from services.retriever.encoder import resolve_query_dtype

    device = request.retriever_device or request.device
    return device, request.index_device, resolve_query_dtype(request.query_dtype, device)


def _check_placement(request: EvalRequest) -> None:
    """The in-process searcher's devices, checked before anything loads: a CUDA that torch or
    faiss cannot use is one line naming the flag, never a traceback mid-load."""
    from services.retriever.indexes import DeviceError
    from services.retriever.manifest import IndexLoadError, read_manifest
    from services.retriever.searcher import check_placement

    assert request.index is not None
    try:
        index_type = read_manifest(request.index).get("index_type")
    except IndexLoadError as exc:
        raise RetrievalError(str(exc)) from None
    device_flag = "--retriever-device" if request.retriever_device else "--device"
    device, index_device, _ = retrieval_placement(request)
    try:
        check_placement(device, index_type,
                        encoder_device=device if index_device is not None else None,
                        index_device=index_device, key=device_flag, encoder_key=device_flag,
                        index_key="--index-device")
    except DeviceError as exc:
        text = str(exc)
        if index_device is None and "faiss" in text and "torch" not in text:
            # torch has the GPU, faiss not: the encoder can still run there
            text = (text.rstrip(".") + "; or keep the index on the CPU and the encoder on "
                    f"{device} with --index-device cpu")
        raise EvalError(f"in-process retrieval (--index {request.index}): {text}") from None


def _labels(models: list[str]) -> list[str]:
    """Each model's short name in the table: its directory name, the whole path on a clash."""
    names = [Path(m).resolve().name or m for m in models]
    return [name if names.count(name) == 1 else m for name, m in zip(names, models, strict=True)]


def _check_models(models: list[str]) -> list[dict[str, str]]:
    from services.common.model_identity import model_fingerprint
    from services.common.paths import require_model_dir

    found = []
    for model in models:
        require_model_dir(model, "--model")
        try:
            found.append({"path": model, "fingerprint": model_fingerprint(model)})
        except FileNotFoundError as exc:
            raise EvalError(f"--model: {exc}") from None
    return found


def _identity(request: EvalRequest, needs_search: bool
              ) -> tuple[str | None, dict[str, Any], Store | None]:
    """(index identity, retriever settings, replay store) for the modes asked, checked before
    anything is loaded or written; (None, {}, None) when no mode searches. The settings are
    what answers the searches: the in-process searcher's (search overrides, resolved query
    precision), or what the retriever at --retriever-url reports it applies."""
    if not needs_search:
        return None, {}, None
    if request.retrieval == "replay":
        if request.retriever_url:
            raise EvalError("--retrieval replay answers from the store alone; drop "
                            "--retriever-url (--index only checks the index identity)")
        store = Store(_store_path(request), create=False)
        dtype = None if request.query_dtype == "auto" else request.query_dtype
        try:
            identity, settings = replay_identity(store, request.index,
                                                 request.search_params or None, dtype)
        except RetrievalError:
            store.close()
            raise
        return identity, settings, store
    if not request.index and not request.retriever_url:
        raise EvalError("modes rag and agent search: pass --index DIR (loaded here) or "
                        "--retriever-url URL (a running `forage retriever serve`), or "
                        "--retrieval replay with a recorded store")
    if request.retriever_url:
        return (*_served(request), None)
    _check_placement(request)
    assert request.index is not None
    identity, settings = read_identity(request.index, request.search_params or None,
                                       retrieval_placement(request)[2])
    return identity, settings, None


def _served(request: EvalRequest) -> tuple[str, dict[str, Any]]:
    """The identity and settings the retriever at --retriever-url reports on /healthz (with
    --index, it must serve that index). A retriever that reports none: an error when
    recording (results must be keyed), else the identity is recorded as unknown."""
    url = request.retriever_url
    assert url is not None
    try:  # live: one try (an unreachable retriever fails the play, as it did before)
        return served_key(url, request.index, 5.0 if request.retrieval == "record" else 0.0)
    except RetrievalError as exc:
        if request.retrieval == "record" or "not the same index" in str(exc):
            raise EvalError(f"--retrieval {request.retrieval} keys results by the index's "
                            f"identity: {exc}") from None
        return UNKNOWN_INDEX, {}


def _store_path(request: EvalRequest) -> Path:
    return Path(request.store) if request.store else Path(request.out) / STORE_FILE


def _backend(request: EvalRequest, identity: str | None, settings: dict[str, Any],
             replay_store: Store | None) -> tuple[Backend | None, Store | None]:
    """The backend that answers searches, and the store it writes or reads (to close)."""
    if identity is None:
        return None, None
    topk = request.settings.topk
    if replay_store is not None:
        return Replay(replay_store, identity, settings, topk), replay_store
    tag = None if identity == UNKNOWN_INDEX else retrieval_tag(identity, settings, topk)
    if request.retriever_url:
        live: Backend = Http(request.retriever_url, topk, tag)
    else:
        device, index_device, query_dtype = retrieval_placement(request)
        live = InProcess(request.index, topk, device=device, index_device=index_device,
                         query_dtype=query_dtype, search_params=request.search_params or None,
                         tag=tag)
    if request.retrieval == "record":
        store = Store(_store_path(request), create=True)
        return Recording(live, store, identity, settings, topk), store
    return live, None


def run(request: EvalRequest) -> dict[str, Any]:
    """Evaluate every model in every mode; returns the eval.json document."""
    if request.retrieval not in RETRIEVAL_MODES:
        raise EvalError(f"--retrieval must be one of {', '.join(RETRIEVAL_MODES)}")
    try:
        if request.run_questions is None:
            questions = load_questions(request.data, request.data_source, request.limit)
        else:  # the run's pick of the rows first, then --limit on it
            questions = limit_per_source(select_questions(
                load_questions(request.data, request.data_source), *request.run_questions),
                request.limit)
    except DatasetError as exc:
        raise EvalError(str(exc)) from None
    if request.settings.evidence_probe and "agent" not in request.modes:
        raise EvalError("--evidence-probe probes agent trajectories: add --mode agent")
    if request.settings.protocol not in ("tags", "tool_calls"):
        raise EvalError(f"--protocol must be tags or tool_calls, got "
                        f"{request.settings.protocol!r}")
    models = _check_models(request.models)
    if request.replicas is not None:
        return _run_on_replicas(request, questions, models)
    engine_config(request, request.models[0])  # a bad engine or key: one line, nothing loaded
    needs_search = any(mode in ("rag", "agent") for mode in request.modes)
    try:
        index_id, settings, replay_store = _identity(request, needs_search)
    except RetrievalError as exc:
        raise EvalError(str(exc)) from None
    out = Path(request.out)
    config = _run_config(request, models, len(questions), request.settings, index_id)
    # The precision queries are encoded in, when not float32, as the key says (this process's,
    # the retriever's, or the replayed store's): another precision is another config for an
    # existing OUT, and a replay writes the config its recording wrote.
    if settings.get("query_dtype") not in (None, "float32"):
        config["query_dtype"] = settings["query_dtype"]
    if needs_search and request.index and not request.retriever_url \
            and request.retrieval != "replay" and request.search_params:
        # the search settings this process applies over the build's
        config["search_params"] = dict(sorted(request.search_params.items()))
    # Only when not the default, so directories written before the flag still resume; an
    # engine switch for an existing OUT is refused as another config (other tokens).
    if request.engine != "transformers":
        config["engine"] = request.engine
    if request.engine_settings:
        config["engine_settings"] = sorted(request.engine_settings)
    try:
        check_config(out, config)
        backend, store = _backend(request, index_id, settings, replay_store)
    except (ConfigMismatch, RetrievalError) as exc:
        if replay_store is not None:
            replay_store.close()
        raise EvalError(str(exc)) from None
    labels = _labels(request.models)
    rows = [Row(m * len(request.modes) + k, f"{labels[m]} · {mode}", request.models[m], mode)
            for m in range(len(request.models)) for k, mode in enumerate(request.modes)]
    done = {(line["row"], line["qid"]) for line in read_samples(out)}
    by_qid = {q.qid: q for q in questions}
    donor_of = ({qid: by_qid[d] for qid, d in donors([q.qid for q in questions],
                                                      request.settings.seed).items()}
                if request.settings.evidence_probe else None)
    writer = SampleWriter(out)
    try:
        for model_number, model in enumerate(request.models):
            mine = rows[model_number * len(request.modes):(model_number + 1)
                        * len(request.modes)]
            todo = {row.label: [q for q in questions if (row.label, q.qid) not in done]
                    for row in mine}
            if not any(todo.values()):
                continue
            engine = _engine(model, request)
            if request.prepare_engine is not None:
                request.prepare_engine(engine)
            for row in mine:
                try:
                    play_row(engine, row, todo[row.label], len(questions), request.settings,
                             backend, index_id, writer.write, donor_of)
                except RetrievalError as exc:
                    raise EvalError(str(exc)) from None
                except TemplateError as exc:  # --protocol tool_calls on a template it cannot use
                    raise EvalError(f"--protocol tool_calls with --model {model}: {exc}") from None
            del engine
    finally:
        writer.close()
        if store is not None:
            store.close()
    doc = report.build(config, [(r.label, r.model_dir, r.mode) for r in rows], read_samples(out))
    report.write(out, doc)
    return doc


def _check_replica_request(request: EvalRequest) -> None:
    """What cannot go through replicas, refused before anything connects (EvalError)."""
    if request.modes != ["agent"]:
        raise EvalError(f"--namespace plays mode agent on the replicas; mode(s) "
                        f"{', '.join(m for m in request.modes if m != 'agent')} run in this "
                        "process: drop --redis/--namespace for them")
    if len(request.models) != 1:
        raise EvalError("--namespace: the replicas serve one model; give one --model (a local "
                        "copy of it: its tokenizer decodes their tokens)")
    named = [flag for flag, value in (
        ("--index", request.index), ("--retriever-url", request.retriever_url),
        ("--store", request.store), ("--evidence-probe", request.settings.evidence_probe),
        ("--retrieval " + request.retrieval, request.retrieval != "live"),
        ("--engine " + request.engine, request.engine != "transformers"),
        ("--retriever-device", request.retriever_device),
        ("--index-device", request.index_device),
        ("--set", bool(request.engine_settings))) if value]
    if named:
        raise EvalError(f"--namespace does not take {', '.join(named)}: for an evaluation "
                        "in this process only; the replicas search their own retriever with "
                        "their own engine (their config)")


def _run_on_replicas(request: EvalRequest, questions: list[Any],
                     models: list[dict[str, str]]) -> dict[str, Any]:
    """Mode agent played by the rollout replicas serving `request.replicas` (replicas.py):
    the same config checks, lines, resume and report as in process."""
    import redis
    from transformers import AutoTokenizer

    _check_replica_request(request)
    target = request.replicas
    assert target is not None
    streams = connect(target)
    try:
        beats = wait_for_replicas(streams.client, target)
        try:
            settings, seen = adopt_settings(request.settings, request.given, beats)
        except ReplicaSettingsError as exc:
            raise EvalError(str(exc)) from None
        out = Path(request.out)
        config = {**_run_config(request, models, len(questions), settings, None),
                  "replicas": {"namespace": target.namespace}}
        try:
            check_config(out, config)
        except ConfigMismatch as exc:
            raise EvalError(str(exc)) from None
        label = _labels(request.models)[0]
        row = Row(0, f"{label} · agent", request.models[0], "agent")
        done = {line["qid"] for line in read_samples(out) if line["row"] == row.label}
        todo = [q for q in questions if q.qid not in done]
        tokenizer = AutoTokenizer.from_pretrained(request.models[0])
        writer = SampleWriter(out)
        try:
            player = ReplicaPlayer(streams, target, run_tag(request.out, config))
            player.play_row(row, todo, len(questions), settings, tokenizer, writer.write)
            player.close()  # only once every question is written: a rerun needs it otherwise
        except redis.RedisError as exc:  # retried by the streams library first
            raise ReplicaError(f"Redis at {redact_url(target.url)} failed "
                               f"({type(exc).__name__}: {redact_text(str(exc))}); "
                               "finished questions are kept, so running the same command "
                               "again goes on from here") from None
        finally:
            writer.close()
    finally:
        streams.close()
    lines = read_samples(out)
    doc = report.build(config, [(row.label, row.model_dir, row.mode)], lines)
    for summary in doc["rows"]:
        summary["replicas"] = {
            "namespace": target.namespace, "models": seen["models"], "engines": seen["engines"],
            "policy_versions": sorted({int(x.get("policy_version", 0)) for x in lines
                                       if x["row"] == summary["label"]})}
    report.write(out, doc)
    return doc


# Keys `forage eval` sets itself from its own flags; `--set` may not set them too.
OWN_ROLLOUT_KEYS = ("engine", "device", "dtype", "max_batch_size", "seed")
# The engine's other rollout keys (docs/rollout.md, "Config keys"), which `--set` may set; the
# agent loop's keys have forage eval flags of their own (--max-turns, ...).
ENGINE_KEYS = ("gpu_memory_utilization", "kv_cache_gib", "tensor_parallel_size", "enforce_eager",
               "enable_prefix_caching", "max_model_len", "vllm_engine_args")


def engine_config(request: EvalRequest, model: str, check: bool = True) -> Any:
    """The RunConfig the rollout's engine factory gets: `model.path` and the `rollout.*` keys
    of this evaluation (engine, device, dtype, batch size, seed) plus `--set rollout.K=V`.
    Raises EvalError (one line) for a bad key or value, or (`check`) an engine whose package
    is not installed here."""
    from pydantic import ValidationError

    from services.common.config import ConfigError, load_config
    from services.common.config.model import ModelSection
    from services.common.config.rollout import RolloutSection
    from services.rollout.engines import require_engine

    for item in request.engine_settings:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key.startswith("rollout."):
            raise EvalError(f"--set {item}: expected rollout.KEY=VALUE (an engine setting, "
                            "docs/rollout.md)")
        name = key.removeprefix("rollout.").split(".", 1)[0]
        if name in OWN_ROLLOUT_KEYS:
            raise EvalError(f"--set {item}: {key} comes from forage eval's own flag "
                            "(--engine, --device, --dtype, --batch-size, --seed)")
        if name not in ENGINE_KEYS:
            raise EvalError(f"--set {item}: rollout.{name} is not an engine setting; --set "
                            f"takes rollout.{{{', '.join(ENGINE_KEYS)}}}")
    try:
        config = load_config(None, list(request.engine_settings), environ={})
    except ConfigError as exc:
        raise EvalError(f"--set: {exc}") from None
    own = {"engine": request.engine, "device": request.device, "dtype": request.dtype,
           "max_batch_size": request.settings.batch_size, "seed": request.settings.seed}
    try:
        rollout = RolloutSection.model_validate({**config.rollout.model_dump(), **own})
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("max_batch_size", "batch_size") \
            .replace("_", "-") if first["loc"] else "--engine"
        raise EvalError(f"{flag}: {first['msg']} (got {first.get('input')!r})") from None
    config = config.model_copy(update={"rollout": rollout,
                                       "model": ModelSection(path=str(model))})
    if check:
        try:
            require_engine(config.rollout.engine, "--engine")
        except ConfigError as exc:
            raise EvalError(str(exc)) from None
    return config


def _engine(model: str, request: EvalRequest) -> Any:
    from services.rollout.engines import make_engine

    return make_engine(engine_config(request, model))
