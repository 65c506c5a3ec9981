"""gRPC weight sync between the learner and rollout replicas (docs/architecture.md).

Server (learner): `WeightSyncServer(...).start()`, `.publish(state_dict, version)` or
`.publish_lazy(provider, version)`. Client (replica): `WeightSyncClient(address).fetch()`,
or `WeightFollower` to poll and swap; with `relays=True, relay=WeightRelay(...).start()` it
fetches from the replica the learner names and relays what it receives (fan-out). Redis notice: `notify_new_version` / `VersionListener`.
See docs/weight_sync.md.
"""

from services.common.weight_sync.client import WeightSyncClient
from services.common.weight_sync.follower import WeightFollower
from services.common.weight_sync.notify import (
    VersionListener,
    notify_new_version,
    version_channel,
    version_key,
)
from services.common.weight_sync.relay import WeightRelay
from services.common.weight_sync.server import WeightSyncServer
from services.common.weight_sync.wire import WeightSyncError

__all__ = [
    "VersionListener",
    "WeightFollower",
    "WeightRelay",
    "WeightSyncClient",
    "WeightSyncError",
    "WeightSyncServer",
    "notify_new_version",
    "version_channel",
    "version_key",
]
