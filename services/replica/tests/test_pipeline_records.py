"""What the replica tells telemetry about a request."""

from __future__ import annotations

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.parsers import ToolCallVerdict, VerdictReason
from inferplane.replica.server import End, Ending, RequestOutcome, record_sender
from inferplane.runtime.time.gaps import MAX_GAPS


def _outcome(**extra: object) -> RequestOutcome:
    fields: dict[str, object] = dict(
        request_id="chatcmpl-1",
        model="kimi-tiny",
        replica_id="r0",
        api="chat",
        stream=True,
        ending=Ending(End.COMPLETED, "tool_calls"),
        prompt_tokens=10,
        completion_tokens=20,
        cached_tokens=4,
        reasoning_tokens=7,
        ttft_seconds=0.25,
        itl_seconds=(0.01, 0.03),
        e2e_seconds=1.5,
        tool_call_verdicts=(
            ToolCallVerdict(index=0, id="functions.a:0", name="a", reason=None, message=""),
            ToolCallVerdict(
                index=1,
                id="functions.b:1",
                name="b",
                reason=VerdictReason.SCHEMA_MISMATCH,
                message="city missing",
            ),
        ),
    )
    fields.update(extra)
    return RequestOutcome(**fields)  # type: ignore[arg-type]


def test_record_carries_latency_tokens_and_tool_call_validity() -> None:
    """Telemetry's tool-call validity (K2-Vendor-Verifier's schema accuracy) comes from here."""
    record = _outcome().to_record(node="n1", deployment="kimi", now=1000.0)
    assert record.record_source == telemetry_pb2.RECORD_SOURCE_REPLICA
    assert (record.source, record.model, record.deployment, record.replica, record.node) == (
        "replica",
        "kimi-tiny",
        "kimi",
        "r0",
        "n1",
    )
    assert record.start_time.ToNanoseconds() == int(998.5e9)
    assert (record.time_to_first_token_seconds, record.e2e_latency_seconds) == (0.25, 1.5)
    assert abs(record.inter_token_latency_mean_seconds - 0.02) < 1e-9
    assert (
        record.prompt_tokens,
        record.cached_tokens,
        record.completion_tokens,
        record.reasoning_tokens,
    ) == (10, 4, 20, 7)
    assert (record.tool_calls, record.tool_calls_valid) == (2, 1)
    assert list(record.tool_call_invalid_reasons) == ["schema_mismatch"]
    assert record.markers_leaked == 0 and record.finish_reason == "tool_calls"


def test_cancelled_requests_and_long_gap_lists() -> None:
    """A client that left is an abort; gap lists are thinned to what telemetry keeps."""
    record = _outcome(
        ending=Ending(End.CANCELLED, "abort"), itl_seconds=tuple([0.01] * 1000)
    ).to_record(
        node="n",
        deployment="",
        now=10.0,
    )
    assert record.finish_reason == "abort"
    assert len(record.inter_token_latencies_seconds) == MAX_GAPS
    assert record.deployment == "kimi-tiny"  # falls back to the model


def test_sender_converts_and_hands_over() -> None:
    sent = []
    on_outcome = record_sender(
        sent.append, node="n", deployment_of=lambda r: f"dep-{r}", wall_clock=lambda: 5.0
    )
    on_outcome(_outcome())
    assert sent[0].deployment == "dep-r0"


def test_records_carry_the_replicas_revision() -> None:
    """Issue 30: the replica's records (tool-call validity) are attributable to the profile
    revision it runs, so a canary's validity is compared with its stable revision's."""
    sent = []
    on_outcome = record_sender(
        sent.append,
        node="n",
        deployment_of=lambda r: "dep",
        wall_clock=lambda: 5.0,
        revision="rev-7",
    )
    on_outcome(_outcome())
    assert sent[0].revision == "rev-7"
    assert _outcome().to_record(node="n", deployment="dep", now=5.0).revision == ""
