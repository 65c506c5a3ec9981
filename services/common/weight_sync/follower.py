"""The replica's loop step: notice a newer version, fetch and verify it, then swap it in.

Rollout workers call `poll()` between generation steps (docs/architecture.md). The swap callback
runs only with a fully verified set; when a fetch fails the error is logged, counted, and the
current weights keep serving until the next poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from services.common.weight_sync.client import WeightSyncClient
from services.common.weight_sync.notify import VersionListener
from services.common.weight_sync.wire import WeightSyncError

log = logging.getLogger("forage.weight_sync")


class WeightFollower:
    def __init__(
        self,
        client: WeightSyncClient,
        apply: Callable[[int, dict[str, torch.Tensor]], None],
        version: int = 0,
        listener: VersionListener | None = None,
        expect: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        self.client = client
        self.apply = apply
        self.version = version
        self.listener = listener
        self.expect = expect
        self.last_error: WeightSyncError | None = None

    def poll(self, wait_s: float = 0.0) -> bool:
        """Load a newer version if there is one; True when the weights changed."""
        if self.listener is not None and wait_s > 0:
            self.listener.wait(wait_s)
        try:
            current, _ = self.client.get_version()
            if current <= self.version:
                return False
            version, tensors = self.client.fetch(
                None, expect=self.expect() if self.expect else None)
        except WeightSyncError as exc:
            self.last_error = exc
            log.warning("keeping weights v%d: %s", self.version, exc)
            return False
        if version <= self.version:
            return False
        self.apply(version, tensors)
        self.version = version
        self.last_error = None
        return True
