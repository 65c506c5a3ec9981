"""The learner's side of relay fan-out: which source each receiver of a version fetches from.

Every replica that wants version v asks the learner (`Locate`) where to fetch it, saying where
it serves what it receives (its relay). The learner answers with the earliest receiver that
joined before it and still has room (`fanout` children being fed at once), or with itself when
there is none: a pipelined chain for fanout 1, a k-ary tree filled level by level for k. Why a chain by default: each replica's uplink then
carries one copy, so with a per-host NIC of B bytes/s every link runs at B and the version
reaches N replicas in about size/B + N chunk times (a k-ary tree splits each uplink k ways:
about k × size/B). The learner sends each byte about once, whatever N.

Elastic and simple on purpose: membership is per version and lives only here, in memory (a
new version starts a fresh list; a learner restart loses nothing that matters: receivers ask
again). A receiver keeps its place in the join order for the whole version, and a parent is
always chosen among those that joined earlier, so re-parenting after a failure cannot make a
cycle. A source reported as failed is not assigned again for that version; a receiver that
reports `done` frees its parent's slot. A parent that joined earlier but has not finished is a
fine source: its relay streams chunk k as soon as it has verified chunk k.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

LEARNER = ""  # the source "" means: fetch from the learner itself


@dataclass
class _Member:
    order: int
    relay: str  # where it serves this version ("" = it does not relay)
    parent: str = LEARNER
    done: bool = False


class FanoutPlan:
    """Assigns sources for the version being served; thread-safe (gRPC handler threads)."""

    def __init__(self, fanout: int = 1, enabled: bool = True) -> None:
        if fanout < 1:
            raise ValueError("relay fanout must be at least 1")
        self.fanout = fanout
        self.enabled = enabled
        self._lock = threading.Lock()
        self._version = 0
        self._members: dict[str, _Member] = {}
        self._dead: set[str] = set()

    def _reset(self, version: int) -> None:
        if version != self._version:
            self._version = version
            self._members = {}
            self._dead = set()

    def locate(self, version: int, client_id: str, relay: str = "",
               failed: Iterable[str] = (), done: bool = False) -> str:
        """The address `client_id` should fetch `version` from (LEARNER = the learner)."""
        with self._lock:
            self._reset(version)
            self._dead.update(a for a in failed if a)
            if not client_id:
                return LEARNER
            me = self._members.get(client_id)
            if me is None:
                me = _Member(order=len(self._members), relay=relay)
                self._members[client_id] = me
            elif relay:
                me.relay = relay
            if done:
                me.done = True
                return LEARNER
            me.parent = self._choose(client_id, me) if self.enabled else LEARNER
            return me.parent

    def _choose(self, client_id: str, me: _Member) -> str:
        load: dict[str, int] = {}
        for other_id, other in self._members.items():
            if (other_id != client_id and not other.done and other.parent
                    and not (other.relay and other.relay in self._dead)):
                load[other.parent] = load.get(other.parent, 0) + 1
        candidates = [m for i, m in self._members.items()
                      if i != client_id and m.order < me.order and m.relay
                      and m.relay != me.relay and m.relay not in self._dead]
        for member in sorted(candidates, key=lambda m: m.order):
            if load.get(member.relay, 0) < self.fanout:
                return member.relay
        return LEARNER

    def snapshot(self) -> dict[str, object]:
        """Who fetches from whom for the current version (diagnostics and tests)."""
        with self._lock:
            return {
                "version": self._version,
                "members": {i: {"order": m.order, "relay": m.relay, "parent": m.parent,
                                "done": m.done} for i, m in self._members.items()},
                "dead": sorted(self._dead),
            }
