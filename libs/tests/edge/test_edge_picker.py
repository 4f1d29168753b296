"""The edge's side of the endpoint picker (ext_proc) against a real Envoy: what the picker
sees, what its answers do, retries down its list, and failing closed when it is away.

The fake picker (`_fakes.FakePicker`) answers as the router's picker does; the router's own
picker is tested in services/router/tests and end to end in tests/e2e.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.runtime import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from inferplane.testing.picker import VERDICT
from inferplane.wire import SUMMARY_KEYS
from inferplane.wire.headers import TENANT

from ._fakes import SUMMARY, FakeInference, free_port, start_grpc_server
from .conftest import Edge, running_edge

AUTH = {"authorization": "Bearer good"}


def chat(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture
def http(edge: Edge) -> Iterator[httpx.Client]:
    targets, refuse = list(edge.picker.targets), edge.picker.refuse
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        yield client
    edge.picker.targets, edge.picker.refuse, edge.picker.hang_s = targets, refuse, 0.0
    edge.picker.authenticate = True


def _h2c(url: str, body: dict[str, Any], key: str = "good") -> tuple[str, bytes]:
    """An HTTP/2 (prior knowledge) POST with curl, which writes the response's headers and
    trailers alike to its header dump: (headers and trailers as text, body)."""
    done = subprocess.run(
        [
            "curl", "-sS", "--http2-prior-knowledge", "-D", "-", "-o", "/dev/stderr",
            "-H", f"authorization: Bearer {key}", "-H", "content-type: application/json",
            "--data-binary", json.dumps(body), url,
        ],
        capture_output=True,
        timeout=30,
        check=True,
    )  # fmt: skip
    return done.stdout.decode().lower(), done.stderr


def test_an_h2_client_never_sees_the_summary_trailers(edge: Edge, http: httpx.Client) -> None:
    """On HTTP/2, where trailers reach a client, the replica's summary trailers still reach
    the picker (after the transcoder now) and are removed there, streamed and unary."""
    url = edge.url + "/v1/chat/completions"
    for body in (chat(stream=True), chat()):
        before = len(edge.picker.picks)
        dump, content = _h2c(url, body)
        assert dump.startswith("http/2 200"), dump
        assert content.endswith(b"data: [DONE]\n\n") if body.get("stream") else content
        assert edge.picker.picks[before].summary == SUMMARY
        assert not any(f"{k}:" in dump for k in SUMMARY_KEYS), dump


def test_a_request_the_picker_did_not_authenticate_never_passes(
    edge: Edge, http: httpx.Client
) -> None:
    """A pick without the picker's authenticated mark (a picker that did not check the key)
    is refused by the guard: 503 picker_unavailable, no replica called."""
    edge.picker.authenticate = False
    calls = len(edge.inference.calls)
    response = http.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "picker_unavailable"
    assert len(edge.inference.calls) == calls


def test_a_bad_key_is_refused_before_the_body_is_read(edge: Edge) -> None:
    """The picker refuses a bad key on the request headers: 401 in OpenAI's shape before any
    filter reads the body, so an unknown field is not a 400 and a large chunked body is not
    waited for; the picker never got a body and no replica was called."""
    calls, picks = len(edge.inference.calls), len(edge.picker.picks)
    bad = {"authorization": "Bearer nope"}
    with httpx.Client(base_url=edge.url, headers=bad, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=chat(temprature=2))
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"

        def chunks() -> Iterator[bytes]:
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(64):
                yield b"x" * 65536
                time.sleep(0.05)  # 3.2 s in all, were it read
            yield b'"}]}'

        started = time.monotonic()
        response = client.post("/v1/chat/completions", content=chunks())
        assert response.status_code == 401, response.text
        assert time.monotonic() - started < 2.0
    assert all(p.body_bytes == 0 for p in edge.picker.picks[picks:])
    assert len(edge.inference.calls) == calls


def test_the_auth_failure_guard_counts_the_pickers_401s(tmp_path: Path) -> None:
    """The picker's 401s pass the auth failure guard's response hook: an address past the
    limit gets its 429 without the picker being asked again."""
    with running_edge(tmp_path, auth_failure_limit=2) as small:
        bad = {"authorization": "Bearer nope"}
        statuses = []
        with httpx.Client(base_url=small.url, headers=bad, timeout=30) as client:
            # The count is per Envoy worker (2 here): at most limit x workers 401s.
            for _ in range(5):
                asked = len(small.picker.picks)
                response = client.post("/v1/chat/completions", json=chat())
                statuses.append(response.status_code)
                if response.status_code == 429:
                    break
        assert statuses[:2] == [401, 401] and statuses[-1] == 429, statuses
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        # Turned away without asking the picker: no request headers reached it (Envoy shows
        # it the local reply's response headers only).
        assert not any(p.headers for p in small.picker.picks[asked:])


def test_picker_sees_the_clients_request_and_the_summary_never_reaches_the_client(
    edge: Edge, http: httpx.Client
) -> None:
    """The picker sees the client's request as it came (REST path with its query, the key,
    the JSON body byte for byte) and reads the replica's summary trailers after the
    transcoder; the client sees none of them (internal topology, usage plumbing)."""
    before = len(edge.picker.picks)
    body = json.dumps(chat(stream=True)).encode()
    with http.stream(
        "POST",
        "/v1/chat/completions?beta=true",
        content=body,
        headers={"content-type": "application/json"},
    ) as response:
        raw = b"".join(response.iter_raw())
        headers = dict(response.headers)
    assert response.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    pick = edge.picker.picks[before]
    assert pick.path == "/v1/chat/completions?beta=true"
    assert pick.headers["authorization"] == "Bearer good"
    assert pick.body_bytes == len(body)
    # The replica got auth's verdict from the picker, never the key.
    metadata = edge.inference.calls[-1].metadata
    assert metadata[TENANT] == VERDICT[TENANT] and "authorization" not in metadata
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
