"""`RequestOutcome` → telemetry's `RequestRecord` (the node-agent's view of one request)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from google.protobuf import timestamp_pb2

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.replica.pipeline.outcome import RequestOutcome

SOURCE = "node-agent"
MAX_GAPS = 128  # telemetry keeps at most this many inter-token gaps per record


def outcome_to_record(
    outcome: RequestOutcome, *, node: str, deployment: str, now: float
) -> telemetry_pb2.RequestRecord:
    """One RequestRecord for `outcome`, which ended at wall-clock `now` (seconds).

    The node-agent is the source of tool-call validity and leaked-marker facts (it parsed the
    output); latencies are measured from the request's arrival at the node-agent.
    """
    start = timestamp_pb2.Timestamp()
    start.FromNanoseconds(int((now - outcome.e2e_seconds) * 1e9))
    gaps = outcome.itl_seconds
    if len(gaps) > MAX_GAPS:  # evenly thinned, keeping the shape of the distribution
        step = len(gaps) / MAX_GAPS
        gaps = tuple(gaps[int(i * step)] for i in range(MAX_GAPS))
    invalid = [v.reason.value for v in outcome.tool_call_verdicts if not v.valid and v.reason]
    record = telemetry_pb2.RequestRecord(
        request_id=outcome.request_header_id or outcome.request_id,
        source=SOURCE,
        model=outcome.model,
        deployment=deployment or outcome.model,
        replica=outcome.replica_id,
        node=node,
        start_time=start,
        time_to_first_token_seconds=outcome.ttft_seconds or 0.0,
        e2e_latency_seconds=outcome.e2e_seconds,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=outcome.cached_tokens,
        completion_tokens=outcome.completion_tokens,
        reasoning_tokens=outcome.reasoning_tokens,
        finish_reason=outcome.finish_reason or ("abort" if outcome.status == "cancelled" else ""),
        tool_calls=len(outcome.tool_call_verdicts),
        tool_calls_valid=outcome.valid_tool_calls,
        tool_call_invalid_reasons=invalid,
        markers_leaked=1 if outcome.marker_leaked else 0,
        error_code=outcome.error_code,
        stream=outcome.stream,
        inter_token_latencies_seconds=gaps,
    )
    if outcome.itl_seconds:
        record.inter_token_latency_mean_seconds = statistics.fmean(outcome.itl_seconds)
    return record


def record_sender(
    send: Callable[[telemetry_pb2.RequestRecord], None],
    *,
    node: str,
    deployment_of: Callable[[str], str],
    wall_clock: Callable[[], float],
) -> Callable[[RequestOutcome], None]:
    """An OutcomeSink that converts each outcome and hands it to `send` (a RecordSink.record)."""

    def on_outcome(outcome: RequestOutcome) -> None:
        send(
            outcome_to_record(
                outcome, node=node, deployment=deployment_of(outcome.replica_id), now=wall_clock()
            )
        )

    return on_outcome
