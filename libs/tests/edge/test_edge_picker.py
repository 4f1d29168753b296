"""The edge's side of the endpoint picker (ext_proc) against a real Envoy: what the picker
sees, what its answers do, retries down its list, and failing closed when it is away.

The fake picker (`_fakes.FakePicker`) answers as the router's picker does; the router's own
picker is tested in services/router/tests and end to end in tests/e2e.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.runtime import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from inferplane.wire import SUMMARY_KEYS

from ._fakes import SUMMARY, FakeInference, free_port, start_grpc_server
from .conftest import Edge

AUTH = {"authorization": "Bearer good"}


def chat(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture
def http(edge: Edge) -> Iterator[httpx.Client]:
    targets, refuse = list(edge.picker.targets), edge.picker.refuse
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        yield client
    edge.picker.targets, edge.picker.refuse, edge.picker.hang_s = targets, refuse, 0.0


def test_picker_sees_the_grpc_request_and_the_summary_never_reaches_the_client(
    edge: Edge, http: httpx.Client
) -> None:
    """The picker sees the transcoded gRPC path and the whole body, and reads the replica's
    summary trailers; the client sees none of them (internal topology, usage plumbing)."""
    before = len(edge.picker.picks)
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        raw = b"".join(response.iter_raw())
        headers = dict(response.headers)
    assert response.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    pick = edge.picker.picks[before]
    assert pick.path == "/inferplane.inference.v1.InferenceService/StreamChatCompletionEvents"
    assert pick.body_bytes > 5  # gRPC frame: 5-byte prefix + the request proto
    assert pick.summary == SUMMARY
    assert pick.grpc_status == "0"
    assert not any(k in headers for k in SUMMARY_KEYS)

    unary = http.post("/v1/chat/completions", json=chat())
    assert unary.status_code == 200
    assert edge.picker.picks[-1].summary == SUMMARY
    assert not any(k in unary.headers for k in SUMMARY_KEYS)


def test_models_are_the_routers_and_skip_the_picker(edge: Edge, http: httpx.Client) -> None:
    """`GET /v1/models` is the router's ListModels RPC: no pick is asked for it."""
    before = len(edge.picker.picks)
    response = http.get("/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "kimi-tiny"
    assert len(edge.picker.picks) == before


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (
            ResourceExhaustedError("Too many requests are queued", retry_after_seconds=3),
            429,
            "rate_limit_exceeded",
        ),
        (
            InvalidArgumentError("bad tools", param="tools", code="invalid_tools"),
            400,
            "invalid_tools",
        ),
        (UnavailableError("no replica is ready", code="no_ready_replica"), 503, "no_ready_replica"),
    ],
)
def test_picker_refusal_is_an_openai_error(
    edge: Edge, http: httpx.Client, error: Any, status: int, code: str
) -> None:
    """A refusal (queue full, bad request, nothing ready) reaches the client as OpenAI's
    error shape with the right status, code, param and Retry-After, streaming or not; no
    replica is called."""
    edge.picker.refuse = error
    calls = len(edge.inference.calls)
    for body in (chat(), chat(stream=True)):
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json"), (
            dict(response.headers),
            response.text,
        )
        got = response.json()["error"]
        assert got["code"] == code
        assert got["message"] == error.message
        assert got["param"] == error.param
        if status == 429:
            assert got["type"] == "rate_limit_error"
            assert response.headers["retry-after"] == "3"
        assert not any(k.startswith(("grpc-", "x-openai-")) for k in response.headers)
    assert len(edge.inference.calls) == calls


def test_picker_too_slow_fails_closed_with_a_shaped_503(edge: Edge, http: httpx.Client) -> None:
    """A picker that does not answer within its message timeout never lets the request
    through unrouted: 503 picker_unavailable, no replica called."""
    edge.picker.hang_s = edge.config.picker_timeout_s + 0.5
    calls = len(edge.inference.calls)
    response = http.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "picker_unavailable"
    assert len(edge.inference.calls) == calls


class _Unavailable(FakeInference):
    """A replica that answers every request UNAVAILABLE before any byte (draining)."""

    def StreamChatCompletionEvents(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("StreamChatCompletionEvents", request, context)
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")


@contextlib.contextmanager
def _edge_with_replicas(
    tmp_path: Any, edge: Edge, extra_replicas: tuple[int, ...]
) -> Iterator[str]:
    """A second Envoy whose replicas cluster also holds `extra_replicas` (ports)."""
    import dataclasses

    from inferplane.edge import Endpoint, EnvoyProcess

    config = dataclasses.replace(
        edge.config,
        replica_endpoints=(
            *(Endpoint("127.0.0.1", p) for p in extra_replicas),
            Endpoint("127.0.0.1", edge.backend_port),
        ),
        listen_port=free_port(),
        admin_port=free_port(),
    )
    envoy = EnvoyProcess.from_config(config, tmp_path, concurrency=1)
    envoy.start()
    try:
        yield f"http://127.0.0.1:{config.listen_port}"
    finally:
        envoy.stop()


def test_retries_walk_down_the_pick_before_the_first_byte(tmp_path: Any, edge: Edge) -> None:
    """A dead primary (connection refused) and a primary that answers UNAVAILABLE before its
    first byte are each retried on the next endpoint of the picker's list, and the client
    sees one clean stream."""
    refusing = _Unavailable()
    server, refusing_port = start_grpc_server(
        (pb_grpc.add_InferenceServiceServicer_to_server, refusing)
    )
    dead_port = free_port()
    try:
        with (
            _edge_with_replicas(tmp_path, edge, (dead_port, refusing_port)) as url,
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as http,
        ):
            for primary in (dead_port, refusing_port):
                edge.picker.targets = [f"127.0.0.1:{primary}", f"127.0.0.1:{edge.backend_port}"]
                served = len(edge.inference.calls)
                with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                    raw = b"".join(r.iter_raw())
                assert r.status_code == 200, raw
                assert raw.endswith(b"data: [DONE]\n\n")
                assert len(edge.inference.calls) == served + 1
            assert len(refusing.calls) == 1
    finally:
        server.stop(grace=None)
        edge.picker.targets = [f"127.0.0.1:{edge.backend_port}"]


def test_no_retry_beyond_the_picks_list(tmp_path: Any, edge: Edge) -> None:
    """With a one-endpoint list whose replica refuses, the request fails (503) instead of
    being sent by the fallback policy to a replica the picker did not choose."""
    refusing = _Unavailable()
    server, refusing_port = start_grpc_server(
        (pb_grpc.add_InferenceServiceServicer_to_server, refusing)
    )
    try:
        with (
            _edge_with_replicas(tmp_path, edge, (refusing_port,)) as url,
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as http,
        ):
            edge.picker.targets = [f"127.0.0.1:{refusing_port}"]
            served = len(edge.inference.calls)
            response = http.post("/v1/chat/completions", json=chat(stream=True))
            assert response.status_code == 503, response.text
            assert len(edge.inference.calls) == served
    finally:
        server.stop(grace=None)
        edge.picker.targets = [f"127.0.0.1:{edge.backend_port}"]


def test_unary_request_reaches_the_replica_as_typed_grpc(edge: Edge, http: httpx.Client) -> None:
    """A non-streamed chat goes to the replica's typed method with the client's fields."""
    response = http.post("/v1/chat/completions", json=chat("tiny", temperature=0.5))
    assert response.status_code == 200
    call = edge.inference.calls[-1]
    assert call.method == "CreateChatCompletion" and call.model == "tiny"
    assert isinstance(pb.ChatCompletionRequest(), pb.ChatCompletionRequest)
