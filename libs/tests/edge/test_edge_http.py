"""The edge over raw HTTP: SSE bytes and timing, Envoy's own errors, limits, and trust boundaries.

Everything a client or an attacker can observe on the wire that the `openai` client hides.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.edge import MiB
from inferplane.testing.picker import VERDICT
from inferplane.wire.headers import TENANT

from ._fakes import SLOW_STREAM_GAP_S, STREAM_PIECES
from .conftest import Edge

AUTH = {"authorization": "Bearer good"}


@pytest.fixture(scope="module")
def http(edge: Edge) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        yield client


def chat(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The response is `status` with OpenAI's error body; returns the `error` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    expected_type = "server_error" if status >= 500 else "invalid_request_error"
    assert error["type"] == expected_type
    return dict(error)


def test_sse_bytes_are_openai_framing_and_end_with_done(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        raw = b"".join(response.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == "".join(
        STREAM_PIECES
    )
    assert not any(k.startswith("grpc-") for k in response.headers)


def test_sse_arrives_incrementally(http: httpx.Client) -> None:
    """Chunks the backend spaces in time arrive spaced: nothing buffers the stream."""
    arrivals: list[float] = []
    start = time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json=chat("slow-stream", stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == len(STREAM_PIECES)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(gap > SLOW_STREAM_GAP_S * 0.6 for gap in gaps), gaps
    assert arrivals[0] < SLOW_STREAM_GAP_S * 0.9, arrivals


def test_stream_rewrite_keeps_query_string(edge: Edge, http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions?api-version=2024-10-01", json=chat(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert edge.inference.calls[-1].method == "StreamChatCompletionEvents"


@pytest.mark.parametrize(
    "body",
    [
        chat(metadata={"stream": True}),  # nested key: not the top-level flag
        chat(stream="true"),  # a string is not `true`
        chat(stream=None),
    ],
)
def test_only_a_top_level_true_streams(edge: Edge, http: httpx.Client, body: Any) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert edge.inference.calls[-1].method == "CreateChatCompletion"


def test_unary_success_has_no_grpc_headers(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200
    leaked = [k for k in response.headers if k.startswith(("grpc-", "x-openai-"))]
    assert leaked == []


def test_malformed_json_is_openai_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    error = assert_openai_error(response, 400, "invalid_request_body")
    assert "Unexpected end of string" in error["message"]


def test_wrong_field_type_is_openai_400(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": "oops"})
    assert_openai_error(response, 400, "invalid_request_body")


def test_health_answers_without_a_key(edge: Edge) -> None:
    """`GET /health` (issue 19): 200 and `{"status": "ok"}` with no API key, from the edge
    itself; other methods on it are unknown URLs (behind the key check like any other)."""
    with httpx.Client(base_url=edge.url, timeout=30) as anonymous:
        response = anonymous.get("/health")
        assert response.status_code == 200, response.text
        assert response.json() == {"status": "ok"}
        assert response.headers["content-type"].startswith("application/json")
        assert anonymous.post("/health").status_code == 401
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        assert_openai_error(client.post("/health"), 404, "unknown_url")


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/nope"), ("GET", "/v1/chat/completions"), ("GET", "/"), ("GET", "/metrics")],
)
def test_unknown_path_is_openai_404(http: httpx.Client, method: str, path: str) -> None:
    error = assert_openai_error(http.request(method, path), 404, "unknown_url")
    assert path in error["message"]


@pytest.mark.parametrize(
    "path",
    [
        "/internal/events/v1/chat/completions",
        "/internal/events/v1/completions",
        "/internal/events/v1/chat/completions?x=1",
        "//internal/events/v1/chat/completions",
        "/v1/../internal/events/v1/chat/completions",
        "/%69nternal/events/v1/chat/completions",
    ],
)
def test_internal_paths_are_unreachable(edge: Edge, http: httpx.Client, path: str) -> None:
    """Only the stream router may send a request to `/internal/...`; clients get a 404."""
    before = len(edge.inference.calls)
    response = http.post(path, json=chat(stream=True))
    assert_openai_error(response, 404, "unknown_url")
    assert len(edge.inference.calls) == before


def test_escaped_slash_is_rejected(edge: Edge, http: httpx.Client) -> None:
    before = len(edge.inference.calls)
    response = http.post("/internal%2Fevents/v1/chat/completions", json=chat(stream=True))
    assert 400 <= response.status_code < 500
    assert len(edge.inference.calls) == before


def _big_chat(total_bytes: int) -> bytes:
    shell = json.dumps(chat()).encode()
    filler = "x" * (total_bytes - len(shell) + len('"hi"') - 2)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": filler}]})
    assert len(body) == total_bytes
    return body.encode()


@pytest.mark.parametrize("size", [7 * MiB, 8 * MiB])
def test_large_bodies_up_to_8_mib_are_accepted(edge: Edge, http: httpx.Client, size: int) -> None:
    body = _big_chat(size)
    response = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text[:300]
    # The fake reports the prompt's length as prompt_tokens: the whole body reached it.
    assert response.json()["usage"]["prompt_tokens"] == len(body) - len(json.dumps(chat())) + 2


def test_body_over_limit_is_openai_413(edge: Edge, http: httpx.Client) -> None:
    """Rejected on its content-length, before auth and before any buffering.

    Regression: with the whole oversized body arriving while ext_authz's Check was in flight,
    Envoy 1.40 sometimes hung the request (no 413) until the stream idle timeout.
    """
    before, checks = len(edge.inference.calls), edge.authz.checks
    body = _big_chat(9 * MiB)
    for _ in range(5):
        response = http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 413, "request_too_large")
    assert len(edge.inference.calls) == before
    assert edge.authz.checks == checks


def test_client_cannot_forge_trusted_headers(edge: Edge, http: httpx.Client) -> None:
    """`x-inferplane-*` headers come from the authenticator only (the picker on generation
    routes); the API key never reaches services."""
    spoofed = {TENANT: "evil", "x-inferplane-scopes": "admin"}
    response = http.post("/v1/chat/completions", json=chat(), headers=spoofed)
    assert response.status_code == 200
    metadata = edge.inference.calls[-1].metadata
    assert metadata[TENANT] == VERDICT[TENANT]
    assert "x-inferplane-scopes" not in metadata
    assert "authorization" not in metadata


def test_admin_api_is_routed_to_auth(http: httpx.Client) -> None:
    response = http.get("/v1/admin/api-keys")
    assert response.status_code == 200, response.text
    assert response.json()["api_keys"][0]["name"] == "api-keys/k1"


def test_missing_key_is_401(edge: Edge) -> None:
    response = httpx.get(edge.url + "/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("mode", ["slow", "error"])
def test_authz_failure_is_openai_503_never_open(edge: Edge, http: httpx.Client, mode: str) -> None:
    """On the routes ext_authz guards (here `/v1/models`; generation routes are the
    picker's), an auth outage is a shaped 503, never an open door."""
    before = len(edge.inference.calls)
    edge.authz.mode = mode
    try:
        response = http.get("/v1/models")
    finally:
        edge.authz.mode = "ok"
    assert_openai_error(response, 503, "service_unavailable")
    assert len(edge.inference.calls) == before
    assert http.get("/v1/models").status_code == 200


def test_native_grpc_through_the_edge_is_not_routed(edge: Edge) -> None:
    """The edge serves REST only; gRPC callers use the router directly."""
    before = len(edge.inference.calls)
    with grpc.insecure_channel(f"127.0.0.1:{edge.config.listen_port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.ListModels(pb.ListModelsRequest(), metadata=[("authorization", "Bearer good")])
    assert len(edge.inference.calls) == before


def test_measure_edge_overhead(edge: Edge, http: httpx.Client) -> None:
    """Prints (does not assert) the median added latency of the edge for a unary call.

    Also prints the parts it is made of: the fake authz `Check` alone, and the httpx client's
    own floor (a GET of Envoy's admin `/ready`), since a Python HTTP client costs more per
    request than a Python gRPC one (measured on 2 cores: p50 4.5 ms for an httpx loop against
    1.7 ms for `hey`, one request at a time).
    """
    n = 200
    request = json_format.ParseDict({"request": chat()}, pb.CreateChatCompletionRequest())
    with grpc.insecure_channel(f"127.0.0.1:{edge.backend_port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        direct = _timed(n, lambda: stub.CreateChatCompletion(request))
    check = external_auth_pb2.CheckRequest()
    check.attributes.request.http.headers["authorization"] = "Bearer good"
    with grpc.insecure_channel(f"127.0.0.1:{edge.config.auth_endpoint.port}") as channel:
        authz = external_auth_pb2_grpc.AuthorizationStub(channel)
        authz_times = _timed(n, lambda: authz.Check(check))
    body = json.dumps(chat()).encode()
    headers = {"content-type": "application/json"}
    edge_times = _timed(n, lambda: http.post("/v1/chat/completions", content=body, headers=headers))
    with httpx.Client(base_url=edge.envoy.admin_url) as admin:
        floor = _timed(n, lambda: admin.get("/ready"))
    d, e = statistics.median(direct), statistics.median(edge_times)
    a, f = statistics.median(authz_times), statistics.median(floor)
    print(
        f"\nedge overhead (unary chat, n={n} sequential, medians): direct gRPC {d * 1e3:.2f} ms; "
        f"via Envoy (ext_authz + Lua + json_to_metadata + transcoder) {e * 1e3:.2f} ms; "
        f"added {(e - d) * 1e3:.2f} ms, of which authz Check alone {a * 1e3:.2f} ms and "
        f"httpx client floor {f * 1e3:.2f} ms"
    )


def _timed(n: int, call: Any) -> list[float]:
    for _ in range(10):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times
