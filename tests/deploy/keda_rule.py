"""The rollout ScaledObject's rule, applied as KEDA and the HPA it creates apply it.

Shared by tests/deploy/test_autoscaling.py (the rule on a real stream) and the elastic drill in
tests/launch/test_demo.py (the rule, read from the rendered manifest, starts and stops rollout
replicas of a running `forage up` from the real stream lag). Loaded by file path: importlib
mode cannot import one test module from another.

What it follows (KEDA v2.20 and Kubernetes' autoscaling/v2 HPA, as documented):
- each redis-streams trigger reads the rollout group of the prompts stream: `lagCount` the
  group's lag (XINFO GROUPS), `pendingEntriesCount` its pending entries (XPENDING),
  `streamLength` the stream's length (XLEN);
- `scalingModifiers.formula` (only sums of trigger names here) gives one value, and with
  `metricType: AverageValue` the HPA wants ceil(value / target) replicas, kept where it is
  while value / (target x replicas) is within the HPA's 10% tolerance, clamped to
  [minReplicaCount, maxReplicaCount];
- the HPA's behaviour: a recommendation is stabilised (scale-up: the lowest over the scale-up
  window, default 0 s; scale-down: the highest over the scale-down window), then limited by the
  policies (scale-up default: 100% or 4 pods per 15 s, whichever allows more; scale-down: the
  ScaledObject's `Pods` policy).

`time_scale` multiplies every duration of the rule (polling interval, windows, policy periods)
so a drill can run the same rule in seconds rather than minutes.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

HPA_TOLERANCE = 0.1
SCALE_UP_DEFAULT = {"stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15},
                                 {"type": "Pods", "value": 4, "periodSeconds": 15}],
                    "selectPolicy": "Max"}
SCALE_DOWN_DEFAULT = {"stabilizationWindowSeconds": 300,
                      "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
                      "selectPolicy": "Max"}


def formula_terms(scaled_object: dict[str, Any]) -> list[str]:
    formula = scaled_object["spec"]["advanced"]["scalingModifiers"]["formula"]
    if not re.fullmatch(r"\w+( \+ \w+)*", formula):
        raise ValueError(f"only sums of trigger names are modelled here: {formula!r}")
    return formula.split(" + ")


def trigger_metrics(client: Any, scaled_object: dict[str, Any], key: str) -> dict[str, int]:
    """Each trigger's value as KEDA's redis-streams scaler reads it, from a real Redis.
    `key` is the stream (the trigger's own `stream` names the production namespace)."""
    values: dict[str, int] = {}
    for trigger in scaled_object["spec"]["triggers"]:
        meta = trigger["metadata"]
        group = meta["consumerGroup"]
        if "lagCount" in meta:
            infos = [g for g in client.xinfo_groups(key) if _text(g["name"]) == group]
            values[trigger["name"]] = int(infos[0]["lag"] or 0) if infos else 0
        elif "pendingEntriesCount" in meta:
            values[trigger["name"]] = int(client.xpending(key, group)["pending"])
        else:
            values[trigger["name"]] = int(client.xlen(key))
    return values


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def desired_replicas(scaled_object: dict[str, Any], metrics: dict[str, int],
                     current: int | None = None, target: float | None = None) -> int:
    """The HPA's unstabilised recommendation: ceil(formula value / target), kept at `current`
    within the tolerance, clamped to the ScaledObject's bounds. `target` overrides the
    manifest's (a drill's smaller replicas hold fewer groups)."""
    spec = scaled_object["spec"]
    value = sum(metrics[name] for name in formula_terms(scaled_object))
    target = target if target is not None else float(
        spec["advanced"]["scalingModifiers"]["target"])
    wanted = math.ceil(value / target)
    if current and abs(value / (target * current) - 1.0) <= HPA_TOLERANCE:
        wanted = current
    return max(spec.get("minReplicaCount", 0), min(spec["maxReplicaCount"], wanted))


@dataclass
class Autoscaler:
    """The replica count an HPA made from `scaled_object` keeps, poll by poll."""

    scaled_object: dict[str, Any]
    replicas: int
    time_scale: float = 1.0
    target: float | None = None
    history: deque[tuple[float, int]] = field(default_factory=deque)
    changes: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas after)

    @property
    def polling_s(self) -> float:
        return float(self.scaled_object["spec"].get("pollingInterval", 30)) * self.time_scale

    def _behavior(self, direction: str) -> dict[str, Any]:
        advanced = self.scaled_object["spec"].get("advanced", {})
        behavior = advanced.get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
        default = SCALE_UP_DEFAULT if direction == "scaleUp" else SCALE_DOWN_DEFAULT
        return {**default, **behavior.get(direction, {})}

    def _limit(self, now: float, direction: str, wanted: int) -> int:
        """The behaviour's policies: how far the count may move given the changes in each
        policy's period (selectPolicy Max: the most permissive; Min: the least)."""
        behavior = self._behavior(direction)
        allowed: list[int] = []
        for policy in behavior["policies"]:
            period = policy["periodSeconds"] * self.time_scale
            moved = sum(abs(delta) for t, delta in self._deltas() if t > now - period
                        and (delta > 0) == (direction == "scaleUp"))
            start = self.replicas - moved if direction == "scaleUp" else self.replicas + moved
            step = (policy["value"] if policy["type"] == "Pods"
                    else math.ceil(start * policy["value"] / 100))
            allowed.append(max(0, step - moved))
        room = max(allowed) if behavior.get("selectPolicy", "Max") == "Max" else min(allowed)
        if direction == "scaleUp":
            return min(wanted, self.replicas + room)
        return max(wanted, self.replicas - room)

    def _deltas(self) -> list[tuple[float, int]]:
        previous, out = None, []
        for t, count in self.changes:
            if previous is not None:
                out.append((t, count - previous))
            previous = count
        return out

    def poll(self, now: float, metrics: dict[str, int]) -> int:
        """One polling interval: record the recommendation, return the new replica count."""
        if not self.changes:
            self.changes.append((now, self.replicas))
        raw = desired_replicas(self.scaled_object, metrics, self.replicas, self.target)
        self.history.append((now, raw))
        longest = max(self._behavior(d)["stabilizationWindowSeconds"]
                      for d in ("scaleUp", "scaleDown")) * self.time_scale
        while self.history and self.history[0][0] < now - longest:
            self.history.popleft()

        def over(direction: str) -> list[int]:
            window = self._behavior(direction)["stabilizationWindowSeconds"] * self.time_scale
            return [n for t, n in self.history if t >= now - window] or [raw]

        up, down = min(over("scaleUp")), max(over("scaleDown"))
        wanted = self.replicas
        if up > self.replicas:
            wanted = self._limit(now, "scaleUp", up)
        elif down < self.replicas:
            wanted = self._limit(now, "scaleDown", down)
        if wanted != self.replicas:
            self.replicas = wanted
            self.changes.append((now, wanted))
        return self.replicas
