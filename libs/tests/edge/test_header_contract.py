"""The edge spells no header of its own: every name crossing a service boundary comes from
`inferplane.wire.headers` (and the runtime's error trailer keys), in the Python builders and in
the Lua filters, which are templates filled in when the configuration is rendered."""

from __future__ import annotations

import ast
import re
from importlib import resources

import pytest

import inferplane.edge as edge
from inferplane.edge import EdgeConfig, Endpoint, NodeEnvoyConfig, build_node_bootstrap
from inferplane.edge._base import render_lua
from inferplane.runtime import OPENAI_ERROR_CODE_KEY, OPENAI_ERROR_PARAM_KEY, OPENAI_ERROR_TYPE_KEY
from inferplane.wire import headers

CONFIG = EdgeConfig(
    router_endpoints=(Endpoint.parse("127.0.0.1:7001"),),
    auth_endpoint=Endpoint.parse("127.0.0.1:7002"),
    listen_port=18080,
    admin_port=19901,
    telemetry_endpoint=Endpoint.parse("127.0.0.1:7003"),
    telemetry_internal_token="secret",
)
#: What only `inferplane.wire.headers` (or the runtime) may spell.
CONTRACT_SPELLINGS = (
    "x-inferplane-",
    "x-request-id",
    "x-client-request-id",
    "x-gateway-",
    "envoy.lb",
    "x-envoy-max-retries",
    "x-openai-error",
)
LUA_FILES = sorted(
    p.name
    for p in resources.files("inferplane.edge").joinpath("lua").iterdir()
    if p.name.endswith(".lua")
)


def _rendered_lua() -> dict[str, str]:
    """Every Lua filter as Envoy gets it: the edge's chain and the node Envoy's guard."""
    hcm = edge.build_listener(CONFIG)["filter_chains"][0]["filters"][0]["typed_config"]
    node = build_node_bootstrap(NodeEnvoyConfig(listen_port=18000, admin_port=19902))
    node_hcm = node["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = [*hcm["http_filters"], *node_hcm["typed_config"]["http_filters"]]
    return {
        f["name"]: f["typed_config"]["default_source_code"]["inline_string"]
        for f in filters
        if f["name"].startswith("inferplane.")
    }


@pytest.mark.parametrize("name", LUA_FILES)
def test_lua_sources_spell_no_contract_name(name: str) -> None:
    source = edge.lua_source(name.removesuffix(".lua")).lower()
    for spelling in CONTRACT_SPELLINGS:
        assert spelling not in source, f"lua/{name} spells {spelling!r}"


def test_rendered_lua_holds_the_contracts_names() -> None:
    lua = _rendered_lua()
    assert set(lua) == {f"inferplane.{n.removesuffix('.lua')}" for n in LUA_FILES}
    assert f'local NAMESPACE = "{headers.PICK_NAMESPACE}"' in lua["inferplane.picker_guard"]
    assert f'local KEY = "{headers.DESTINATION_ENDPOINT}"' in lua["inferplane.picker_guard"]
    assert f'local HEADER = "{headers.REPLICA_ADDRESS}"' in lua["inferplane.node_guard"]
    shaper = lua["inferplane.error_shaper"]
    for key in (OPENAI_ERROR_TYPE_KEY, OPENAI_ERROR_CODE_KEY, OPENAI_ERROR_PARAM_KEY):
        assert f'"{key}"' in shaper
    assert f'local NAMESPACE = "{edge.METADATA_NAMESPACE}"' in lua["inferplane.stream_router"]
    for name, source in lua.items():
        assert re.search(r"__[A-Z][A-Z0-9_]*__", source) is None, f"{name}: a placeholder is left"


def test_render_lua_refuses_a_missing_or_unused_value() -> None:
    with pytest.raises(KeyError, match="PICK_KEY"):
        render_lua("picker_guard", PICK_NAMESPACE="envoy.lb")
    with pytest.raises(ValueError, match="EXTRA"):
        render_lua("stream_router", METADATA_NAMESPACE="x", EXTRA=1)


def test_the_builders_use_the_contracts_names() -> None:
    hcm = edge.build_listener(CONFIG)["filter_chains"][0]["filters"][0]["typed_config"]
    mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": headers.REQUEST_ID} in mutations
    assert mutations[0]["append"]["header"]["key"] == headers.CLIENT_REQUEST_ID
    matchers = [m["remove_on_match"]["key_matcher"] for m in mutations if "remove_on_match" in m]
    assert matchers == [{"prefix": headers.TRUSTED_PREFIX}, {"exact": headers.DESTINATION_ENDPOINT}]
    (overhead_log,) = [log for log in hcm["access_log"] if log["name"].endswith("http_grpc")]
    matcher = overhead_log["filter"]["metadata_filter"]["matcher"]
    assert matcher["filter"] == headers.PICKER_NAMESPACE
    assert matcher["path"] == [{"key": headers.PICKER_MODEL}]
    metadata = overhead_log["typed_config"]["common_config"]["grpc_service"]["initial_metadata"]
    assert metadata == [{"key": headers.INTERNAL_TOKEN, "value": "secret"}]
    # The edge's exported names are the contract's, not copies.
    assert edge.PICK_NAMESPACE == headers.PICK_NAMESPACE
    assert edge.PICK_KEY == headers.DESTINATION_ENDPOINT
    assert edge.SERVED_KEY == headers.DESTINATION_ENDPOINT_SERVED
    assert edge.REPLICA_ADDRESS_HEADER == headers.REPLICA_ADDRESS


def _string_constants(tree: ast.AST) -> list[str]:
    """Every string literal of `tree` except docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_the_edges_python_spells_no_contract_name() -> None:
    package = resources.files("inferplane.edge")
    for entry in package.iterdir():
        if not entry.name.endswith(".py"):
            continue
        for literal in _string_constants(ast.parse(entry.read_text("utf-8"))):
            for spelling in CONTRACT_SPELLINGS:
                assert spelling not in literal.lower(), f"{entry.name} spells {spelling!r}"
