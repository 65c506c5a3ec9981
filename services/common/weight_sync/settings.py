"""Weight sync built from the run config: the learner's server, a replica's client and relay.

One place turns `learner.weight_sync_*` and `rollout.weight_relay*` into objects, so the
rollout service (transformers engine: its own process fetches) and the vLLM worker extension
(rank 0 of each replica fetches; it gets these settings as plain values through vLLM's RPC)
build them the same way. Config objects are read by attribute only (services/common imports
no service).
"""

from __future__ import annotations

from typing import Any

from services.common.weight_sync.client import WeightSyncClient
from services.common.weight_sync.relay import WeightRelay


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
    }


def relay_plan(rollout: Any) -> dict[str, Any]:
    """A replica's relay settings as plain values (they cross vLLM's msgpack RPC as they are)."""
    return {
        "relays": rollout.weight_relay != "off",
        "host": rollout.weight_relay_host or rollout.host,
        "port": int(rollout.weight_relay_port),
        "advertise": rollout.weight_relay_advertise,
        "hold_s": float(rollout.weight_relay_hold_s),
    }


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
    ).start()


def replica_client(address: str, token: str | None, plan: dict[str, Any],
                   relay: WeightRelay | None, **kwargs: Any) -> WeightSyncClient:
    """The client a replica (or rank 0 of one) fetches with: through relays when the plan says
    so, serving what it receives through `relay`."""
    return WeightSyncClient(address, token=token or None, relays=bool(plan.get("relays")),
                            relay=relay, **kwargs)
