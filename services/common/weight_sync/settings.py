"""Weight sync built from the run config: the learner's server, a replica's client and relay.

One place turns `learner.weight_sync_*` and `rollout.weight_relay*` into objects, so the
rollout service (transformers engine: its own process fetches) and the vLLM worker extension
(rank 0 of each replica fetches; it gets these settings as plain values through vLLM's RPC)
build them the same way. Config objects are read by attribute only (services/common imports
no service). TLS (tls.py) travels in the relay plan as file paths: the vLLM workers read the
same files on the same host.
"""

from __future__ import annotations

from typing import Any

from services.common.config.base import ConfigError
from services.common.weight_sync.client import WeightSyncClient
from services.common.weight_sync.relay import WeightRelay
from services.common.weight_sync.tls import ServerTls, channel_credentials, relay_tls


def server_kwargs(learner: Any) -> dict[str, Any]:
    """`WeightSyncServer` keyword arguments from the `learner` config section.

    Threads follow the fetch cap: each streaming fetch holds one, and two stay for GetVersion
    and Locate (at least the 16 of before).
    """
    max_fetches = learner.weight_sync_max_fetches
    return {
        "token": learner.weight_sync_token,
        "chunk_bytes": learner.weight_sync_chunk_bytes,
        "max_workers": max(16, (max_fetches or 0) + 2),
        "max_fetches": max_fetches,
        "max_fetches_per_peer": learner.weight_sync_max_fetches_per_peer,
        "relay": learner.weight_sync_relay != "off",
        "relay_fanout": learner.weight_sync_relay_fanout,
        "tls": ServerTls(learner.weight_sync_tls_cert_file, learner.weight_sync_tls_key_file)
        if learner.weight_sync_tls_cert_file else None,
    }


def relay_plan(rollout: Any, learner: Any = None) -> dict[str, Any]:
    """A replica's relay settings as plain values (they cross vLLM's msgpack RPC as they are),
    with the TLS files from both sections when `learner` is given.

    Raises ConfigError when relays and TLS disagree: replicas dial each other's relays with
    the CA they dial the learner with, so with the CA set a relay must serve TLS, and a relay
    certificate without the CA would refuse every plain client."""
    relays = rollout.weight_relay != "off"
    ca = (learner.weight_sync_tls_ca_file if learner is not None else None) or ""
    cert, key = rollout.weight_relay_tls_cert_file or "", rollout.weight_relay_tls_key_file or ""
    if relays and ca and not cert:
        raise ConfigError("learner.weight_sync_tls_ca_file is set and rollout.weight_relay is "
                          "on: replicas dial relays with TLS, so the relay needs "
                          "rollout.weight_relay_tls_cert_file and _key_file (or set "
                          "rollout.weight_relay: off)")
    if relays and learner is not None and cert and not ca:
        raise ConfigError("rollout.weight_relay_tls_cert_file is set but "
                          "learner.weight_sync_tls_ca_file is not: other replicas would dial "
                          "this relay without TLS (set both, or neither)")
    return {
        "relays": relays,
        "host": rollout.weight_relay_host or rollout.host,
        "port": int(rollout.weight_relay_port),
        "advertise": rollout.weight_relay_advertise,
        "hold_s": float(rollout.weight_relay_hold_s),
        "tls_ca": ca,
        "tls_cert": cert if relays else "",
        "tls_key": key if relays else "",
        "tls_name": rollout.weight_relay_tls_name,
    }


def client_tls(plan: dict[str, Any]) -> dict[str, Any]:
    """`WeightSyncClient` TLS keyword arguments from a relay plan (empty: plain gRPC)."""
    return {"tls_ca_file": str(plan.get("tls_ca") or "") or None,
            "relay_tls_name": str(plan.get("tls_name") or "")}


def check_tls_files(plan: dict[str, Any]) -> None:
    """Read and check the TLS files a relay plan names (ConfigError naming the setting)."""
    if plan.get("tls_ca"):
        channel_credentials(str(plan["tls_ca"]))
    if plan.get("tls_cert"):
        relay_tls(str(plan["tls_cert"]), str(plan["tls_key"])).credentials()


def start_relay(plan: dict[str, Any], token: str | None, local: str = "") -> WeightRelay | None:
    """This replica's relay for `plan` (relay_plan): on TCP when relays are on, and on the Unix
    socket `local` ("unix:/path") for the replica's other tensor-parallel ranks when given;
    None when neither is wanted."""
    relays = bool(plan.get("relays"))
    if not relays and not local:
        return None
    return WeightRelay(
        host=str(plan.get("host") or "127.0.0.1"), port=int(plan.get("port") or 0),
        token=token or None, advertise_host=str(plan.get("advertise") or ""),
        local=local or None, hold_s=float(plan.get("hold_s") or 300.0), listen_tcp=relays,
        tls=relay_tls(str(plan["tls_cert"]), str(plan["tls_key"]))
        if relays and plan.get("tls_cert") else None,
    ).start()


def replica_client(address: str, token: str | None, plan: dict[str, Any],
                   relay: WeightRelay | None, **kwargs: Any) -> WeightSyncClient:
    """The client a replica (or rank 0 of one) fetches with: through relays when the plan says
    so, serving what it receives through `relay`."""
    return WeightSyncClient(address, token=token or None, relays=bool(plan.get("relays")),
                            relay=relay, **client_tls(plan), **kwargs)
