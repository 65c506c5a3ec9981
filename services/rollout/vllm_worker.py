"""Weight updates inside vLLM's worker processes (docs/architecture.md).

vLLM (V1) runs the model in worker processes and reaches them through `collective_rpc`, whose
arguments are msgpack-encoded on the way to the engine core: a Python function or a tensor
does not cross (vLLM raises `TypeError` unless insecure pickling is switched on, and even then
tensors arrive as lists). So the rollout service never sends weights. It sends a version, the
learner's weight-server address and a token; each worker fetches that version itself with
`WeightSyncClient` (checksum-verified) and loads it through vLLM's in-place reload
(`Worker.reload_weights(weights_iterator=...)`), which shards every tensor for its
tensor-parallel rank through the model's own `load_weights` and then re-runs the processing vLLM
applies after a first load.

Why the reload and not `model.load_weights` alone: after loading, vLLM transforms parameters for
its kernels (`process_weights_after_loading`). Its CPU backend prepacks every linear weight for
its GEMM kernels and leaves `weight` empty, quantized and FP8 checkpoints are repacked on GPUs,
and so a second `load_weights` fails (`Attempted to load weight ... into parameter
(torch.Size([0]))`) or writes where no kernel reads. `reload_weights` restores the checkpoint
layout layer by layer, loads, and processes each layer again. vLLM's weight-transfer API
(`init_weight_transfer_engine` / `update_weights`) is not used: it moves tensors over NCCL or
CUDA IPC from a trainer that joins the workers' process group, which Forage's learner does not
(it serves verified, token-guarded versions over gRPC, through relays), and it has no CPU
backend.

An update is two-phase so that all ranks switch together or none does:
  1. `forage_stage_weights(version, address, token)`: every rank fetches and verifies into a
     CPU staging copy; the model is not touched.
  2. `forage_commit_weights(version)`: only when every rank staged, each loads its copy;
     otherwise `forage_drop_staged_weights()` frees the copies and the old weights serve on.
Every method takes and returns plain values only (str, int, bool, None, dicts of those), so
the calls pass vLLM's msgpack serializer without pickling.

LoRA adapters do not come this way: the engine process registers them with vLLM's own
`add_lora`, whose loader already runs in every worker (vllm_engine.py, vllm_lora.py). A worker
asked to stage an adapter version refuses it.

Tensor parallelism: the ranks of one replica fetch each version once, not once per rank. With
a `share` socket in the stage call's plan, rank 0 fetches (through relays when the plan says
so: docs/weight_sync.md "Relays") and serves what it receives on that Unix socket as it
arrives; the other ranks read from it at the same time (a rank that cannot falls back to the
learner). Every rank still verifies every chunk and the whole stream's checksum.

`WorkerWeightLoader` is the part that is not vLLM: fetch, stage, hand an iterator of (name,
tensor) pairs to a reload callable and report. `ForageWorkerExtension` is the thin glue
vLLM mixes into its worker class (`worker_extension_cls`); vLLM requires that none of its
attribute names exist on the worker already, hence the `forage_` prefix on every one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("forage.rollout.vllm_worker")

# The qualified name vLLM imports in every worker (EngineArgs.worker_extension_cls).
EXTENSION_CLASS = "services.rollout.vllm_worker.ForageWorkerExtension"
STAGE_METHOD = "forage_stage_weights"
COMMIT_METHOD = "forage_commit_weights"
DROP_METHOD = "forage_drop_staged_weights"

# How long a tensor-parallel rank waits for rank 0 to start serving a version before it
# fetches from the learner itself (plan key "share_wait_s").
SHARE_WAIT_S = 20.0

# Loads an iterator of (name, tensor) pairs in checkpoint format into the model (vLLM's
# `Worker.reload_weights(weights_iterator=...)` in a real worker).
ReloadWeights = Callable[[Iterator[tuple[str, Any]]], Any]

# vLLM's in-place reload warns "<Layer>: Failed to load weights" for every layer that holds
# tensors the update did not carry, then keeps that layer's own. A rotary embedding holds only
# its cos/sin cache, computed at load and in no checkpoint or transfer, so every update of every
# model logged that warning once per rotary module: noise that reads as a failure. Only that
# case is dropped; any other layer's warning still shows.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryReloadNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def quiet_rotary_reload_warning() -> None:
    """Drop vLLM's rotary-embedding reload warning in this process (idempotent)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadNoise) for f in logger.filters):
        logger.addFilter(_RotaryReloadNoise())


def _result(ok: bool, version: int, rank: int | None, reason: str = "", error: str = "",
            tensors: int = 0, nbytes: int = 0) -> dict[str, Any]:
    """One rank's answer: only msgpack-native values (it travels back through vLLM's RPC)."""
    return {"ok": bool(ok), "version": int(version), "rank": rank, "reason": reason,
            "error": error, "tensors": int(tensors), "bytes": int(nbytes)}


class WorkerWeightLoader:
    """Fetch a named version into staging, then load it through a model's `load_weights`.

    One per worker process. The gRPC client is kept between updates (one channel per
    learner address). A failed or corrupt fetch leaves nothing staged and the model untouched:
    `WeightSyncClient.fetch` returns only a complete, checksum-verified set.
    """

    def __init__(self, rank: int | None = None, fetch_timeout_s: float | None = None) -> None:
        self.rank = rank
        self.fetch_timeout_s = fetch_timeout_s
        self._client: Any = None
        self._client_key: tuple[Any, ...] | None = None
        self._relay: Any = None  # rank 0: serves the other ranks (and replicas, with relays)
        self._relay_key: tuple[Any, ...] | None = None
        self._share: Any = None  # ranks > 0: the client reading rank 0's relay
        self._share_key: tuple[str, str] | None = None
        self._staged: tuple[int, dict[str, Any]] | None = None

    def _client_for(self, address: str, token: str, plan: dict[str, Any] | None = None) -> Any:
        from services.common.weight_sync.settings import replica_client

        plan = plan or {}
        relay = self._relay_for(plan, token)
        key = (address, token, bool(plan.get("relays")), id(relay), plan.get("tls_ca"),
               plan.get("tls_name"))
        if self._client is None or self._client_key != key:
            if self._client is not None:
                self._client.close()
            self._client = replica_client(address, token, plan, relay,
                                          fetch_timeout_s=self.fetch_timeout_s)
            self._client_key = key
        return self._client

    def _relay_for(self, plan: dict[str, Any], token: str) -> Any:
        """Rank 0's relay for `plan`: on the plan's Unix socket for the other ranks, and on TCP
        for other replicas when relays are on; kept between updates while the plan is the
        same (the previous version is served until the next one begins)."""
        from services.common.weight_sync.settings import start_relay

        share = str(plan.get("share") or "")
        key = (bool(plan.get("relays")), plan.get("host"), plan.get("port"),
               plan.get("advertise"), share, token, plan.get("tls_cert"), plan.get("tls_key"))
        if self._relay is not None and self._relay_key != key:
            self._relay.stop()
            self._relay = None
        if self._relay is None and (plan.get("relays") or share):
            self._relay = start_relay(plan, token, share)
            self._relay_key = key
        return self._relay

    def _fetch(self, version: int, address: str, token: str,
               plan: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        from services.common.weight_sync import WeightSyncClient, WeightSyncError

        share = str(plan.get("share") or "")
        if share and self.rank not in (None, 0):
            if self._share is None or self._share_key != (share, token):
                if self._share is not None:
                    self._share.close()
                self._share = WeightSyncClient(share, token=token or None,
                                               fetch_timeout_s=self.fetch_timeout_s)
                self._share_key = (share, token)
            # Every rank gets the stage call at once: rank 0 may not have bound its socket or
            # begun the version yet. Wait for that (not for a relay that failed: then the
            # learner), up to share_wait_s.
            deadline = time.monotonic() + float(plan.get("share_wait_s", SHARE_WAIT_S))
            while True:
                try:
                    return self._share.fetch_with_metadata(version)
                except WeightSyncError as exc:
                    early = exc.reason in ("unavailable", "not_held") and "relay_" not in str(exc)
                    if early and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    log.warning("rank %s: reading v%d from rank 0 (%s) failed (%s); fetching "
                                "it from the learner", self.rank, version, share, exc)
                    break
            # straight from the learner: no relays, the same TLS
            direct = {k: v for k, v in plan.items() if k in ("tls_ca", "tls_name")}
            return self._client_for(address, token, direct).fetch_with_metadata(version)
        return self._client_for(address, token, plan).fetch_with_metadata(version)

    def stage(self, version: int, address: str, token: str = "",
              plan: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fetch exactly `version` (every rank must load the same one) into a staging copy.
        `plan` (settings.relay_plan, plain values, plus "share": rank 0's Unix socket) says
        whether to fetch through relays and how the replica's ranks share one fetch."""
        from services.common.weight_sync import WeightSyncError

        self._staged = None
        version = int(version)
        if version <= 0:
            return _result(False, version, self.rank, "manifest",
                           f"version must be positive, got {version}")
        try:
            got, tensors, meta = self._fetch(version, address, token, dict(plan or {}))
        except WeightSyncError as exc:
            return _result(False, version, self.rank, exc.reason, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the engine, never raised across RPC
            return _result(False, version, self.rank, "error", f"{type(exc).__name__}: {exc}")
        if got != version:  # fetch(version) guarantees this; checked because ranks must agree
            return _result(False, version, self.rank, "superseded",
                           f"asked for version {version}, got {got}")
        if meta.get("kind"):  # an adapter is no state dict: load_weights must never see it
            return _result(False, version, self.rank, "manifest",
                           f"version {version} is a {meta['kind']} adapter, not full weights; "
                           "adapters go through vLLM's LoRA support "
                           "(VLLMEngine.load_adapter), never through the workers")
        self._staged = (got, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return _result(True, got, self.rank, tensors=len(tensors), nbytes=nbytes)

    def commit(self, version: int, reload: ReloadWeights) -> dict[str, Any]:
        """Load the staged copy of `version`; the staging copy is freed either way."""
        staged, self._staged = self._staged, None
        version = int(version)
        if staged is None or staged[0] != version:
            have = "nothing" if staged is None else f"version {staged[0]}"
            return _result(False, version, self.rank, "not_staged",
                           f"asked to load version {version} but {have} is staged")
        tensors = staged[1]
        try:
            reload(iter(tensors.items()))
        except Exception as exc:  # noqa: BLE001 - reported; the engine treats it as fatal
            return _result(False, version, self.rank, "load", f"{type(exc).__name__}: {exc}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return _result(True, version, self.rank, tensors=len(tensors), nbytes=nbytes)

    def drop(self) -> dict[str, Any]:
        staged, self._staged = self._staged, None
        return _result(True, staged[0] if staged else 0, self.rank)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._share is not None:
            self._share.close()
            self._share = None
        if self._relay is not None:
            self._relay.stop()
            self._relay = None


class ForageWorkerExtension:
    """Mixed into vLLM's worker class (`--worker-extension-cls`); called via `collective_rpc`.

    `self` is the vLLM worker: `self.reload_weights` (vLLM 0.32+) reloads this rank's model in
    place, `self.device` is its device, `self.rank` its rank. Those three attributes are all
    this class relies on.
    """

    def _forage_loader(self) -> WorkerWeightLoader:
        loader = getattr(self, "_forage_weight_loader", None)
        if loader is None:
            loader = WorkerWeightLoader(rank=getattr(self, "rank", None))
            self._forage_weight_loader = loader
        return loader

    def forage_stage_weights(self, version: int, address: str, token: str = "",
                             plan: dict[str, Any] | None = None) -> dict[str, Any]:
        result = self._forage_loader().stage(version, address, token, plan)
        if not result["ok"]:
            log.warning("rank %s: staging weights v%s failed: %s", result["rank"], version,
                        result["error"])
        return result

    def _forage_reload(self, weights: Iterator[tuple[str, Any]]) -> None:
        reload = getattr(self, "reload_weights", None)
        if reload is None:
            raise RuntimeError("this vLLM worker has no in-place weight reload "
                               "(Worker.reload_weights, vLLM 0.32 or newer)")
        quiet_rotary_reload_warning()
        reload(weights_iterator=weights)

    def forage_commit_weights(self, version: int) -> dict[str, Any]:
        import torch

        device = getattr(self, "device", None)
        # vLLM's own weight-update path loads under the worker's device as the default device.
        context = torch.device(device) if device is not None else contextlib.nullcontext()
        with context:
            result = self._forage_loader().commit(version, self._forage_reload)
        if result["ok"] and torch.cuda.is_available():
            torch.cuda.synchronize()
        return result

    def forage_drop_staged_weights(self) -> dict[str, Any]:
        return self._forage_loader().drop()
