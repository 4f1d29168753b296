"""The stack's last start-up step: it returns only once the routers admit on their shares of
the replicas' caps. An orchestrator on a new database grants every share as 0 for its first
16 s (services/router/README.md, "Shared caps"); a stack that returned then handed out an
endpoint whose first request waited out the router's queue and got 429 `model_overloaded`
(issue 29, seen in about 1 start of 4 of bench/autoscale.py with the fake engine)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.localstack import Stack, StackConfig, StackError
from inferplane.localstack import _stack as stack_module
from inferplane.localstack._admitting import RouterCaps, admission_gap, parse_router_caps

REPLICA = "kimi-tiny-0-759cacad"


class _RouterMetrics:
    """The shared-caps families as the router's collector writes them (`router/metrics.py`)."""

    def __init__(self) -> None:
        self.lease: bool | None = True
        self.shares: dict[str, int] = {}
        self.granted_at_request = 0  # > 0: from that request on, `shares` is `granted`
        self.granted: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        if self.lease is None:  # caps not shared: the router writes neither family
            return
        share = GaugeMetricFamily(
            "inferplane_router_cap_share_requests",
            "This router's share of the replica's concurrency cap (shared caps).",
            labels=["deployment", "replica"],
        )
        for replica, value in self.shares.items():
            share.add_metric(["kimi-tiny", replica], value)
        yield share
        lease = GaugeMetricFamily("inferplane_router_cap_lease_valid", "1 while it holds it.")
        lease.add_metric([], 1.0 if self.lease else 0.0)
        yield lease

    def text(self) -> str:
        registry = CollectorRegistry()
        registry.register(self)  # type: ignore[arg-type]
        return generate_latest(registry).decode()


def _endpoint(replica: str = REPLICA, cap: int = 4) -> orchestrator_pb2.RouteEndpoint:
    return orchestrator_pb2.RouteEndpoint(
        replica_id=replica, address="127.0.0.1:1", max_concurrency=cap
    )


def test_parse_reads_the_routers_exposition() -> None:
    metrics = _RouterMetrics()
    metrics.shares = {REPLICA: 4, "other": 0}
    caps = parse_router_caps(metrics.text())
    assert caps == RouterCaps(lease_valid=True, shares={REPLICA: 4, "other": 0})
    metrics.lease = False
    assert parse_router_caps(metrics.text()).lease_valid is False
    metrics.lease = None
    assert parse_router_caps(metrics.text()) == RouterCaps(lease_valid=None, shares={})


def test_no_admission_while_the_orchestrator_grants_nothing() -> None:
    # What the router showed 9 s after the orchestrator started (a real run): lease held,
    # the replica in its table, share 0.
    waiting = RouterCaps(lease_valid=True, shares={REPLICA: 0})
    assert admission_gap({"router": waiting}, [_endpoint()]) == (
        f"the routers hold 0 of the 4 requests of {REPLICA}'s cap"
    )
    granted = RouterCaps(lease_valid=True, shares={REPLICA: 4})
    assert admission_gap({"router": granted}, [_endpoint()]) == ""


def test_every_router_needs_its_lease_and_the_whole_cap_granted() -> None:
    endpoints: Sequence[orchestrator_pb2.RouteEndpoint] = [_endpoint(cap=4)]
    no_lease = RouterCaps(lease_valid=False, shares={})
    assert "router_2 holds no lease" in admission_gap(
        {"router": RouterCaps(True, {REPLICA: 4}), "router_2": no_lease}, endpoints
    )
    # A newcomer's share grows only once the other's shrank and was acknowledged.
    moving = {"router": RouterCaps(True, {REPLICA: 2}), "router_2": RouterCaps(True, {})}
    assert admission_gap(moving, endpoints) != ""
    split = {"router": RouterCaps(True, {REPLICA: 2}), "router_2": RouterCaps(True, {REPLICA: 2})}
    assert admission_gap(split, endpoints) == ""


def test_unshared_caps_and_uncapped_replicas_need_nothing() -> None:
    assert admission_gap({"router": RouterCaps(None, {})}, [_endpoint()]) == ""
    uncapped = [_endpoint(cap=0)]
    assert admission_gap({"router": RouterCaps(True, {})}, uncapped) == ""


@pytest.fixture
def router_metrics() -> Iterator[tuple[_RouterMetrics, int, list[str]]]:
    """A /metrics page on a free port; yields (its state, the port, the states it served)."""
    metrics = _RouterMetrics()
    served: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            if 0 < metrics.granted_at_request <= len(served) + 1:
                metrics.shares = dict(metrics.granted)
            body = metrics.text()
            served.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield metrics, server.server_address[1], served
    finally:
        server.shutdown()
        server.server_close()


def _stack_on(tmp_path: Path, router_port: int) -> Stack:
    base = StackConfig(data_dir=tmp_path)
    index = list(base.ports).index("router")
    return Stack(StackConfig(data_dir=tmp_path, metrics_base_port=router_port - index))


def test_start_waits_until_the_router_is_granted_the_cap(
    tmp_path: Path, router_metrics: tuple[_RouterMetrics, int, list[str]]
) -> None:
    metrics, port, served = router_metrics
    metrics.shares = {REPLICA: 0}
    # The orchestrator's wait ends at the router's third page: the whole cap is granted.
    metrics.granted_at_request, metrics.granted = 3, {REPLICA: 4}
    lines: list[str] = []
    _stack_on(tmp_path, port)._wait_admitting([_endpoint()], lines.append)
    assert [parse_router_caps(text).shares[REPLICA] for text in served] == [0, 0, 4]
    gap = f"the routers hold 0 of the 4 requests of {REPLICA}'s cap"
    assert lines == [f"waiting for the routers to admit: {gap}"]


def test_start_fails_when_the_routers_never_admit(
    tmp_path: Path,
    router_metrics: tuple[_RouterMetrics, int, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics, port, _served = router_metrics
    metrics.lease = False
    monkeypatch.setattr(stack_module, "ADMITTING_TIMEOUT_SECONDS", 0.0)
    with pytest.raises(StackError, match="router holds no lease"):
        _stack_on(tmp_path, port)._wait_admitting([_endpoint()], lambda _line: None)
