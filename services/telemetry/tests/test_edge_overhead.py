"""The edge overhead metric: Envoy access-log entries → `inferplane_edge_overhead_seconds`,
over a real in-process grpc.aio server (the guard included) and as pure functions."""

from __future__ import annotations

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import duration_pb2, struct_pb2
from prometheus_client import CollectorRegistry

from inferplane.runtime.security.internal import InternalCallerGuard, is_loopback_peer
from inferplane.runtime.service._errors import PermissionDeniedError, UnauthenticatedError
from inferplane.telemetry.edge_overhead import (
    OVERHEAD_BUCKETS,
    EdgeOverheadMetrics,
    edge_overhead_seconds,
)
from inferplane.testing.clock import FakeClock
from inferplane.wire.headers import INTERNAL_TOKEN, PICKER_MODEL, PICKER_NAMESPACE, UNKNOWN_MODEL

from .conftest import Harness, start_harness, stop_harness

MS = 1e-3


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def entry(
    model: str | None = "kimi-tiny",
    *,
    last_rx: float | None = 0.2 * MS,
    upstream_tx: float | None = 1.7 * MS,
    upstream_rx: float | None = 40 * MS,
    downstream_tx: float | None = 40.3 * MS,
) -> accesslog_pb2.HTTPAccessLogEntry:
    """An HTTP entry as Envoy 1.40 sends it: timings since the request's first byte, and the
    picker's dynamic metadata (none when `model` is None)."""
    log = accesslog_pb2.HTTPAccessLogEntry()
    common = log.common_properties
    for field, value in (
        ("time_to_last_rx_byte", last_rx),
        ("time_to_first_upstream_tx_byte", upstream_tx),
        ("time_to_last_upstream_tx_byte", upstream_tx),
        ("time_to_first_upstream_rx_byte", upstream_rx),
        ("time_to_first_downstream_tx_byte", downstream_tx),
    ):
        if value is not None:
            getattr(common, field).CopyFrom(_duration(value))
    if model is not None:
        picker = struct_pb2.Struct()
        picker.update({PICKER_MODEL: model, "authenticated": True})
        common.metadata.filter_metadata[PICKER_NAMESPACE].CopyFrom(picker)
    other = struct_pb2.Struct()
    other.update({"stream": True})
    common.metadata.filter_metadata["inferplane.edge"].CopyFrom(other)
    return log


def _stream(*entries: accesslog_pb2.HTTPAccessLogEntry) -> als_pb2.StreamAccessLogsMessage:
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "inferplane-edge-overhead"
    message.http_logs.log_entry.extend(entries)
    return message


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_overhead_is_the_request_leg_plus_the_response_leg() -> None:
    common = entry().common_properties
    assert edge_overhead_seconds(common) == pytest.approx(1.5 * MS + 0.3 * MS)
    # A leg that overlaps counts 0, never negative.
    overlapping = entry(last_rx=3 * MS, upstream_tx=1 * MS).common_properties
    assert edge_overhead_seconds(overlapping) == pytest.approx(0.3 * MS)
    # Refused before a replica answered: no upstream timings.
    assert edge_overhead_seconds(entry(upstream_rx=None).common_properties) is None
    unsent = entry(upstream_tx=None, upstream_rx=None)
    assert edge_overhead_seconds(unsent.common_properties) is None


def test_metrics_observe_routed_entries_only_and_cap_the_model_label() -> None:
    registry = CollectorRegistry()
    metrics = EdgeOverheadMetrics(registry, max_models=2)
    assert metrics.observe(entry()) == pytest.approx(1.8 * MS)
    assert metrics.observe(entry(UNKNOWN_MODEL, upstream_rx=None, downstream_tx=None)) is None
    assert metrics.observe(entry(None)) is None  # not a generation request
    metrics.observe(entry("second"))
    metrics.observe(entry("third"))  # over the cap: "other"
    count = "inferplane_edge_overhead_seconds_count"
    assert _sample(registry, count, model="kimi-tiny") == 1
    assert _sample(registry, count, model="second") == 1
    assert _sample(registry, count, model="other") == 1
    assert _sample(registry, count, model="third") == 0
    assert _sample(registry, count, model=UNKNOWN_MODEL) == 0
    entries = "inferplane_edge_log_entries_total"
    assert _sample(registry, entries, outcome="observed") == 3
    assert _sample(registry, entries, outcome="no_upstream") == 1
    assert _sample(registry, entries, outcome="no_model") == 1
    # 1.8 ms falls in the (1.5 ms, 2 ms] bucket: the buckets resolve the 0.1-50 ms range.
    bucket = "inferplane_edge_overhead_seconds_bucket"
    assert _sample(registry, bucket, model="kimi-tiny", le="0.0015") == 0
    assert _sample(registry, bucket, model="kimi-tiny", le="0.002") == 1
    assert OVERHEAD_BUCKETS[0] == 0.0001 and 0.05 in OVERHEAD_BUCKETS


def _send(harness: Harness, *messages: als_pb2.StreamAccessLogsMessage, token: str = "") -> None:
    stub = als_pb2_grpc.AccessLogServiceStub(harness.channel)
    metadata = ((INTERNAL_TOKEN, token),) if token else ()
    stub.StreamAccessLogs(iter(messages), timeout=5, metadata=metadata)


def test_stream_access_logs_feeds_the_histogram(harness: Harness) -> None:
    _send(harness, _stream(entry(), entry(None)), _stream(entry(downstream_tx=45 * MS)))
    registry = harness.components.registry
    assert _sample(registry, "inferplane_edge_overhead_seconds_count", model="kimi-tiny") == 2
    total = _sample(registry, "inferplane_edge_overhead_seconds_sum", model="kimi-tiny")
    assert total == pytest.approx(1.8 * MS + 6.5 * MS)


def test_a_configured_token_is_required(clock: FakeClock) -> None:
    harness = start_harness(clock, internal_token="s3cret")
    try:
        with pytest.raises(grpc.RpcError) as missing:
            _send(harness, _stream(entry()))
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            _send(harness, _stream(entry()), token="guess")
        assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
        registry = harness.components.registry
        count = "inferplane_edge_overhead_seconds_count"
        assert _sample(registry, count, model="kimi-tiny") == 0
        _send(harness, _stream(entry()), token="s3cret")
        assert _sample(registry, count, model="kimi-tiny") == 1
    finally:
        stop_harness(harness)


def test_the_guard_without_a_token_admits_certificates_and_loopback_only() -> None:
    guard = InternalCallerGuard()
    guard.check({}, "ipv4:127.0.0.1:5000", None)
    guard.check({}, "ipv6:[::1]:5000", None)
    guard.check({}, "ipv4:10.0.0.7:5000", "edge")  # mutual TLS: PeerPolicy checked who
    with pytest.raises(PermissionDeniedError):
        guard.check({}, "ipv4:10.0.0.7:5000", None)
    with pytest.raises(UnauthenticatedError):
        InternalCallerGuard("t").check({}, "ipv4:127.0.0.1:5000", "edge")
    assert is_loopback_peer("unix:/tmp/s") and not is_loopback_peer("garbage")
