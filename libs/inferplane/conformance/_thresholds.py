"""The conformance gate's thresholds and its verdict on a report (issue 30 §2).

The defaults are defined here once; `ReleaseGates` (proto/inferplane/orchestrator/v1/
orchestrator.proto) says "0: the default" for each, and its comments quote these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferplane.api.nodeagent.v1 import replica_pb2

DEFAULT_LIVE_REQUESTS = 12
"""Live requests the gate sends when `ReleaseGates.conformance_live_requests` is 0."""
DEFAULT_TIMEOUT_SECONDS = 120.0
"""Bound on one RunConformance, seconds (`RunConformanceRequest.timeout_seconds` and
`ReleaseGates.conformance_timeout_seconds` 0)."""
DEFAULT_MIN_TOOL_CALL_RATE = 0.95
DEFAULT_MIN_SCHEMA_VALID_RATE = 0.95
DEFAULT_MAX_LEAKED_MARKERS = 0
DEFAULT_MIN_REPLAY_PASS_RATE = 1.0


def _rate(part: int, whole: int) -> float:
    """`part / whole`, 1.0 when there is nothing to count (no failure seen)."""
    return part / whole if whole else 1.0


def tool_call_rate(report: replica_pb2.ConformanceReport) -> float:
    """Live requests that had to call a tool and did, over those that had to (1.0: none had
    to)."""
    return _rate(report.tool_calls_returned, report.tool_calls_expected)


def schema_valid_rate(report: replica_pb2.ConformanceReport) -> float:
    """Tool calls with declared names and schema-valid arguments, over all tool calls
    returned (1.0: none returned)."""
    return _rate(report.tool_calls_schema_valid, report.tool_calls)


def replay_pass_rate(report: replica_pb2.ConformanceReport) -> float:
    """Public cases that matched, over those replayed (1.0: none replayed)."""
    return _rate(report.replay_passed, report.replay_cases)


@dataclass(frozen=True, slots=True)
class ConformanceThresholds:
    """What a replica's `ConformanceReport` must reach to pass the gate.

    Attributes:
        min_tool_call_rate: `tool_calls_returned / tool_calls_expected` at least.
        min_schema_valid_rate: `tool_calls_schema_valid / tool_calls` at least.
        max_leaked_markers: `leaked_markers` at most.
        min_replay_pass_rate: `replay_passed / replay_cases` at least.
    """

    min_tool_call_rate: float = DEFAULT_MIN_TOOL_CALL_RATE
    min_schema_valid_rate: float = DEFAULT_MIN_SCHEMA_VALID_RATE
    max_leaked_markers: int = DEFAULT_MAX_LEAKED_MARKERS
    min_replay_pass_rate: float = DEFAULT_MIN_REPLAY_PASS_RATE

    def __post_init__(self) -> None:
        for name in ("min_tool_call_rate", "min_schema_valid_rate", "min_replay_pass_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.max_leaked_markers < 0:
            raise ValueError(f"max_leaked_markers must be >= 0, got {self.max_leaked_markers}")

    @classmethod
    def from_gates(cls, gates: Any) -> ConformanceThresholds:
        """The thresholds of a profile's `ReleaseGates` (orchestrator.proto), a 0 field taking
        its default.

        Raises:
            ValueError: a rate outside [0, 1] (the caller names the field path).
        """
        return cls(
            min_tool_call_rate=gates.min_tool_call_rate or DEFAULT_MIN_TOOL_CALL_RATE,
            min_schema_valid_rate=gates.min_schema_valid_rate or DEFAULT_MIN_SCHEMA_VALID_RATE,
            max_leaked_markers=int(gates.max_leaked_markers),
            min_replay_pass_rate=gates.min_replay_pass_rate or DEFAULT_MIN_REPLAY_PASS_RATE,
        )

    def check(self, report: replica_pb2.ConformanceReport) -> tuple[bool, str]:
        """`(passed, reason)`: the report against these thresholds. `reason` is one sentence
        with the numbers: every threshold missed (and live requests that all failed), or what
        passed.

        A report whose live requests all failed (`live_errors == live_requests > 0`) fails
        whatever the rates say: nothing was measured.
        """
        failed: list[str] = []
        rate = replay_pass_rate(report)
        if rate < self.min_replay_pass_rate:
            failed.append(
                f"replay {report.replay_passed}/{report.replay_cases} cases passed "
                f"({rate:.0%} < {self.min_replay_pass_rate:.0%})"
            )
        rate = tool_call_rate(report)
        if rate < self.min_tool_call_rate:
            failed.append(
                f"tool calls returned {report.tool_calls_returned}/"
                f"{report.tool_calls_expected} ({rate:.0%} < {self.min_tool_call_rate:.0%})"
            )
        rate = schema_valid_rate(report)
        if rate < self.min_schema_valid_rate:
            failed.append(
                f"schema-valid tool calls {report.tool_calls_schema_valid}/{report.tool_calls}"
                f" ({rate:.0%} < {self.min_schema_valid_rate:.0%})"
            )
        if report.leaked_markers > self.max_leaked_markers:
            failed.append(
                f"{report.leaked_markers} live requests leaked parser markers "
                f"(at most {self.max_leaked_markers})"
            )
        if report.live_requests and report.live_errors >= report.live_requests:
            failed.append(f"all {report.live_requests} live requests failed")
        if failed:
            return False, "conformance failed: " + "; ".join(failed) + "."
        return True, (
            f"conformance passed: replay {report.replay_passed}/{report.replay_cases}, "
            f"tool calls returned {report.tool_calls_returned}/{report.tool_calls_expected}, "
            f"schema-valid {report.tool_calls_schema_valid}/{report.tool_calls}, "
            f"{report.leaked_markers} leaked markers, {report.live_errors}/"
            f"{report.live_requests} live errors, in {report.seconds:.1f} s."
        )


def score(report: replica_pb2.ConformanceReport, gates: Any | None = None) -> tuple[bool, str]:
    """`ConformanceThresholds.check` with the thresholds of `gates` (a `ReleaseGates`; None:
    the defaults)."""
    if gates is None:
        return ConformanceThresholds().check(report)
    return ConformanceThresholds.from_gates(gates).check(report)
