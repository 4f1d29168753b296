"""`ConformanceThresholds`: the defaults, `from_gates` (0 is the default), and `check`: each
threshold can fail the report, with its numbers in the reason."""

from __future__ import annotations

import pytest

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.conformance import (
    DEFAULT_MIN_REPLAY_PASS_RATE,
    DEFAULT_MIN_SCHEMA_VALID_RATE,
    DEFAULT_MIN_TOOL_CALL_RATE,
    ConformanceThresholds,
    score,
)


def _good(**changes: float) -> replica_pb2.ConformanceReport:
    report = replica_pb2.ConformanceReport(
        replay_cases=140,
        replay_passed=140,
        live_requests=12,
        live_errors=0,
        tool_calls_expected=8,
        tool_calls_returned=8,
        tool_calls=10,
        tool_calls_schema_valid=10,
        seconds=12.5,
    )
    for name, value in changes.items():
        setattr(report, name, value)
    return report


def test_defaults_pass_a_good_report_and_say_the_numbers() -> None:
    passed, reason = ConformanceThresholds().check(_good())
    assert passed
    assert "replay 140/140" in reason and "8/8" in reason and "10/10" in reason
    assert score(_good()) == (passed, reason)


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"replay_passed": 139}, "replay 139/140 cases passed (99% < 100%)"),
        ({"tool_calls_returned": 7}, "tool calls returned 7/8 (88% < 95%)"),
        ({"tool_calls_schema_valid": 9}, "schema-valid tool calls 9/10 (90% < 95%)"),
        ({"leaked_markers": 1}, "1 live requests leaked parser markers (at most 0)"),
        (
            {"live_errors": 12, "tool_calls_returned": 0, "tool_calls": 0},
            "all 12 live requests failed",
        ),
    ],
)
def test_each_threshold_fails_the_report(changes: dict[str, float], said: str) -> None:
    passed, reason = ConformanceThresholds().check(_good(**changes))
    assert not passed
    assert said in reason, reason
    assert reason.startswith("conformance failed: ")


def test_nothing_to_count_is_no_failure() -> None:
    empty = replica_pb2.ConformanceReport()
    assert ConformanceThresholds().check(empty)[0]


def test_from_gates_zero_means_default_and_set_fields_win() -> None:
    gates = orchestrator_pb2.ReleaseGates()
    assert ConformanceThresholds.from_gates(gates) == ConformanceThresholds(
        DEFAULT_MIN_TOOL_CALL_RATE, DEFAULT_MIN_SCHEMA_VALID_RATE, 0, DEFAULT_MIN_REPLAY_PASS_RATE
    )
    gates = orchestrator_pb2.ReleaseGates(
        min_tool_call_rate=0.5,
        min_schema_valid_rate=0.8,
        max_leaked_markers=2,
        min_replay_pass_rate=0.9,
    )
    thresholds = ConformanceThresholds.from_gates(gates)
    assert thresholds == ConformanceThresholds(0.5, 0.8, 2, 0.9)
    report = _good(tool_calls_returned=4, leaked_markers=2, replay_passed=130)
    assert thresholds.check(report)[0]
    assert not ConformanceThresholds().check(report)[0]
    assert score(report, gates)[0]


@pytest.mark.parametrize(
    "bad",
    [
        {"min_tool_call_rate": 1.5},
        {"min_schema_valid_rate": -0.1},
        {"min_replay_pass_rate": 2.0},
        {"max_leaked_markers": -1},
    ],
)
def test_out_of_range_thresholds_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ConformanceThresholds(**bad)  # type: ignore[arg-type]
