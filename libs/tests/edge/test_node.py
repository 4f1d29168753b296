"""The node-local Envoy (gateway path) as data: the edge's own filters minus auth and the
picker, the node guard, ORIGINAL_DST on the replica header, mTLS as node-agent, and Envoy's
own validation. Served end to end by tests/integration/test_gateway_path.py."""

from __future__ import annotations

import pytest
import yaml

from inferplane.edge import (
    NODE_FILTER_ORDER,
    NODE_REPLICAS_CLUSTER,
    REPLICA_ADDRESS_HEADER,
    EdgeConfigError,
    NodeEnvoyConfig,
    build_http_filters,
    build_node_bootstrap,
    render_node_bootstrap,
    validate_bootstrap,
)
from inferplane.runtime.security.pki import LocalCA

CONFIG = NodeEnvoyConfig(listen_port=18000, admin_port=19902)


def _hcm(config: NodeEnvoyConfig = CONFIG) -> dict:
    listener = build_node_bootstrap(config)["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_the_filters_are_the_edges_own_less_auth_and_picker_plus_the_node_guard() -> None:
    filters = _hcm()["http_filters"]
    assert [f["name"] for f in filters] == list(NODE_FILTER_ORDER)
    edge = {f["name"]: f for f in build_http_filters(CONFIG.edge())}
    for f in filters:
        if f["name"] != "inferplane.node_guard":
            assert f == edge[f["name"]], f["name"]  # one source for the REST mapping
    names = {f["name"] for f in filters}
    assert not names & {
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.ext_proc",
        "inferplane.picker_guard",
        "inferplane.auth_failure_guard",
    }
    guard = filters[1]["typed_config"]["default_source_code"]["inline_string"]
    assert f'"{REPLICA_ADDRESS_HEADER}"' in guard and "downstreamLocalAddress" in guard
    # Only InferenceService is transcoded (no key admin through a node).
    transcoder = edge["envoy.filters.http.grpc_json_transcoder"]["typed_config"]
    assert transcoder["services"] == ["inferplane.inference.v1.InferenceService"]


def test_the_gateways_headers_are_kept_and_the_guards_421_passes_through() -> None:
    hcm = _hcm()
    assert hcm["use_remote_address"] is False
    assert "early_header_mutation_extensions" not in hcm  # auth's x-inferplane-* stay
    first = hcm["local_reply_config"]["mappers"][0]
    assert "response.code == 421" in str(first) and "body_format_override" not in first


def test_routes_go_to_the_original_dst_cluster_without_retries() -> None:
    routes = _hcm()["route_config"]["virtual_hosts"][0]["routes"]
    to_replica = [r for r in routes if r.get("route", {}).get("cluster") == NODE_REPLICAS_CLUSTER]
    assert [r["match"]["prefix"] for r in to_replica] == ["/v1/", "/internal/events/"]
    assert all("retry_policy" not in r["route"] for r in to_replica)
    assert routes[0]["match"]["path"] == "/health"


def test_the_cluster_reads_the_replica_header_over_mtls_as_node_agent(tmp_path) -> None:
    config = NodeEnvoyConfig(upstream_tls_dir=str(tmp_path))
    (cluster,) = build_node_bootstrap(config)["static_resources"]["clusters"]
    assert cluster["type"] == "ORIGINAL_DST" and cluster["lb_policy"] == "CLUSTER_PROVIDED"
    assert cluster["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": REPLICA_ADDRESS_HEADER,
    }
    context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    chain = context["tls_certificates"][0]["certificate_chain"]["filename"]
    assert chain.endswith("node-agent.crt")
    sans = context["validation_context"]["match_typed_subject_alt_names"]
    assert sans == [{"san_type": "DNS", "matcher": {"exact": "node-agent"}}]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(EdgeConfigError):
        NodeEnvoyConfig(listen_port=0)
    with pytest.raises(EdgeConfigError):
        NodeEnvoyConfig(
            listen_host="127.0.0.1", admin_host="127.0.0.1", listen_port=9, admin_port=9
        )
    with pytest.raises(EdgeConfigError):
        NodeEnvoyConfig(identity="")


def test_envoy_accepts_the_rendered_bootstrap(tmp_path) -> None:
    ca = LocalCA.ensure(tmp_path)
    ca.issue("node-agent", dns_names=("node-agent",))
    text = render_node_bootstrap(NodeEnvoyConfig(upstream_tls_dir=str(tmp_path)))
    assert yaml.safe_load(text)["static_resources"]["listeners"][0]["name"] == "inferplane_node"
    validate_bootstrap(text)


def test_the_cli_renders_the_node_bootstrap(tmp_path, capsys) -> None:
    import inferplane.edge.__main__ as cli

    out = tmp_path / "node.yaml"
    assert cli.main(["render-node", "--listen-port", "18001", "-o", str(out)]) == 0
    listener = yaml.safe_load(out.read_text())["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 18001
    assert cli.main(["render-node", "--listen-port", "0"]) == 1
    assert "listen_port=0" in capsys.readouterr().err


def test_the_node_envoy_builds_on_the_edges_shared_limits() -> None:
    """Circuit breakers, buffer limits, keepalive, HCM hardening and the connection cap are
    the edge's own builders' (`cluster_limits`, `listener`, `hcm_limits`, `connection_cap`),
    not copies: a limit is defined once."""
    from inferplane.edge._bootstrap import connection_cap
    from inferplane.edge._clusters import REPLICA_KEEPALIVE, cluster_limits
    from inferplane.edge._listener import hcm_limits

    config = NodeEnvoyConfig(
        listen_port=18000,
        admin_port=19902,
        max_concurrent_requests=123,
        max_connections=45,
        connect_timeout_s=1.5,
        stream_idle_timeout_s=60.0,
    )
    bootstrap = build_node_bootstrap(config)
    (cluster,) = bootstrap["static_resources"]["clusters"]
    shared = cluster_limits(NODE_REPLICAS_CLUSTER, config.edge(), REPLICA_KEEPALIVE)
    assert {key: cluster[key] for key in shared} == shared
    assert shared["circuit_breakers"]["thresholds"][0]["max_requests"] == 123
    assert shared["connect_timeout"] == "1.5s"
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == config.edge().buffer_limit_bytes
    assert listener["enable_reuse_port"] is False
    hcm = _hcm(config)
    assert {key: hcm[key] for key in hcm_limits(config.edge())} == hcm_limits(config.edge())
    assert hcm["stream_idle_timeout"] == "60s"
    assert bootstrap["overload_manager"] == connection_cap(45)
