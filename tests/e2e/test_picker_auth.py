"""The endpoint picker authenticates in its first exchange, through the whole stack (real
Envoy, auth streaming its key table to the router, the kimi-tiny replica): a bad key is
refused at the edge in the API's own shape before its body is read, a revoked key stops
working, and a dead picker lets no request through unauthenticated (issue 28, items 1-2).

The dead-picker test stops and restarts the session stack's router: it runs last here and
waits until the stack serves again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

BAD = "ip-not-a-key-of-this-stack-0123456789"


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        **extra,
    }


def _post(stack: Stack, key: str, path: str = "/chat/completions", **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    return httpx.post(f"{stack.config.base_url}{path}", headers=headers, timeout=60, **kwargs)


def test_a_bad_key_is_openais_401(stack: Stack) -> None:
    for body in (_chat(), _chat(stream=True)):
        response = _post(stack, BAD, json=body)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and BAD not in error["message"]
        assert not any(h.startswith(("x-inferplane-", "grpc-")) for h in response.headers)


def test_a_bad_key_on_messages_is_anthropics_authentication_error(stack: Stack) -> None:
    response = httpx.post(
        f"{stack.config.base_url}/messages",
        headers={"x-api-key": BAD, "anthropic-version": "2023-06-01"},
        json={
            "model": MODEL_NAME,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=60,
    )
    assert response.status_code == 401, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_authentication_comes_before_the_body(stack: Stack) -> None:
    """A bad key with an unknown field is a 401, not the field guard's 400; with a large
    chunked body it is refused without the body being waited for."""
    response = _post(stack, BAD, json=_chat(temprature=2))
    assert response.status_code == 401, response.text

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "kimi-tiny", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"x" * 65536
            time.sleep(0.05)  # 3.2 s in all, were the body read
        yield b'"}]}'

    started = time.monotonic()
    response = _post(stack, BAD, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 401, response.text
    assert time.monotonic() - started < 2.5


def test_a_revoked_key_is_refused_at_the_edge(stack: Stack) -> None:
    admin = {"authorization": f"Bearer {stack.admin_key}"}
    created = httpx.post(
        f"{stack.config.base_url}/admin/api-keys",
        json={"tenant": "revoke-e2e", "scopes": ["inference"]},
        headers=admin,
        timeout=30,
    )
    assert created.status_code == 200, created.text
    name, secret = created.json()["api_key"]["name"], created.json()["secret"]
    deadline = time.monotonic() + 10  # a new key reaches the router's table with auth's feed
    while (response := _post(stack, secret, json=_chat())).status_code != 200:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)
    revoked = httpx.post(
        f"{stack.config.base_url}/admin/{name}:revoke", json={}, headers=admin, timeout=30
    )
    assert revoked.status_code == 200, revoked.text
    deadline = time.monotonic() + 5
    while (response := _post(stack, secret, json=_chat())).status_code != 401:
        assert response.status_code == 200, response.text
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.05)
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_dead_picker_lets_nothing_through_then_serves_again(stack: Stack, api_key: str) -> None:
    """The router stopped: every request, with a good key or a bad one, is the edge's shaped
    503 `picker_unavailable` (ext_proc's `failure_mode_allow` lets it past the picker; the
    picker guard does not), never a 200 or a 401; the router back, requests work."""
    router = stack.config.router_names[0]
    stack.processes[router].stop()
    try:
        for key in (api_key, BAD):
            for body in (_chat(), _chat(stream=True)):
                response = _post(stack, key, json=body)
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "picker_unavailable"
    finally:
        stack.processes[router].start()
    deadline = time.monotonic() + 90  # the table of keys and the routes come back by watch
    while (response := _post(stack, api_key, json=_chat())).status_code != 200:
        assert response.status_code in (503, 429), response.text
        assert time.monotonic() < deadline, response.text
        time.sleep(0.5)
    assert _post(stack, BAD, json=_chat()).status_code == 401
