"""RecordRequests, QueryLatency and ListAlerts over a real in-process grpc.aio server."""

from __future__ import annotations

import grpc
import pytest

from inferplane.api.telemetry.v1 import telemetry_pb2

from .conftest import EPOCH, Harness, record


def _pcts(values: object) -> dict[float, float]:
    return {p.percentile: round(p.value, 6) for p in values}  # type: ignore[attr-defined]


def test_record_requests_streams_batches_and_counts_resent_records_once(harness: Harness) -> None:
    batches = [
        telemetry_pb2.RecordRequestsRequest(records=[record(request_id=f"r{i}") for i in range(3)]),
        telemetry_pb2.RecordRequestsRequest(records=[record(request_id="r3")]),
    ]
    assert harness.stub.RecordRequests(iter(batches), timeout=5).accepted == 4
    assert harness.send(record(request_id="r0"), record(request_id="r1")) == 2  # re-sent
    reply = harness.stub.QueryLatency(telemetry_pb2.QueryLatencyRequest(window_seconds=60))
    assert reply.request_count == 4


def test_query_latency_exact_percentiles_over_the_window_with_filters(harness: Harness) -> None:
    now = harness.clock.time()
    ttfts = [0.1 * (i + 1) for i in range(10)]  # 0.1 .. 1.0
    harness.send(
        *[
            record(
                request_id=f"a{i}",
                ttft=t,
                e2e=2 * t,
                itl=(0.01, 0.03),
                completion_tokens=30,
                finished_at=now - 1,
            )
            for i, t in enumerate(ttfts)
        ]
    )
    harness.send(
        record(request_id="old", ttft=9.0, finished_at=now - 120),  # outside a 60 s window
        record(request_id="other-tenant", tenant="globex", ttft=5.0, finished_at=now - 1),
        record(request_id="err", error_code="server_error", ttft=0.0, finished_at=now - 1),
        record(
            request_id="na",
            source="node-agent",
            tool_calls=4,
            tool_calls_valid=3,
            ttft=7.0,
            finished_at=now - 1,
        ),
    )
    reply = harness.stub.QueryLatency(
        telemetry_pb2.QueryLatencyRequest(
            window_seconds=60,
            deployment="kimi-tiny",
            tenant="acme",
            percentiles=[50, 90, 100],
        )
    )
    assert (reply.request_count, reply.error_count) == (11, 1)
    # numpy-linear over 0.1..1.0: p50 = 0.55, p90 = 0.91, p100 = 1.0 (the node-agent's
    # record does not count as a request, the error has no TTFT).
    assert _pcts(reply.time_to_first_token_seconds) == {50: 0.55, 90: 0.91, 100: 1.0}
    assert _pcts(reply.e2e_latency_seconds)[100] == 2.0
    assert _pcts(reply.inter_token_latency_seconds) == {50: 0.02, 90: 0.03, 100: 0.03}
    assert reply.output_tokens_per_second == pytest.approx((10 * 30 + 10) / 60)
    assert reply.tool_call_validity == 0.75
    everyone = harness.stub.QueryLatency(telemetry_pb2.QueryLatencyRequest(window_seconds=600))
    assert everyone.request_count == 13
    empty = harness.stub.QueryLatency(
        telemetry_pb2.QueryLatencyRequest(window_seconds=60, model="nope")
    )
    assert empty.request_count == 0 and list(empty.time_to_first_token_seconds) == []
    assert empty.tool_call_validity == 1.0


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (telemetry_pb2.QueryLatencyRequest(), "window_seconds"),
        (telemetry_pb2.QueryLatencyRequest(window_seconds=60, percentiles=[0]), "percentiles"),
        (telemetry_pb2.QueryLatencyRequest(window_seconds=60, percentiles=[101]), "percentiles"),
    ],
)
def test_query_latency_rejects_bad_arguments(
    harness: Harness, request_: telemetry_pb2.QueryLatencyRequest, param: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        harness.stub.QueryLatency(request_, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(info.value.trailing_metadata() or ())
    assert trailers.get("x-openai-error-param") == param


def test_list_alerts_firing_then_resolved_with_times(harness: Harness) -> None:
    now = harness.clock.time()
    harness.send(
        *[
            record(request_id=f"e{i}", error_code="server_error" if i % 2 else "", finished_at=now)
            for i in range(40)
        ]
    )
    harness.clock.advance(1)
    harness.evaluate()
    alerts = harness.stub.ListAlerts(telemetry_pb2.ListAlertsRequest()).alerts
    error = next(a for a in alerts if a.kind == "error_rate")
    assert error.deployment == "kimi-tiny"
    assert error.value == 0.5 and error.threshold == 0.01
    assert error.start_time.ToNanoseconds() == round((EPOCH + 1) * 1e9)
    assert not error.HasField("end_time")
    assert "error rate of kimi-tiny is 0.5" in error.message
    harness.clock.advance(600)  # the SLO window passes without traffic: resolved
    harness.evaluate()
    assert list(harness.stub.ListAlerts(telemetry_pb2.ListAlertsRequest()).alerts) == []
    resolved = harness.stub.ListAlerts(
        telemetry_pb2.ListAlertsRequest(include_resolved=True)
    ).alerts
    error = next(a for a in resolved if a.kind == "error_rate")
    assert error.end_time.ToNanoseconds() == round((EPOCH + 601) * 1e9)


def test_record_sink_delivers_to_the_real_service(harness: Harness) -> None:
    """The client library's sink, as routers and node-agents use it, reaches QueryLatency."""
    from prometheus_client import CollectorRegistry

    from inferplane.telemetry_client import RecordSink, SinkSettings

    async def main() -> None:
        sink = RecordSink(SinkSettings(target=harness.address, batch_size=4), CollectorRegistry())
        await sink.start()
        for i in range(10):
            sink.record(record(request_id=f"s{i}"))
        await sink.close()

    harness.loop.run(main())
    reply = harness.stub.QueryLatency(telemetry_pb2.QueryLatencyRequest(window_seconds=60))
    assert reply.request_count == 10


def test_query_latency_by_revision_counts_only_that_revisions_records(harness: Harness) -> None:
    """Issue 30: a canary's error rate, TTFT and tool-call validity against its stable
    revision's, from the router's and the replicas' records of each revision."""
    now = harness.clock.time()
    sent = []
    for revision, ttft, errors, valid in (("rev-canary", 0.9, 2, 1), ("rev-stable", 0.2, 0, 4)):
        for i in range(4):
            routed = record(
                request_id=f"{revision}-{i}",
                ttft=ttft,
                error_code="server_error" if i < errors else "",
                finished_at=now - 1,
            )
            routed.revision, routed.adapter = revision, "pirate"
            parsed = record(
                request_id=f"{revision}-{i}",
                source="replica",
                tool_calls=1,
                tool_calls_valid=1 if i < valid else 0,
                finished_at=now - 1,
            )
            parsed.revision = revision
            sent += [routed, parsed]
    assert harness.send(*sent) == 16

    def query(revision: str) -> telemetry_pb2.QueryLatencyResponse:
        return harness.stub.QueryLatency(
            telemetry_pb2.QueryLatencyRequest(
                window_seconds=60, deployment="kimi-tiny", revision=revision, percentiles=[99]
            )
        )

    canary, stable, both = query("rev-canary"), query("rev-stable"), query("")
    assert (canary.request_count, canary.error_count, canary.tool_call_validity) == (4, 2, 0.25)
    assert (stable.request_count, stable.error_count, stable.tool_call_validity) == (4, 0, 1.0)
    assert _pcts(stable.time_to_first_token_seconds) == {99: 0.2}
    assert _pcts(canary.time_to_first_token_seconds) == {99: 0.9}  # the errors had TTFT too
    assert (both.request_count, both.error_count) == (8, 2)
    assert query("rev-none").request_count == 0
