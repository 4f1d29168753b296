"""The canary stage of a release (issue 30): how many candidate replicas serve, the routing
shares, and the decision after the window.

A qualified candidate serves `rollout.canary_percent` of live traffic beside the stable
revision: the route carries `revision_shares` [stable 100-p, candidate p] (routers split by
session, sticky), and `canary_replicas(p, replicas)` candidate replicas run on top of the stable
ones. After `canary_window_seconds` the canary's live error rate, TTFT p99 and tool-call
validity are read from telemetry by revision (`LatencyReader`, release/gate.py) over the time
since the canary began, the stable revision's over the same window, and compared against
`max_canary_error_rate_increase` (absolute), `max_canary_ttft_p99_ratio` and
`max_canary_tool_call_validity_drop` (absolute) (defaults: catalog/model.py). With fewer than
`canary_min_requests` on the canary the window is extended, up to `MAX_CANARY_EXTENSIONS`
times, then the canary is rolled back for want of evidence.
"""

from __future__ import annotations

import dataclasses
import math

from inferplane.orchestrator.catalog.model import RolloutStrategy
from inferplane.orchestrator.release.gate import GateReading

#: Times a canary window with too few requests is extended before the canary is rolled back.
MAX_CANARY_EXTENSIONS = 3

PROMOTE = "promote"
ROLL_BACK = "roll_back"
EXTEND = "extend"


def canary_replicas(percent: int, replicas: int) -> int:
    """Candidate replicas a canary runs: ceil(percent % of `replicas`), at least 1 (with the
    autoscaler on, `replicas` is its count: the canary keeps its share as it scales)."""
    return max(1, math.ceil(percent * max(replicas, 0) / 100))


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryDecision:
    """What the window showed: `action` (PROMOTE, ROLL_BACK, EXTEND), a sentence with the
    numbers, and the figures (by name) the verdict keeps."""

    action: str
    reason: str
    measurements: dict[str, float]


def decide(
    strategy: RolloutStrategy,
    canary: GateReading | None,
    stable: GateReading | None,
    *,
    extensions: int,
    window_seconds: float,
) -> CanaryDecision:
    """The canary's decision from its reading and the stable revision's (None: telemetry could
    not be read: treated as a window without evidence). `extensions`: how many times the
    window was extended already."""
    needed = strategy.effective_canary_min_requests
    got = canary.requests if canary is not None else 0
    if canary is None or stable is None or got < needed:
        why = (
            "telemetry could not be read"
            if canary is None or stable is None
            else f"{got} of {needed} requests served by the canary"
        )
        measurements = {"requests.canary": float(got), "window_seconds": window_seconds}
        if extensions < MAX_CANARY_EXTENSIONS:
            return CanaryDecision(
                EXTEND,
                f"canary window extended ({extensions + 1} of {MAX_CANARY_EXTENSIONS}): {why} "
                f"in {window_seconds:.0f} s",
                measurements,
            )
        return CanaryDecision(
            ROLL_BACK,
            f"too few requests after {MAX_CANARY_EXTENSIONS} extensions: {why} "
            f"in {window_seconds:.0f} s",
            measurements,
        )
    measurements = {
        "requests.canary": float(canary.requests),
        "requests.stable": float(stable.requests),
        "error_rate.canary": canary.error_rate,
        "error_rate.stable": stable.error_rate,
        "ttft_p99_seconds.canary": canary.ttft_p99_seconds,
        "ttft_p99_seconds.stable": stable.ttft_p99_seconds,
        "tool_call_validity.canary": canary.tool_call_validity,
        "tool_call_validity.stable": stable.tool_call_validity,
        "window_seconds": window_seconds,
    }
    problems = []
    increase = canary.error_rate - stable.error_rate
    max_increase = strategy.effective_max_canary_error_rate_increase
    if increase > max_increase:
        problems.append(
            f"error rate {canary.error_rate:.3f} ({canary.errors}/{canary.requests}) vs stable "
            f"{stable.error_rate:.3f} ({stable.errors}/{stable.requests}): +{increase:.3f} > "
            f"+{max_increase:g}"
        )
    max_ratio = strategy.effective_max_canary_ttft_p99_ratio
    if stable.ttft_p99_seconds > 0 and canary.ttft_p99_seconds > 0:
        ratio = canary.ttft_p99_seconds / stable.ttft_p99_seconds
        measurements["ttft_p99_ratio"] = ratio
        if ratio > max_ratio:
            problems.append(
                f"TTFT p99 {canary.ttft_p99_seconds:.3f} s vs stable "
                f"{stable.ttft_p99_seconds:.3f} s: x{ratio:.2f} > x{max_ratio:g}"
            )
    drop = stable.tool_call_validity - canary.tool_call_validity
    max_drop = strategy.effective_max_canary_tool_call_validity_drop
    if drop > max_drop:
        problems.append(
            f"tool-call validity {canary.tool_call_validity:.3f} vs stable "
            f"{stable.tool_call_validity:.3f}: -{drop:.3f} > -{max_drop:g}"
        )
    if problems:
        return CanaryDecision(ROLL_BACK, "; ".join(problems), measurements)
    return CanaryDecision(
        PROMOTE,
        f"canary passed over {window_seconds:.0f} s: error rate {canary.error_rate:.3f} vs "
        f"{stable.error_rate:.3f} (+{max_increase:g} allowed), TTFT p99 "
        f"{canary.ttft_p99_seconds:.3f} s vs {stable.ttft_p99_seconds:.3f} s (x{max_ratio:g}), "
        f"tool-call validity {canary.tool_call_validity:.3f} vs {stable.tool_call_validity:.3f} "
        f"(-{max_drop:g}), {canary.requests} canary requests",
        measurements,
    )
