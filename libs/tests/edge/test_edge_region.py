"""A region's edge (`EdgeConfig.region`, `_region.py`): the rendered additions, validated by
Envoy, and a real Envoy answering the region's ready route by its routers' gRPC health and
naming its region on every response."""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferplane.edge import (
    FILTER_ORDER,
    REGION_FILTERS,
    ROUTER_CLUSTER,
    EdgeConfig,
    EdgeConfigError,
    Endpoint,
    EnvoyProcess,
    build_bootstrap,
    build_xds_resources,
    render_static_bootstrap,
    validate_bootstrap,
)
from inferplane.regions import REGION_READY_PATH
from inferplane.wire.headers import SERVED_REGION

from ._fakes import free_port


def _config(region: str = "") -> EdgeConfig:
    return EdgeConfig(
        router_endpoints=(Endpoint("127.0.0.1", 7001),),
        auth_endpoint=Endpoint("127.0.0.1", 7002),
        region=region,
    )


def _filters_and_router(config: EdgeConfig) -> tuple[list[str], dict[str, Any]]:
    bootstrap = build_bootstrap(config)
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (router,) = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == ROUTER_CLUSTER
    ]
    return [f["name"] for f in hcm["http_filters"]], router


def test_without_region_the_edge_is_unchanged() -> None:
    names, router = _filters_and_router(_config())
    assert tuple(names) == FILTER_ORDER
    assert "health_checks" not in router
    assert build_bootstrap(_config()) == build_bootstrap(_config(""))
    listener = build_bootstrap(_config())["static_resources"]["listeners"][0]
    assert "xff_num_trusted_hops" not in listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_a_region_edge_renders_its_ready_route_and_header_and_envoy_accepts_it() -> None:
    config = _config("eu")
    names, router = _filters_and_router(config)
    assert tuple(names) == REGION_FILTERS + FILTER_ORDER
    (check,) = router["health_checks"]
    assert "grpc_health_check" in check
    assert check["no_traffic_interval"] == check["interval"] == "1s"
    filters = build_bootstrap(config)["static_resources"]["listeners"][0]["filter_chains"][0]
    hcm = filters["filters"][0]["typed_config"]
    ready = hcm["http_filters"][1]["typed_config"]
    assert ready["pass_through_mode"] is False
    assert ready["headers"][0]["string_match"] == {"exact": REGION_READY_PATH}
    assert ready["cluster_min_healthy_percentages"] == {ROUTER_CLUSTER: {"value": 1.0}}
    # Behind the global tier the client's address is the tier's x-forwarded-for entry.
    assert hcm["xff_num_trusted_hops"] == 1
    header = hcm["http_filters"][0]["typed_config"]["mutations"]["response_mutations"][0]
    assert header["append"]["header"] == {"key": SERVED_REGION, "value": "eu"}
    validate_bootstrap(render_static_bootstrap(config))
    build_xds_resources(config)  # the orchestrator's ADS push parses too
    with pytest.raises(EdgeConfigError):
        _config("EU-1")


def _get(client: httpx.Client, path: str) -> httpx.Response:
    return client.get(path)


def _wait_status(client: httpx.Client, status: int, bound_s: float = 8.0) -> float:
    start = time.monotonic()
    while _get(client, REGION_READY_PATH).status_code != status:
        assert time.monotonic() - start < bound_s, f"ready route never answered {status}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_ready_route_follows_the_routers_health(tmp_path: Path) -> None:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    config = EdgeConfig(
        router_endpoints=(Endpoint("127.0.0.1", port),),
        auth_endpoint=Endpoint("127.0.0.1", free_port()),  # nothing listens: auth is down
        listen_port=free_port(),
        admin_port=free_port(),
        region="eu",
    )
    try:
        with (
            EnvoyProcess.from_config(config, tmp_path, concurrency=1),
            httpx.Client(base_url=f"http://127.0.0.1:{config.listen_port}", timeout=5) as client,
        ):
            _wait_status(client, 200)
            ready = _get(client, REGION_READY_PATH)
            assert ready.headers[SERVED_REGION] == "eu"
            # Every response names the region: Envoy's direct answers and its local replies
            # (auth being down, the 404 route's ext_authz fails closed: a shaped 503).
            assert client.get("/health").headers[SERVED_REGION] == "eu"
            assert client.request("TRACE", "/v1/models").headers[SERVED_REGION] == "eu"
            refused = client.get("/nowhere")
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert refused.headers[SERVED_REGION] == "eu"
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            down = _wait_status(client, 503)
            print(f"\nrouter NOT_SERVING -> ready 503 in {down:.2f} s")
            servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            up = _wait_status(client, 200)
            print(f"router SERVING -> ready 200 in {up:.2f} s")
            server.stop(grace=None)
            gone = _wait_status(client, 503)
            print(f"router stopped -> ready 503 in {gone:.2f} s")
    finally:
        server.stop(grace=None)
