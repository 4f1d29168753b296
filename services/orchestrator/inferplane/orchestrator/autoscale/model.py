"""The autoscaler's values: the signals one decision read, a decision, and the status a
deployment shows (mirror `AutoscalerSignals`, `AutoscalerDecision` and `AutoscalerStatus` of
`inferplane.orchestrator.v1`). Pure values: no I/O, nothing of the catalogue.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

#: Decision kinds, as `AutoscalerDecision.decision` and the metric's `decision` label spell
#: them. "hold" is only ever a status, never a stored decision.
SCALE_UP = "scale_up"
SCALE_DOWN = "scale_down"
SCALE_TO_ZERO = "scale_to_zero"
SCALE_FROM_ZERO = "scale_from_zero"
HOLD = "hold"
DECISIONS = (SCALE_UP, SCALE_DOWN, SCALE_TO_ZERO, SCALE_FROM_ZERO)
#: Decisions kept per deployment in the decisions table (older ones are deleted on write).
DECISIONS_KEPT = 200


@dataclasses.dataclass(frozen=True, slots=True)
class Signals:
    """What one decision read for a deployment, summed or maxed over the routers that hold a
    lease (units: requests, seconds, per second, a 0..1 share).

    `ttft_p99_seconds` 0 means unknown (no telemetry, or no request in its window);
    `idle_seconds` is the time since any router last saw a request for the deployment (or
    since the autoscaler started watching it, when none ever did)."""

    queued_requests: int = 0
    max_queue_wait_seconds: float = 0.0
    queue_rejections_per_second: float = 0.0
    in_flight_requests: int = 0
    engine_waiting_requests: int = 0
    kv_usage: float = 0.0
    ttft_p99_seconds: float = 0.0
    cold_waiting_requests: int = 0
    idle_seconds: float = 0.0
    ready_replicas: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Signals:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One autoscaler decision that changed a deployment's `replicas` (the decisions table)."""

    deployment_id: str
    time: datetime
    decision: str
    from_replicas: int
    to_replicas: int
    reason: str
    signals: Signals


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscalerStatus:
    """The autoscaler's view of one deployment now (`DeploymentStatus.autoscaler`).

    `desired_replicas` is what the signals ask for within the bounds (it may be above
    `replicas` while capacity is missing); `last_decision` the last tick's kind ("hold" when
    it changed nothing); `last_change_time` when `replicas` last changed by the autoscaler."""

    desired_replicas: int
    last_decision: str
    reason: str
    last_change_time: datetime | None
    signals: Signals
