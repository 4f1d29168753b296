"""The edge's hardening settings as rendered data (README, "Hardening"): what each hostile
input meets before any Envoy runs. `test_edge_hostile.py` checks the same against a real
Envoy."""

from __future__ import annotations

from typing import Any

import inferplane.edge as edge
from inferplane.edge import EdgeConfig, Endpoint, MiB
from inferplane.edge._routes import ALLOWED_METHODS

CONFIG = EdgeConfig(
    router_endpoints=(Endpoint.parse("127.0.0.1:7001"),),
    auth_endpoint=Endpoint.parse("127.0.0.1:7002"),
    listen_port=18080,
    admin_port=19901,
)
EXT_PROC = "envoy.filters.http.ext_proc"
BODY_LIMIT = "envoy.filters.http.body_size_limit"


def _hcm() -> dict[str, Any]:
    hcm: dict[str, Any] = edge.build_listener(CONFIG)["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return hcm


def _routes() -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = edge.build_route_config(CONFIG)["virtual_hosts"][0]["routes"]
    return routes


def test_connect_and_unknown_methods_meet_405_routes_first() -> None:
    connect, other = _routes()[:2]
    assert connect["match"] == {"connect_matcher": {}}
    (method,) = other["match"]["headers"]
    assert method["name"] == ":method" and method["invert_match"] is True
    assert method["string_match"]["safe_regex"]["regex"] == f"^({'|'.join(ALLOWED_METHODS)})$"
    assert "CONNECT" not in ALLOWED_METHODS and "TRACE" not in ALLOWED_METHODS
    for route in (connect, other):
        assert route["direct_response"] == {"status": 405}
        assert route["response_headers_to_add"][0]["header"]["key"] == "allow"
        off = {k for k, v in route["typed_per_filter_config"].items() if v.get("disabled")}
        assert {EXT_PROC, "envoy.filters.http.ext_authz"} <= off
    # No upgrade is configured: CONNECT is refused, never tunnelled.
    assert "upgrade_configs" not in _hcm()


def test_the_405_and_codec_refusals_are_shaped() -> None:
    mappers = edge.build_local_reply_config(CONFIG)["mappers"]
    rewritten = [m for m in mappers if m.get("status_code") == 405]
    assert rewritten and all("upgrade_failed" in str(m["filter"]) for m in rewritten)
    assert all(m["headers_to_add"][0]["header"]["key"] == "allow" for m in rewritten)
    codes = [str(m.get("body_format_override", "")) for m in mappers]
    codec = next(i for i, c in enumerate(codes) if "invalid_http_request" in c)
    transcoder = next(i for i, c in enumerate(codes) if "invalid_request_body" in c)
    assert codec < transcoder  # a codec error is never called a body parse error


def test_ext_proc_is_off_in_the_chain_and_on_only_on_generation_routes() -> None:
    (ext_proc,) = [f for f in _hcm()["http_filters"] if f["name"] == EXT_PROC]
    assert ext_proc["disabled"] is True
    on = [
        r
        for r in _routes()
        if "overrides" in r.get("typed_per_filter_config", {}).get(EXT_PROC, {})
    ]
    assert {r["match"]["prefix"] for r in on} == {"/v1/audio/", "/v1/", "/internal/events/"}
    assert all(r["route"]["cluster"] == edge.REPLICAS_CLUSTER for r in on)


def test_the_body_limit_counts_every_body_but_audio_uploads() -> None:
    names = [f["name"] for f in _hcm()["http_filters"]]
    assert names.index(BODY_LIMIT) < names.index(EXT_PROC)  # before anything buffers
    (limit,) = [f for f in _hcm()["http_filters"] if f["name"] == BODY_LIMIT]
    assert limit["typed_config"]["max_request_bytes"] == CONFIG.max_request_bytes == 8 * MiB
    off = [r for r in _routes() if r.get("typed_per_filter_config", {}).get(BODY_LIMIT)]
    assert [r["match"]["prefix"] for r in off] == ["/v1/audio/"]
    assert CONFIG.buffer_limit_bytes >= CONFIG.max_audio_request_bytes


def test_paths_and_timeouts() -> None:
    hcm = _hcm()
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST"
    assert hcm["request_headers_timeout"] == f"{CONFIG.request_headers_timeout_s:g}s"
    assert hcm["stream_idle_timeout"] == f"{CONFIG.stream_idle_timeout_s:g}s"
    assert hcm["use_remote_address"] is True


def test_the_xds_listener_and_routes_parse_as_envoy_protos() -> None:
    """The body size limit (newer than the xds-protos wheel) still parses for ADS."""
    resources = edge.build_xds_resources(CONFIG)
    listener = resources[edge.LISTENER_TYPE][0]
    assert "BodySizeLimit" in str(listener)
