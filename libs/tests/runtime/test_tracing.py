"""inferplane.runtime.tracing: settings, the parent-based ratio sampler, the no-op when off,
and export over OTLP/gRPC to the suite's receiver (inferplane.testing.otlp)."""

from __future__ import annotations

import pytest

from inferplane.runtime import ConfigError, ServiceSettings, load_settings
from inferplane.runtime.tracing import (
    DEFAULT_SAMPLING_RATIO,
    DISABLED,
    REQUEST_ID_ATTRIBUTE,
    Tracing,
    TracingSettings,
    collector_address,
    sampled,
)
from inferplane.testing.otlp import OtlpReceiver

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def test_settings_come_from_service_settings() -> None:
    settings = load_settings(
        ServiceSettings,
        service="router",
        argv=["--plaintext", "--otlp-traces-endpoint", "http://collector:4317"],
        environ={"INFERPLANE_ROUTER_TRACE_SAMPLING_RATIO": "0.5"},
    )
    tracing = TracingSettings.of(settings, "inferplane-router")
    assert tracing.endpoint == "collector:4317"
    assert tracing.url == "http://collector:4317"
    assert tracing.sampling_ratio == 0.5
    assert tracing.enabled
    defaults = TracingSettings.of(ServiceSettings(), "x")
    assert not defaults.enabled
    assert defaults.sampling_ratio == DEFAULT_SAMPLING_RATIO


@pytest.mark.parametrize("bad", ["collector", "https://c:4317", "c:notaport", ":4317", "c:0"])
def test_malformed_endpoints_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        collector_address(bad)


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_outside_0_1_is_refused(ratio: float) -> None:
    with pytest.raises(ConfigError, match="trace_sampling_ratio"):
        TracingSettings(endpoint="c:4317", sampling_ratio=ratio)


def test_disabled_does_nothing() -> None:
    assert not DISABLED.enabled
    assert DISABLED.tracer is None
    assert DISABLED.start("x", None) is None
    assert DISABLED.record("x", None, 1, 2) is None
    assert DISABLED.flush()


def test_extract_reads_w3c_headers() -> None:
    assert Tracing.extract({}) is None
    assert Tracing.extract({"traceparent": "garbage"}) is None
    assert Tracing.extract({"traceparent": SAMPLED}) is not None


def _tracing(receiver: OtlpReceiver, ratio: float) -> Tracing:
    settings = TracingSettings(endpoint=receiver.endpoint, sampling_ratio=ratio, service_name="t")
    return Tracing(settings)


def test_spans_reach_the_collector_with_their_parent_and_request_id() -> None:
    with OtlpReceiver() as receiver:
        tracing = _tracing(receiver, 0.0)  # the parent's flag decides, not the ratio
        top = tracing.start(
            "top",
            Tracing.extract({"traceparent": SAMPLED}),
            server=True,
            attributes={REQUEST_ID_ATTRIBUTE: "r-1"},
        )
        assert top is not None
        child = tracing.record("stage", top, 1_000, 2_000)
        assert child is not None
        top.end()
        assert Tracing.headers(top)["traceparent"].startswith(
            "00-0af7651916cd43dd8448eb211c80319c-"
        )
        assert tracing.flush()
        spans = receiver.wait_for(lambda s: len(s) == 2)
        tracing.shutdown()
    by_name = {s.name: s for s in spans}
    assert by_name["top"].service == "t"
    assert by_name["top"].trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert by_name["top"].parent_id == "b7ad6b7169203331"
    assert by_name["top"].kind == 2  # SERVER
    assert by_name["top"].attributes[REQUEST_ID_ATTRIBUTE] == "r-1"
    assert by_name["stage"].parent_id == by_name["top"].span_id
    assert (by_name["stage"].start_ns, by_name["stage"].end_ns) == (1_000, 2_000)


def test_sampler_follows_the_parent_then_the_ratio() -> None:
    with OtlpReceiver() as receiver:
        always = _tracing(receiver, 1.0)
        never = _tracing(receiver, 0.0)
        dropped = always.start("dropped", Tracing.extract({"traceparent": NOT_SAMPLED}))
        kept = never.start("kept", Tracing.extract({"traceparent": SAMPLED}))
        root_kept = always.start("root-kept", None)
        root_dropped = never.start("root-dropped", None)
        for span in (dropped, kept, root_kept, root_dropped):
            assert span is not None
            span.end()
        assert always.flush() and never.flush()
        spans = receiver.wait_for(lambda s: len(s) >= 2)
        always.shutdown()
        never.shutdown()
    assert sorted(s.name for s in spans) == ["kept", "root-kept"]


def test_ratio_samples_about_that_share_of_root_traces() -> None:
    with OtlpReceiver() as receiver:
        tracing = _tracing(receiver, 0.25)
        sampled = 0
        for _ in range(2000):
            span = tracing.start("r", None)
            assert span is not None
            sampled += span.get_span_context().trace_flags.sampled
            span.end()
        tracing.shutdown()
    assert 400 < sampled < 600


def test_sampled_reads_the_flags_without_the_sdk() -> None:
    assert sampled(SAMPLED) is True
    assert sampled(NOT_SAMPLED) is False
    assert sampled("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03") is True
    for bad in ("", "garbage", "00-short-b7ad6b7169203331-01", f"{SAMPLED[:-2]}zz"):
        assert sampled(bad) is None
