"""The window store (bounds, dedupe, windows) and the record metrics (names, bounded labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from inferplane.runtime.time.gaps import thin
from inferplane.telemetry.domain import Sources
from inferplane.telemetry.ingest import Ingestor, sample_from_record
from inferplane.telemetry.metrics import LabelCaps, RecordMetrics
from inferplane.telemetry.store import Query, Sample, SampleStore
from inferplane.telemetry.summary import summarize
from inferplane.testing.clock import FakeClock

from .conftest import EPOCH, record


def _sample(t: float, key: tuple[str, str, str] = ("m", "d", "t"), rid: str = "") -> Sample:
    return Sample(
        time=t,
        request_id=rid,
        source="router",
        model=key[0],
        deployment=key[1],
        tenant=key[2],
        ttft=0.1,
    )


def test_store_is_bounded_and_evicts_the_least_recently_written_key_first() -> None:
    store = SampleStore(max_records=3, retention_seconds=100)
    store.add(_sample(1, ("m", "d", "quiet")))
    for t in range(2, 5):
        store.add(_sample(t, ("m", "d", "noisy")))
    assert len(store) == 3
    tenants = sorted(s.tenant for s in store.select(Query(since=0, until=10)))
    assert tenants == ["noisy", "noisy", "noisy"]


def test_store_drops_resent_records_and_old_samples() -> None:
    """(source, request_id) is stored once; prune drops samples older than retention."""
    store = SampleStore(max_records=10, retention_seconds=100)
    assert store.add(_sample(1, rid="r1"))
    assert not store.add(_sample(2, rid="r1"))
    assert store.add(_sample(50, rid="r2"))
    store.prune(now=120)
    assert [s.request_id for s in store.select(Query(since=0, until=200))] == ["r2"]
    assert store.deployments() == {("m", "d")}


def test_sample_time_is_the_stamped_finish_never_later_than_receipt() -> None:
    rec = record(finished_at=EPOCH - 30, e2e=2.0)
    assert sample_from_record(rec, EPOCH, 128).time == EPOCH - 30
    assert sample_from_record(record(finished_at=EPOCH + 99), EPOCH, 128).time == EPOCH
    assert sample_from_record(record(), EPOCH, 128).time == EPOCH
    assert thin(range(10), 4) == (0.0, 3.0, 6.0, 9.0)
    assert len(sample_from_record(record(itl=tuple([0.01] * 500)), EPOCH, 128).itl) == 128
    assert sample_from_record(record(itl_mean=0.02), EPOCH, 128).itl == (0.02,)


def _series(registry: CollectorRegistry) -> int:
    return sum(len(m.samples) for m in registry.collect())


def test_series_count_stays_bounded_under_10000_distinct_keys() -> None:
    """10,000 distinct tenants, models, deployments and error codes cannot grow the series
    count past the caps: the overflow lands in label value "other"."""
    caps = LabelCaps(models=3, deployments_per_model=2, tenants_per_deployment=5, error_codes=4)
    registry = CollectorRegistry()
    clock = FakeClock()
    ingestor = Ingestor(
        SampleStore(max_records=1000, retention_seconds=3600),
        RecordMetrics(registry, caps),
        clock,
        Sources(request="", tool_call=""),
    )
    for i in range(10_000):
        ingestor.ingest(
            [
                record(
                    request_id=f"r{i}",
                    model=f"model-{i % 7}",
                    deployment=f"dep-{i}",
                    tenant=f"tenant-{i}",
                    error_code=f"code-{i}" if i % 2 else "",
                    itl=(0.01, 0.02),
                    tool_calls=1,
                    invalid_reasons=(f"why-{i}",),
                ),
            ]
        )
    series = _series(registry)
    # models: 3 + "other"; deployments per model: 2 + "other"; tenants per deployment:
    # 5 + "other" → at most 4 × 3 × 6 = 72 (model, deployment, tenant) label sets.
    labelsets = {
        (s.labels["model"], s.labels["deployment"], s.labels["tenant"])
        for metric in registry.collect()
        for s in metric.samples
        if "tenant" in s.labels
    }
    assert len(labelsets) <= 4 * 3 * 6
    statuses = {
        s.labels["status"] for m in registry.collect() for s in m.samples if "status" in s.labels
    }
    assert statuses <= {"ok", "other"} | {f"code-{i}" for i in range(10)}
    assert len(statuses) <= 4 + 2
    assert series < 5_000
    text = generate_latest(registry).decode()
    assert 'tenant="other"' in text and 'deployment="other"' in text
    assert 'status="other"' in text and 'reason="other"' in text
    assert "tenant-9999" not in text
    # A second wave of fresh keys adds nothing.
    for i in range(10_000, 12_000):
        ingestor.ingest(
            [
                record(
                    request_id=f"r{i}",
                    model=f"model-{i}",
                    deployment=f"dep-{i}",
                    tenant=f"tenant-{i}",
                )
            ]
        )
    assert _series(registry) == series


def test_metrics_names_units_and_ownership() -> None:
    """Latency/status/tokens come from the router's record, tool calls and markers from the
    node-agent's, so a request reported by both is counted once."""
    registry = CollectorRegistry()
    clock = FakeClock()
    store = SampleStore(max_records=100, retention_seconds=3600)
    ingestor = Ingestor(store, RecordMetrics(registry), clock, Sources())
    ingestor.ingest(
        [
            record(request_id="a", source="router", ttft=0.25, itl=(0.01, 0.03), queue=0.5),
            record(
                request_id="a",
                source="node-agent",
                ttft=0.2,
                tool_calls=3,
                tool_calls_valid=2,
                invalid_reasons=("invalid_json",),
                markers_leaked=1,
            ),
            record(request_id="b", source="router", error_code="model_not_found"),
        ]
    )
    value = registry.get_sample_value
    md = {"model": "kimi-tiny", "deployment": "kimi-tiny"}
    mdt = {**md, "tenant": "acme"}
    assert value("inferplane_time_to_first_token_seconds_count", mdt) == 2
    assert value("inferplane_time_to_first_token_seconds_sum", mdt) == 0.35
    assert value("inferplane_inter_token_latency_seconds_count", mdt) == 2
    assert value("inferplane_queue_time_seconds_sum", mdt) == 0.5
    assert value("inferplane_requests_total", {**mdt, "status": "ok"}) == 1
    assert value("inferplane_requests_total", {**mdt, "status": "model_not_found"}) == 1
    assert value("inferplane_tokens_total", {**mdt, "kind": "completion"}) == 20
    assert value("inferplane_tokens_total", {**mdt, "kind": "cached"}) == 10
    assert value("inferplane_tool_calls_total", {**md, "validity": "valid", "reason": "none"}) == 2
    assert (
        value(
            "inferplane_tool_calls_total", {**md, "validity": "invalid", "reason": "invalid_json"}
        )
        == 1
    )
    assert value("inferplane_markers_leaked_total", md) == 1
    assert (
        value(
            "inferplane_telemetry_records_received_total", {"source": "router", "outcome": "stored"}
        )
        == 2
    )
    summary = summarize(store, now=clock.time(), window_seconds=60, sources=Sources(), ps=(50.0,))
    assert (summary.request_count, summary.error_count) == (2, 1)
    assert (summary.tool_calls, summary.tool_calls_valid) == (3, 2)
