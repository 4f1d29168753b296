"""The edge's resources as data: shape invariants, xDS protos, and Envoy's own validation."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml
from google.protobuf import descriptor_pb2

import inferplane.edge as edge
import inferplane.edge.__main__ as cli
from inferplane.edge import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    FILTER_ORDER,
    LISTENER_TYPE,
    ROUTE_TYPE,
    EdgeConfig,
    EdgeConfigError,
    Endpoint,
    MiB,
)
from inferplane.runtime.security.pki import LocalCA

CONFIG = EdgeConfig(
    router_endpoints=(Endpoint.parse("127.0.0.1:7001"), Endpoint.parse("127.0.0.1:7003")),
    auth_endpoint=Endpoint.parse("127.0.0.1:7002"),
    listen_port=18080,
    admin_port=19901,
)


def _hcm(config: EdgeConfig = CONFIG) -> dict:
    return edge.build_listener(config)["filter_chains"][0]["filters"][0]["typed_config"]


def _filter(name: str) -> dict:
    (found,) = [f for f in _hcm()["http_filters"] if f["name"] == name]
    return found["typed_config"]


def test_public_api_is_pinned() -> None:
    assert sorted(edge.__all__) == sorted(
        [
            "AUTH_CLUSTER",
            "BOOTSTRAP_TYPE",
            "GlobalTierConfig",
            "REGION_FILTERS",
            "build_global_bootstrap",
            "home_cluster",
            "pinned_cluster",
            "render_global_bootstrap",
            "CLUSTER_TYPE",
            "NODE_FILTER_ORDER",
            "NODE_REPLICAS_CLUSTER",
            "REPLICA_ADDRESS_HEADER",
            "NodeEnvoyConfig",
            "build_node_bootstrap",
            "render_node_bootstrap",
            "DEFAULT_SERVICES",
            "ENDPOINT_TYPE",
            "FILTER_ORDER",
            "LISTENER_NAME",
            "LISTENER_TYPE",
            "METADATA_NAMESPACE",
            "PICKER_FILTERS",
            "PICK_KEY",
            "PICK_NAMESPACE",
            "REPLICAS_CLUSTER",
            "ROUTER_CLUSTER",
            "ROUTE_CONFIG_NAME",
            "ROUTE_TYPE",
            "SERVED_KEY",
            "BodyRoute",
            "EdgeConfig",
            "EdgeConfigError",
            "EdgeError",
            "Endpoint",
            "EnvoyProcess",
            "EnvoyStartError",
            "FieldKind",
            "KnownFields",
            "MiB",
            "Nested",
            "build_ads_bootstrap",
            "build_bootstrap",
            "build_clusters",
            "build_endpoints",
            "build_ext_proc_filter",
            "build_http_connection_manager",
            "build_http_filters",
            "build_listener",
            "build_local_reply_config",
            "build_route_config",
            "build_xds_resources",
            "envoy_binary",
            "known_request_fields",
            "load_descriptor_set",
            "lua_source",
            "prune_descriptor_set",
            "render_ads_bootstrap",
            "render_lua_tables",
            "render_static_bootstrap",
            "template_lua_pattern",
            "to_proto",
            "validate_bootstrap",
        ]
    )


def test_filters_are_in_the_recipe_order() -> None:
    """Error shaper first (sees the transcoded response last), the body size limit (counts a
    body without a length before anything buffers it), then the auth failure guard
    (sees both authenticators' 401s), the authenticators (ext_authz where the picker does not
    run; the picker, authenticating on the headers before anything buffers or reads the body),
    the picker guard right after the picker, then what reads the body, router last."""
    assert FILTER_ORDER == (
        "inferplane.error_shaper",
        "envoy.filters.http.body_size_limit",
        "inferplane.auth_failure_guard",
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.ext_proc",
        "inferplane.picker_guard",
        "envoy.filters.http.json_to_metadata",
        "inferplane.stream_router",
        "inferplane.field_guard",
        "envoy.filters.http.grpc_json_transcoder",
        "envoy.filters.http.router",
    )
    assert tuple(f["name"] for f in _hcm()["http_filters"]) == FILTER_ORDER


def test_transcoder_settings_the_openai_client_needs() -> None:
    transcoder = _filter("envoy.filters.http.grpc_json_transcoder")
    assert transcoder["print_options"] == {
        "preserve_proto_field_names": True,
        "always_print_primitive_fields": True,
    }
    assert transcoder["request_validation_options"] == {"reject_unknown_method": True}
    assert transcoder["convert_grpc_status"] is False
    assert transcoder["services"] == [
        "inferplane.inference.v1.InferenceService",
        "inferplane.auth.v1.ApiKeyService",
        "inferplane.auth.v1.UsageLedgerService",
        "inferplane.inference.v1.ResponsesService",
    ]
    fds = descriptor_pb2.FileDescriptorSet.FromString(
        base64.b64decode(transcoder["proto_descriptor_bin"])
    )
    names = {f.name for f in fds.file}
    assert "inferplane/inference/v1/inference.proto" in names
    assert "google/api/httpbody.proto" in names
    assert "inferplane/nodeagent/v1/nodeagent.proto" not in names  # pruned


def test_ext_authz_fails_closed_with_503() -> None:
    authz = _filter("envoy.filters.http.ext_authz")
    assert authz["failure_mode_allow"] is False
    assert authz["status_on_error"] == {"code": "ServiceUnavailable"}
    assert authz["grpc_service"]["timeout"] == "1s"


def test_routes_disable_timeouts_for_generations() -> None:
    routes = edge.build_route_config(CONFIG)["virtual_hosts"][0]["routes"]
    api = [r for r in routes if r["match"].get("prefix") in ("/v1/", "/internal/events/")]
    assert [r["route"]["timeout"] for r in api] == ["0s", "0s"]
    assert routes[-1]["direct_response"] == {"status": 404}
    assert _hcm()["stream_idle_timeout"] == "900s"


def test_generations_go_to_the_picked_replica_and_retry_before_the_first_byte() -> None:
    """Generation routes go to the replicas cluster (override_host reads the picker's list)
    and retry only on failures that happen before any response byte, with ext_authz off (the
    picker authenticates them); the routes the picker does not decide (admin API,
    /v1/models, stored responses, the 404) have ext_proc and the guard off and ext_authz on:
    every route that needs a key has exactly one authenticator."""
    routes = {
        r["match"].get("prefix") or r["match"]["path"]: r
        for r in edge.build_route_config(CONFIG)["virtual_hosts"][0]["routes"]
        if r.get("direct_response", {}).get("status") != 405  # test_hostile_config.py
    }
    for prefix in ("/v1/", "/internal/events/"):
        route = routes[prefix]
        assert route["route"]["cluster"] == edge.REPLICAS_CLUSTER
        assert route["route"]["retry_policy"] == {
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": 2,
        }
        per_filter = route["typed_per_filter_config"]
        assert set(per_filter) == {"envoy.filters.http.ext_authz", "envoy.filters.http.ext_proc"}
        assert per_filter["envoy.filters.http.ext_authz"]["disabled"] is True
        # ext_proc is off in the chain: the generation routes turn it on.
        ext_proc = per_filter["envoy.filters.http.ext_proc"]
        assert ext_proc["@type"].endswith(".ext_proc.v3.ExtProcPerRoute")
        assert ext_proc == {"@type": ext_proc["@type"], "overrides": {}}
    assert routes["/v1/models"]["route"]["cluster"] == edge.ROUTER_CLUSTER
    for prefix in ("/v1/admin/", "/v1/models", "/v1/responses/", "/"):
        per_filter = routes[prefix]["typed_per_filter_config"]
        assert set(per_filter) == set(edge.PICKER_FILTERS)
        assert all(c["disabled"] is True for c in per_filter.values())
    # /health: Envoy answers it, with no key and no transcoding.
    health = routes["/health"]
    assert health["direct_response"]["status"] == 200
    assert {k for k, c in health["typed_per_filter_config"].items() if c["disabled"]} == {
        *edge.PICKER_FILTERS,
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.grpc_json_transcoder",
    }
    replicas = {c["name"]: c for c in edge.build_clusters(CONFIG)}[edge.REPLICAS_CLUSTER]
    assert "lb_policy" not in replicas
    (policy,) = replicas["load_balancing_policy"]["policies"]
    source = policy["typed_extension_config"]["typed_config"]["override_host_sources"]
    assert source == [{"metadata": {"key": "envoy.lb", "path": [{"key": edge.PICK_KEY}]}}]
    budget = replicas["circuit_breakers"]["thresholds"][0]["retry_budget"]
    assert budget == {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 3}


def test_ext_proc_asks_the_picker_once_and_sees_no_response_body() -> None:
    """The picker gets headers + the whole body (the client's, before anything else reads it)
    and the response headers and trailers, never the response body; a picker crash must not
    reset running streams (failure_mode_allow with the guard after it); only the retry count,
    the trusted headers (auth's verdict, the summary trailers) and the client's key headers
    (removed) may be mutated; the picker's answers land in its own and the pick's namespaces;
    the client cannot pick."""
    ext_proc = _filter("envoy.filters.http.ext_proc")
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == edge.ROUTER_CLUSTER
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SEND",
    }
    assert ext_proc["metadata_options"]["receiving_namespaces"] == {
        "untyped": ["envoy.lb", "inferplane.picker"]
    }
    rule = re.compile(ext_proc["mutation_rules"]["allow_expression"]["regex"])
    for header in (
        "x-envoy-max-retries",
        "x-inferplane-key-id",
        "authorization",
        "x-api-key",
        "x-ratelimit-remaining-tokens",
        "retry-after",
    ):
        assert rule.match(header), header
    for header in (":path", "host", "x-gateway-destination-endpoint", "content-type"):
        assert not rule.match(header), header
    assert ext_proc["message_timeout"] == "1s"
    assert ext_proc["max_message_timeout"] == "180s"
    names = [f["name"] for f in _hcm()["http_filters"]]
    assert names.index("inferplane.picker_guard") == names.index("envoy.filters.http.ext_proc") + 1
    early = _hcm()["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove_on_match": {"key_matcher": {"exact": edge.PICK_KEY}}} in early


def test_buffer_limits_follow_the_largest_body_limit() -> None:
    """Envoy's buffers hold the largest body any route accepts: chat's `max_request_bytes`
    or the audio routes' `max_audio_request_bytes` (each route's own limit is the error
    shaper's, by path)."""
    for chat, audio in ((40 * MiB, 26 * MiB), (8 * MiB, 30 * MiB)):
        config = EdgeConfig(
            router_endpoints=CONFIG.router_endpoints,
            auth_endpoint=CONFIG.auth_endpoint,
            max_request_bytes=chat,
            max_audio_request_bytes=audio,
        )
        largest = max(chat, audio)
        assert edge.build_listener(config)["per_connection_buffer_limit_bytes"] == largest
        assert {c["per_connection_buffer_limit_bytes"] for c in edge.build_clusters(config)} == {
            largest
        }
        shaper = edge.build_http_filters(config)[0]["typed_config"]["default_source_code"]
        source = shaper["inline_string"]
        assert f"MAX_REQUEST_BYTES = {chat}\n" in source
        assert f"MAX_AUDIO_REQUEST_BYTES = {audio}\n" in source


def test_clusters_are_http2_static_or_dns_or_eds() -> None:
    clusters = {c["name"]: c for c in edge.build_clusters(CONFIG)}
    router = clusters[edge.ROUTER_CLUSTER]
    assert router["type"] == "STATIC"
    lb = router["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in lb] == [7001, 7003]
    options = router["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]

    named = EdgeConfig(
        router_endpoints=("router.svc:7001",),
        auth_endpoint="auth.svc:7002",
        replica_endpoints=("replica-0.svc:7010",),
    )
    assert {c["type"] for c in edge.build_clusters(named)} == {"STRICT_DNS"}
    eds = edge.build_clusters(CONFIG, eds=True)
    assert {c["type"] for c in eds} == {"EDS"}
    assert all("load_assignment" not in c for c in eds)


def test_xds_resources_parse_as_envoy_protos() -> None:
    resources = edge.build_xds_resources(CONFIG)
    assert list(resources) == [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE]
    (listener,) = resources[LISTENER_TYPE]
    assert listener.name == edge.LISTENER_NAME
    endpoints = {e.cluster_name: e for e in resources[ENDPOINT_TYPE]}
    assert len(endpoints[edge.ROUTER_CLUSTER].endpoints[0].lb_endpoints) == 2


def _tls_config(tmp_path: Path) -> EdgeConfig:
    leaf = LocalCA.ensure(tmp_path).issue("edge", dns_names=("localhost",))
    return EdgeConfig(
        router_endpoints=CONFIG.router_endpoints,
        auth_endpoint=CONFIG.auth_endpoint,
        listen_port=18080,
        admin_port=19901,
        tls_cert_path=str(leaf.cert_path),
        tls_key_path=str(leaf.key_path),
    )


def test_tls_listener_parses_as_envoy_protos(tmp_path: Path) -> None:
    """With a certificate the listener's only filter chain is TLS 1.2+ with ALPN h2, http/1.1;
    without one it has no transport socket (plain text, as before)."""
    from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2

    config = _tls_config(tmp_path)
    (listener,) = edge.build_xds_resources(config)[LISTENER_TYPE]
    (chain,) = listener.filter_chains
    assert chain.transport_socket.name == "envoy.transport_sockets.tls"
    context = tls_pb2.DownstreamTlsContext()
    assert chain.transport_socket.typed_config.Unpack(context)
    common = context.common_tls_context
    assert common.tls_params.tls_minimum_protocol_version == common_pb2.TlsParameters.TLSv1_2
    assert list(common.alpn_protocols) == ["h2", "http/1.1"]
    assert common.tls_certificates[0].certificate_chain.filename == config.tls_cert_path
    assert common.tls_certificates[0].private_key.filename == config.tls_key_path
    (plain,) = edge.build_xds_resources(CONFIG)[LISTENER_TYPE]
    assert not plain.filter_chains[0].HasField("transport_socket")


def test_envoy_accepts_a_tls_bootstrap(tmp_path: Path) -> None:
    edge.validate_bootstrap(edge.render_static_bootstrap(_tls_config(tmp_path)))


def test_rendered_yaml_and_json_hold_the_same_bootstrap() -> None:
    from_yaml = yaml.safe_load(edge.render_static_bootstrap(CONFIG))
    from_json = json.loads(edge.render_static_bootstrap(CONFIG, fmt="json"))
    assert from_yaml == from_json == edge.build_bootstrap(CONFIG)
    with pytest.raises(ValueError, match="unknown format"):
        edge.render_static_bootstrap(CONFIG, fmt="toml")


def test_envoy_accepts_the_static_bootstrap() -> None:
    edge.validate_bootstrap(edge.render_static_bootstrap(CONFIG))


def test_envoy_accepts_a_bootstrap_with_dns_endpoints() -> None:
    named = EdgeConfig(router_endpoints=("localhost:7001",), auth_endpoint="localhost:7002")
    edge.validate_bootstrap(edge.render_static_bootstrap(named))


def test_envoy_rejection_is_reported() -> None:
    with pytest.raises(EdgeConfigError, match="rejected"):
        edge.validate_bootstrap("static_resources: {listeners: [{name: x, nonsense: 1}]}")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"router_endpoints": ()}, "router_endpoints is empty"),
        ({"listen_port": 0}, "listen_port"),
        ({"listen_port": 9901, "admin_port": 9901}, "both 9901"),
        ({"max_request_bytes": 1000}, "below 64 KiB"),
        ({"authz_timeout_s": 0}, "authz_timeout_s must be positive"),
        ({"tls_cert_path": "/tmp/edge.crt"}, "set together"),
        ({"tls_key_path": "/tmp/edge.key"}, "set together"),
    ],
)
def test_invalid_config_is_rejected(kwargs: dict, message: str) -> None:
    base = {"router_endpoints": ("127.0.0.1:1",), "auth_endpoint": "127.0.0.1:2"}
    with pytest.raises(EdgeConfigError, match=message):
        EdgeConfig(**{**base, **kwargs})


@pytest.mark.parametrize("text", ["nohost", "host:", "host:http", ":80x"])
def test_bad_endpoints_are_rejected(text: str) -> None:
    with pytest.raises(EdgeConfigError):
        Endpoint.parse(text)


def test_endpoint_parsing() -> None:
    assert Endpoint.parse("[::1]:7001") == Endpoint("::1", 7001)
    assert str(Endpoint("::1", 7001)) == "[::1]:7001"
    assert Endpoint.parse("router:7001").is_ip is False


def test_committed_example_bootstrap_is_current(tmp_path: Path) -> None:
    """deploy/envoy/edge.example.yaml is what the builders render (regenerate: see its README)."""
    out = tmp_path / "edge.yaml"
    assert cli.main(["render", *cli.EXAMPLE_ARGS, "-o", str(out)]) == 0
    committed = Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "edge.example.yaml"
    assert committed.read_text("utf-8") == out.read_text("utf-8"), (
        "stale example: python -m inferplane.edge render "
        + " ".join(cli.EXAMPLE_ARGS)
        + " --validate -o deploy/envoy/edge.example.yaml"
    )
