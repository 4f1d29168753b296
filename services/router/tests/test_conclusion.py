"""The picker's `Concluder` on its own (no ext_proc stream): every request is concluded once
into one `ConcludedRequest`, usage groups names no route serves under `UNKNOWN_MODEL`, nothing
waits for the usage outbox on the response path, and a replica's report is acknowledged only
once the conclusion it names is durable."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.conclusion import Concluder
from inferplane.router.picker.state import Exchange, Phase, RequestPart
from inferplane.router.policies import default_registry
from inferplane.router.records import CANCELLED, COMPLETED, RequestTrace
from inferplane.router.reporting import Reporter
from inferplane.router.routes import Endpoint
from inferplane.testing.clock import FakeClock
from inferplane.wire import ResponseSummary
from inferplane.wire.headers import UNKNOWN_MODEL

from .fakes import FakeScheduler, RecordingUsage

SERVED = {"m": "m", "m-alias": "m"}
DONE = ResponseSummary(replica_id="r0", prompt_tokens=9, completion_tokens=40, finish_reason="stop")


class Rig:
    def __init__(self) -> None:
        self.clock = FakeClock()
        admission = Admission(
            default_registry(), AdmissionSettings(), self.clock, FakeScheduler(self.clock)
        )
        self.usage = RecordingUsage()
        self.records: list[telemetry_pb2.RequestRecord] = []
        self.registry = CollectorRegistry()
        self.concluder = Concluder(
            admission,
            Reporter(self.usage, self.records.append, self.clock, wall_clock=lambda: 1.7e9),
            metrics=RouterMetrics(self.registry),
            outcome_address="127.0.0.1:1",
            outcome_wait_seconds=5.0,
            served_name=lambda model: SERVED.get(model, UNKNOWN_MODEL),
        )

    def exchange(self, request_id: str, model: str = "m", *, routed: bool = True) -> Exchange:
        trace = RequestTrace(model, True, self.clock.monotonic(), 1.7e9, request_id=request_id)
        trace.key_id, trace.api = "k1", "chat"
        if routed:
            trace.deployment = "d"
        return Exchange(RequestPart(trace))

    def picked(self, exchange: Exchange) -> None:
        exchange.phase = Phase.BODY_DONE
        self.concluder.picked(exchange)

    def trailers(self, exchange: Exchange, summary: ResponseSummary = DONE) -> None:
        exchange.response.http_status, exchange.response.grpc_status = 200, 0
        exchange.response.summary = summary
        exchange.phase = Phase.RESPONSE_DONE
        self.concluder.end(exchange)


def test_a_request_is_concluded_once_into_its_usage_and_its_record() -> None:
    async def scenario() -> None:
        rig = Rig()
        exchange = rig.exchange("req-1", "m-alias")
        rig.picked(exchange)
        rig.clock.advance(1.0)
        rig.trailers(exchange)
        rig.concluder.end(exchange)  # a second end concludes nothing
        (concluded,) = rig.usage.reports
        (record,) = rig.records
        assert concluded.record() == record  # one value, both views
        usage = concluded.usage()
        assert (usage.request_id, usage.key_id, usage.api, usage.status) == (
            "req-1",
            "k1",
            "chat",
            COMPLETED,
        )
        assert (usage.prompt_tokens, usage.completion_tokens) == (9, 40)
        assert usage.model == "m"  # grouped by its served name ...
        assert record.model == "m-alias"  # ... the client's text stays in the record
        assert usage.duration_seconds == record.e2e_latency_seconds == 1.0

    asyncio.run(scenario())


def test_names_no_route_serves_are_one_unknown_model_in_usage() -> None:
    async def scenario() -> None:
        rig = Rig()
        for i, name in enumerate(("../../etc/passwd", "no-such-model-xyz", "")):
            exchange = rig.exchange(f"req-{i}", name, routed=False)
            exchange.phase = Phase.REQUEST_HEADERS_DONE
            exchange.trace.fail("model_not_found")
            exchange.phase = Phase.REFUSED
            rig.concluder.end(exchange)
        assert [r.usage().model for r in rig.usage.reports] == [UNKNOWN_MODEL] * 3
        assert [r.model for r in rig.records] == ["../../etc/passwd", "no-such-model-xyz", ""]
        assert {r.usage().api for r in rig.usage.reports} == {"chat"}

    asyncio.run(scenario())


def test_the_end_never_waits_but_the_replica_report_waits_for_the_outbox() -> None:
    """A stalled outbox (its disk: `held`) delays nothing on the response path; the replica's
    report of that request is acknowledged once the conclusion is durable."""

    async def scenario() -> None:
        rig = Rig()
        rig.usage.held = True
        exchange = rig.exchange("req-1")
        rig.picked(exchange)
        rig.trailers(exchange)  # synchronous: nothing to wait for
        assert exchange.phase is Phase.CONCLUDED and len(rig.usage.reports) == 1
        acked = asyncio.ensure_future(rig.concluder.report_outcomes_settled([("req-1", DONE)]))
        await asyncio.sleep(0.02)
        assert not acked.done()
        rig.usage.release()
        assert await asyncio.wait_for(acked, 1.0) == 0  # concluded by the trailers already
        assert len(rig.usage.reports) == 1

    asyncio.run(scenario())


def test_a_report_while_the_stream_runs_is_acknowledged_once_it_concluded() -> None:
    async def scenario() -> None:
        rig = Rig()
        exchange = rig.exchange("req-1")
        rig.picked(exchange)
        exchange.phase = Phase.RESPONSE_STARTED
        acked = asyncio.ensure_future(rig.concluder.report_outcomes_settled([("req-1", DONE)]))
        await asyncio.sleep(0.02)
        assert not acked.done() and not rig.usage.reports  # the stream still runs
        rig.concluder.end(exchange)  # no trailers: the report concludes it at once
        assert await asyncio.wait_for(acked, 1.0) == 1
        (concluded,) = rig.usage.reports
        assert (concluded.completion_tokens, concluded.status) == (40, COMPLETED)

    asyncio.run(scenario())


def test_an_orphan_report_carries_its_api_and_is_acknowledged_when_durable() -> None:
    async def scenario() -> None:
        rig = Rig()
        rig.usage.held = True
        orphan = ResponseSummary(
            replica_id="r0",
            completion_tokens=3,
            finish_reason="abort",
            key_id="k9",
            model="m",
            api="messages",
        )
        acked = asyncio.ensure_future(rig.concluder.report_outcomes_settled([("lost", orphan)]))
        await asyncio.sleep(0.02)
        assert not acked.done()
        rig.usage.release()
        assert await asyncio.wait_for(acked, 1.0) == 0
        (concluded,) = rig.usage.reports
        usage = concluded.usage()
        assert (usage.api, usage.model, usage.key_id, usage.status) == (
            "messages",
            "m",
            "k9",
            CANCELLED,
        )
        assert not rig.records

    asyncio.run(scenario())


def test_usage_records_and_metrics_carry_the_served_revision_and_the_adapter() -> None:
    """Issue 30: the served endpoint's revision (the primary's when none was reported) is in
    the usage report, the record and the per-revision metrics; the record names the adapter."""

    async def scenario() -> None:
        rig = Rig()
        canary = Endpoint("10.0.0.1:1", "r0", revision="rev-canary")
        stable = Endpoint("10.0.0.2:1", "r1", revision="rev-stable")
        served = rig.exchange("req-1")
        served.trace.adapter = "pirate"
        served.pick.endpoints = (stable, canary)
        rig.picked(served)
        rig.clock.advance(0.5)
        served.pick.picked = rig.clock.monotonic()  # answered Envoy after 0.5 s
        # The summary names r0: the fallback served it.
        rig.trailers(served, dataclasses.replace(DONE, ttft_seconds=0.2))
        failed = rig.exchange("req-2")
        failed.pick.endpoints = (stable, canary)
        rig.picked(failed)
        failed.response.http_status, failed.response.grpc_status = 503, 14
        failed.phase = Phase.RESPONSE_DONE
        rig.concluder.end(failed)  # no served endpoint reported: the primary's revision
        first, second = rig.usage.reports
        assert (first.usage().revision, first.record().revision) == ("rev-canary",) * 2
        assert (first.record().adapter, first.usage().adapter) == ("pirate",) * 2
        assert (second.usage().revision, second.record().revision) == ("rev-stable",) * 2

        def sample(name: str, **labels: str) -> float | None:
            return rig.registry.get_sample_value(name, {"deployment": "d", **labels})

        requests = "inferplane_router_revision_requests_total"
        assert sample(requests, revision="rev-canary", status=COMPLETED) == 1.0
        assert sample(requests, revision="rev-stable", status="failed") == 1.0
        ttft = "inferplane_router_revision_ttft_seconds_count"
        assert sample(ttft, revision="rev-canary") == 1.0
        ttft_sum = sample("inferplane_router_revision_ttft_seconds_sum", revision="rev-canary")
        assert ttft_sum == first.ttft_seconds == pytest.approx(0.7)
        assert sample(ttft, revision="rev-stable") is None  # no output, no TTFT

    asyncio.run(scenario())
