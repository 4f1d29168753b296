"""Anthropic's Messages API through a real Envoy (fake auth, picker and replica): the routes
reach CreateMessage / CountMessageTokens, successes pass untouched, and every refusal on
/v1/messages* (auth's denial, the field guard, the transcoder, the picker, a servicer's gRPC
error, Envoy's own replies) leaves in Anthropic's error shape, with 529 where OpenAI's says 503;
the OpenAI paths keep OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferplane.runtime import (
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)

from .conftest import Edge

AUTH = {"authorization": "Bearer good"}


def messages(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


@pytest.fixture
def http(edge: Edge) -> Iterator[httpx.Client]:
    targets, refuse = list(edge.picker.targets), edge.picker.refuse
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        yield client
    edge.picker.targets, edge.picker.refuse = targets, refuse


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """Asserts Anthropic's error shape; returns the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    assert not any(k.startswith(("grpc-", "x-openai-")) for k in response.headers)
    return str(body["error"]["message"])


def test_unary_and_streamed_messages_reach_the_replica(edge: Edge, http: httpx.Client) -> None:
    response = http.post("/v1/messages?beta=true", json=messages())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["content"] == [{"type": "text", "text": "fake"}]
    assert edge.inference.calls[-1].method == "CreateMessage"
    streamed = http.post("/v1/messages", json=messages(stream=True))
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.startswith("event: message_start\ndata: ")
    assert streamed.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    counted = http.post("/v1/messages/count_tokens", json=messages())
    assert counted.json() == {"input_tokens": 42}


def test_a_bad_key_is_authentication_error(edge: Edge) -> None:
    response = httpx.post(
        edge.url + "/v1/messages", json=messages(), headers={"x-api-key": "nope"}, timeout=30
    )
    assert "API key" in anthropic_error(response, 401, "authentication_error")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (messages(temprature=0.2), "temprature"),
        (
            messages(thinking={"type": "enabled", "budget_tokens": 1024, "depth": 3}),
            "thinking.depth",
        ),
        (messages(messages=[{"role": "user", "content": "hi", "name": "x"}]), "messages[0].name"),
    ],
)
def test_an_unknown_field_is_invalid_request_error_naming_it(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    message = anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert message == f"Unrecognized request argument supplied: {param}"


def test_malformed_json_is_invalid_request_error(http: httpx.Client) -> None:
    response = http.post(
        "/v1/messages",
        content=b'{"model": "tiny", "max_tokens": ',
        headers={"content-type": "application/json"},
    )
    assert "parse" in anthropic_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (
            NotFoundError("The model `x` does not exist.", code="model_not_found"),
            404,
            "not_found_error",
        ),
        (PermissionDeniedError("not allowed", code="model_not_allowed"), 403, "permission_error"),
        (
            ResourceExhaustedError("queue full", retry_after_seconds=3, code="rate_limit_exceeded"),
            429,
            "rate_limit_error",
        ),
        (UnavailableError("no replica is ready", code="no_ready_replica"), 529, "overloaded_error"),
    ],
)
def test_picker_refusals_are_anthropic_errors(
    edge: Edge, http: httpx.Client, error: Any, status: int, kind: str
) -> None:
    edge.picker.refuse = error
    for body in (messages(), messages(stream=True)):
        response = http.post("/v1/messages", json=body)
        assert anthropic_error(response, status, kind) == error.message
        if status == 429:
            assert response.headers["retry-after"] == "3"


@pytest.mark.parametrize(
    ("model", "status", "kind"),
    [
        ("missing", 404, "not_found_error"),
        ("bad-param", 400, "invalid_request_error"),
        ("busy", 429, "rate_limit_error"),
        ("internal", 500, "api_error"),
        ("crash", 500, "api_error"),
        ("down", 529, "overloaded_error"),
    ],
)
def test_replica_errors_are_anthropic_errors(
    http: httpx.Client, model: str, status: int, kind: str
) -> None:
    message = anthropic_error(http.post("/v1/messages", json=messages(model)), status, kind)
    assert "servicer.py" not in message  # a crash's internals never leak


def test_a_body_over_the_limit_is_request_too_large(edge: Edge, http: httpx.Client) -> None:
    big = messages(system="x" * (edge.config.max_request_bytes + 10))
    response = http.post("/v1/messages", json=big)
    assert str(edge.config.max_request_bytes) in anthropic_error(response, 413, "request_too_large")


def test_openai_paths_keep_openais_shape(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"model": "missing", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    # A path that only starts with the same letters is not Anthropic's.
    other = http.post("/v1/messagesx", json=messages())
    assert other.status_code == 404 and other.json()["error"]["code"] == "unknown_url"


def test_no_pick_is_anthropics_529(edge: Edge, http: httpx.Client) -> None:
    """The picker guard (a request the picker gave no endpoint) and a picker too slow to
    answer (ext_proc's message timeout, a local-reply mapper) are 529 overloaded_error."""
    calls = len(edge.inference.calls)
    edge.picker.targets = []
    guarded = http.post("/v1/messages", json=messages())
    assert "picker" in anthropic_error(guarded, 529, "overloaded_error")
    assert guarded.headers["retry-after"] == "1"
    edge.picker.targets = [f"127.0.0.1:{edge.backend_port}"]
    edge.picker.hang_s = edge.config.picker_timeout_s + 0.5
    try:
        slow = http.post("/v1/messages", json=messages())
    finally:
        edge.picker.hang_s = 0.0
    assert "picker" in anthropic_error(slow, 529, "overloaded_error")
    assert len(edge.inference.calls) == calls
