"""The Gateway API Inference Extension path, end to end on loopback, everything under mutual
TLS from one test CA:

    openai client → a real Envoy playing the conformant gateway
        (ext_authz → real auth; ext_proc → the router's gateway port, full duplex or buffered,
         server TLS without a client certificate; ORIGINAL_DST on x-gateway-destination-endpoint)
    → the node-local Envoy (inferplane.edge.render_node_bootstrap: transcoder, stream router,
      field guard, error shaper, node guard; ORIGINAL_DST on x-inferplane-replica-address,
      mTLS as node-agent)
    → a replica's InferenceService (the node-agent's real pipeline on the kimi-tiny fixture with
      a scripted engine, the replica process's own caller policy).

Invariants: a chat stream and a non-streamed chat come back right through the official
client; a bad key is refused by the gateway's ext_authz; a subset hint excluding the only
replica is a 503 from the picker; a replica address on another node is refused by the node
Envoy, and a client's own replica header never reaches it (the picker's value wins).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.auth.app import build_components as build_auth
from inferplane.auth.domain import KeySpec
from inferplane.auth.settings import AuthSettings
from inferplane.edge import EnvoyProcess, NodeEnvoyConfig, render_node_bootstrap
from inferplane.edge._clusters import build_upstream_tls
from inferplane.replica.app import INFERENCE_CALLERS
from inferplane.router.app import build_app as build_router
from inferplane.router.settings import RouterSettings
from inferplane.runtime import App, RunningServer, ServicerBinding, ServiceSettings
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.identity import ADMIN, EDGE, NODE_AGENT, ROUTER, PeerPolicy
from inferplane.runtime.security.pki import LocalCA
from inferplane.testing.clock import FakeClock
from inferplane.testing.loop import LoopThread

pytestmark = pytest.mark.timeout(180)

INFERENCE_SERVICE = "inferplane.inference.v1.InferenceService"
ANSWER = "Paris is the capital of France."
MODEL = "kimi-tiny"
EMBED_MODEL = "embed-tiny"
SUBSET_TEST_HEADER = "x-test-subset"
ENGINE_DELAY_S = 0.4  # per increment of 3 tokens: a chat takes ~1.6 s

_T = "type.googleapis.com/envoy."
_HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
# The test's stand-in for a gateway's own subset choice (Envoy Gateway derives it from the
# pool): a request header copied into envoy.lb.subset_hint before ext_proc.
_SUBSET_LUA = f"""
function envoy_on_request(handle)
  local subset = handle:headers():get("{SUBSET_TEST_HEADER}")
  if subset ~= nil then
    handle:streamInfo():dynamicMetadata():set(
      "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
  end
end
"""


@contextlib.contextmanager
def serving(app: App, settings: ServiceSettings) -> Iterator[tuple[RunningServer, LoopThread]]:
    loop = LoopThread()
    try:

        async def start() -> RunningServer:
            server = RunningServer(app, settings)
            await server.start()
            return server

        server = loop.run(start())
        try:
            yield server, loop
        finally:
            loop.run(server.stop())
    finally:
        loop.close()


def _replica_app() -> App:
    """A replica process's InferenceService: the node-agent's pipeline over kimi-tiny with a
    scripted engine, behind the replica process's own caller policy."""
    from inferplane.replica.pipeline import ModelAssetsCache
    from inferplane.replica.testing.node import FakeNode
    from inferplane.replica.testing.pipeline import (
        FakeReplica,
        ScriptedEngine,
        TickingClock,
        embed_tiny_assets,
        embed_tiny_spec,
        kimi_tiny_assets,
        kimi_tiny_ids,
        kimi_tiny_spec,
        script,
    )

    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    assets.put(embed_tiny_assets(), None)
    # Slow enough that a second request queued behind the first (cap 1) waits longer than
    # the gateway's 1 s ext_proc message timeout.
    engine = ScriptedEngine(
        script(kimi_tiny_ids("</think>" + ANSWER + "<|im_end|>"), per_increment=3),
        delay=ENGINE_DELAY_S,
    )
    replicas = [
        FakeReplica("chat-1", kimi_tiny_spec(), engine),
        FakeReplica("embed-1", embed_tiny_spec(), ScriptedEngine([], embedding_size=16)),
    ]
    servicer = FakeNode(replicas, assets, clock=TickingClock())
    return App(
        component="replica",
        registry=CollectorRegistry(),
        peer_policy=PeerPolicy({f"/{INFERENCE_SERVICE}/": list(INFERENCE_CALLERS)}),
        servicers=[
            ServicerBinding(
                INFERENCE_SERVICE,
                servicer,
                inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            )
        ],
    )


# How the gateway's ext_proc sends the body: full duplex (what the protocol requires pickers
# to support, Envoy Gateway's choice) or buffered (the edge's).
PROCESSING_MODES: dict[str, dict[str, str]] = {
    "full-duplex": {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    },
    "buffered": {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SEND",
    },
}


def _gateway_bootstrap(
    tls: Path, port: int, admin_port: int, auth_port: int, picker_port: int, mode: str
) -> str:
    """A conformant gateway's Envoy as Envoy Gateway configures one for an InferencePool:
    ext_authz (here towards inferplane's auth, presenting the edge identity auth admits),
    ext_proc to the endpoint picker (`PROCESSING_MODES[mode]`) with the envoy.lb namespaces,
    and an ORIGINAL_DST cluster on the picker's x-gateway-destination-endpoint header."""
    lua = _T + "extensions.filters.http.lua.v3.Lua"
    filters = [
        {
            "name": "subset",
            "typed_config": {"@type": lua, "default_source_code": {"inline_string": _SUBSET_LUA}},
        },
        {
            "name": "envoy.filters.http.ext_authz",
            "typed_config": {
                "@type": _T + "extensions.filters.http.ext_authz.v3.ExtAuthz",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "auth"}, "timeout": "5s"},
                "failure_mode_allow": False,
            },
        },
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
                "failure_mode_allow": False,
                # As the edge's; the picker extends it while a request queues.
                "message_timeout": "1s",
                "max_message_timeout": "10s",
                "processing_mode": PROCESSING_MODES[mode],
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
        },
    ]
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}
                    ],
                }
            ]
        },
        "http_filters": filters,
    }

    def static(name: str, port_value: int) -> dict[str, Any]:
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "2s",
            "typed_extension_protocol_options": _HTTP2,
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": port_value,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }

    auth = static("auth", auth_port)
    auth["transport_socket"] = build_upstream_tls(str(tls), EDGE)
    picker = static("picker", picker_port)
    # No client certificate (endpointPickerRef has no field for one): server TLS only.
    picker["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _T + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "validation_context": {"trusted_ca": {"filename": str(tls / "ca.crt")}},
            },
        },
    }
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    }
    bootstrap = {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [auth, picker, pool],
        },
    }
    return yaml.safe_dump(bootstrap, sort_keys=False)


class Path_:
    """The running path: the gateway's URL, the node Envoy's, the replica's address, a key."""

    def __init__(self, gateway: str, node: str, replica: str, key: str) -> None:
        self.gateway, self.node, self.replica, self.key = gateway, node, replica, key

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway}/v1", api_key=key or self.key, max_retries=0, timeout=60
        )


@pytest.fixture(scope="module", params=sorted(PROCESSING_MODES))
def gateway_path(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path_]:
    tmp = tmp_path_factory.mktemp("gateway")
    tls = tmp / "tls"
    ca = LocalCA.ensure(tls)
    for name in ("auth", ROUTER, NODE_AGENT, EDGE, ADMIN):
        ca.issue(name, dns_names=(name,), ip_addresses=("127.0.0.1",))
    node_port, gateway_port, picker_port = free_port(), free_port(), free_port()
    with contextlib.ExitStack() as stack:
        auth_settings = AuthSettings(
            host="127.0.0.1", port=0, data_dir=tmp / "auth", grace_period_seconds=0.2, tls_dir=tls
        )
        components = build_auth(auth_settings, clock=FakeClock())
        auth_server, auth_loop = stack.enter_context(serving(components.app(), auth_settings))
        _, secret = auth_loop.run(
            components.manager.create(
                KeySpec(display_name="gateway", tenant="t1", scopes=("inference",)), actor="test"
            )
        )
        replica_settings = ServiceSettings(
            host="127.0.0.1", port=0, grace_period_seconds=0.2, tls_dir=tls, identity=NODE_AGENT
        )
        replica_server, _ = stack.enter_context(serving(_replica_app(), replica_settings))
        replica = f"127.0.0.1:{replica_server.port}"
        routes = tmp / "routes.yaml"
        routes.write_text(
            yaml.safe_dump(
                {
                    "models": [
                        {
                            "model": MODEL,
                            "endpoints": [
                                {"address": replica, "replica_id": "chat-1", "max_concurrency": 1}
                            ],
                        },
                        {
                            "model": EMBED_MODEL,
                            "endpoints": [{"address": replica, "replica_id": "embed-1"}],
                        },
                    ]
                }
            )
        )
        router_settings = RouterSettings(
            host="127.0.0.1",
            port=0,
            routes_file=str(routes),
            grace_period_seconds=0.2,
            tls_dir=tls,
            gateway_port=picker_port,
            gateway_node_port=node_port,
            outcome_wait_seconds=0.5,
        )
        stack.enter_context(serving(build_router(router_settings), router_settings))
        node_admin = free_port()
        node = EnvoyProcess(
            render_node_bootstrap(
                NodeEnvoyConfig(
                    listen_host="127.0.0.1",
                    listen_port=node_port,
                    admin_port=node_admin,
                    upstream_tls_dir=str(tls),
                )
            ),
            data_dir=tmp / "node-envoy",
            admin_url=f"http://127.0.0.1:{node_admin}",
            concurrency=1,
        )
        stack.enter_context(node)
        gateway_admin = free_port()
        gateway = EnvoyProcess(
            _gateway_bootstrap(
                tls, gateway_port, gateway_admin, auth_server.port, picker_port, request.param
            ),
            data_dir=tmp / "gateway-envoy",
            admin_url=f"http://127.0.0.1:{gateway_admin}",
            concurrency=1,
        )
        stack.enter_context(gateway)
        yield Path_(
            f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{node_port}", replica, secret
        )


MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_non_streamed_chat_comes_back_through_the_gateway(gateway_path: Path_) -> None:
    """Also: a client's own x-inferplane-replica-address (naming another node) is overwritten
    by the picker's, so it cannot steer or break the request."""
    completion = gateway_path.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_headers={"x-inferplane-replica-address": "127.0.0.2:1"},
    )
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens > 0


def test_a_chat_stream_comes_back_through_the_gateway(gateway_path: Path_) -> None:
    stream = gateway_path.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert text == ANSWER and finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_a_bad_key_is_refused_by_the_gateways_ext_authz(gateway_path: Path_) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        gateway_path.client("sk-not-a-key").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.status_code == 401


def test_a_subset_hint_without_the_replicas_node_is_a_503_from_the_picker(
    gateway_path: Path_,
) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        gateway_path.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={SUBSET_TEST_HEADER: "127.0.0.9:8000"}
        )
    assert caught.value.status_code == 503
    body = caught.value.body
    assert isinstance(body, dict) and body.get("code") == "no_ready_replica", body
    # The hint naming the replica's node Envoy is served.
    node = gateway_path.node.removeprefix("http://")
    completion = gateway_path.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_headers={SUBSET_TEST_HEADER: node}
    )
    assert completion.choices[0].message.content == ANSWER


@pytest.mark.parametrize("target", ["another-node", "missing", "itself"])
def test_the_node_envoy_refuses_a_replica_that_is_not_on_its_node(
    gateway_path: Path_, target: str
) -> None:
    port = gateway_path.replica.rpartition(":")[2]
    headers = {
        "another-node": {"x-inferplane-replica-address": f"127.0.0.2:{port}"},
        "missing": {},
        "itself": {"x-inferplane-replica-address": gateway_path.node.removeprefix("http://")},
    }[target]
    body = {"model": MODEL, "messages": MESSAGES}
    response = httpx.post(
        f"{gateway_path.node}/v1/chat/completions", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 421, response.text
    assert response.json()["error"]["code"] == "misdirected_request"


def test_the_node_envoy_serves_a_replica_on_its_node_with_the_edges_mapping(
    gateway_path: Path_,
) -> None:
    """Straight to the node Envoy with the picker's header: the edge's REST mapping (stream
    router → SSE with [DONE]; field guard → 400 naming an unknown key)."""
    url = f"{gateway_path.node}/v1/chat/completions"
    headers = {"x-inferplane-replica-address": gateway_path.replica}
    with httpx.stream(
        "POST",
        url,
        json={"model": MODEL, "messages": MESSAGES, "stream": True},
        headers=headers,
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in (json.loads(e[6:]) for e in events[:-1])
        if c.get("choices")
    )
    assert text == ANSWER
    bad = httpx.post(
        url, json={"model": MODEL, "messages": MESSAGES, "bogus": 1}, headers=headers, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"


def test_a_request_queued_behind_the_cap_waits_past_the_gateways_message_timeout(
    gateway_path: Path_,
) -> None:
    """Cap 1: the second of two concurrent requests waits in the picker's admission queue
    longer than the gateway's 1 s ext_proc message timeout, and the picker sends its
    `override_message_timeout` while it does (after 0.25 s); in FULL_DUPLEX_STREAMED Envoy
    accepts that message and the request is served after the first. (Measured: with the
    extension held back past 1 s the request is served too, so in this mode Envoy 1.40 does
    not time the held headers out; what this pins is that the extension does no harm.)"""

    def one() -> tuple[str, float]:
        started = time.monotonic()
        completion = gateway_path.client().chat.completions.create(model=MODEL, messages=MESSAGES)
        return completion.choices[0].message.content or "", time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: one(), range(2)))
    assert [text for text, _ in results] == [ANSWER, ANSWER]
    slower = max(seconds for _, seconds in results)
    # Its own ~1.6 s after ~1.6 s in the queue.
    assert slower > 2.8, f"the second request did not queue past 1 s ({slower:.2f} s)"


def test_embeddings_come_back_through_the_gateway(gateway_path: Path_) -> None:
    """`POST /v1/embeddings`: decided by load in gateway mode, transcoded by the node Envoy."""
    result = gateway_path.client().embeddings.create(model=EMBED_MODEL, input=["hi", "there"])
    assert [len(item.embedding) for item in result.data] == [16, 16]
    assert result.usage.prompt_tokens > 0
