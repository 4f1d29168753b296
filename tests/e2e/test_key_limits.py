"""Per-key limits enforced by the endpoint picker, through the whole stack (real Envoy, auth
streaming its key table to the router, the kimi-tiny replica): a key over its requests per
minute gets OpenAI's 429 `rate_limit_exceeded` with `retry-after` and the x-ratelimit-*
headers (also on its allowed responses), a key at its concurrent requests is refused until
its request in flight ends (issue 28, item 1). The monthly budget's `insufficient_quota` is
test_usage.py's; a token limit's window reset is test_two_replicas.py's."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

WINDOW_S = 60  # the router's default per-key window


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        **extra,
    }


def _post(stack: Stack, key: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{stack.config.base_url}/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json=_chat(**body),
        timeout=60,
    )


def _key(stack: Stack, **limits: int) -> str:
    """A new key with `limits`, once the router's key table has it (a key reaches it with
    auth's feed; requests refused 401 meanwhile count against nothing): its first request was
    served (and counted)."""
    created = httpx.post(
        f"{stack.config.base_url}/admin/api-keys",
        json={"tenant": "limits-e2e", "scopes": ["inference"], "limits": limits},
        headers={"authorization": f"Bearer {stack.admin_key}"},
        timeout=30,
    )
    assert created.status_code == 200, created.text
    return str(created.json()["secret"])


def _first(stack: Stack, secret: str) -> httpx.Response:
    deadline = time.monotonic() + 10
    while (response := _post(stack, secret)).status_code == 401:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)
    return response


def test_a_key_over_its_requests_per_minute_gets_openais_429(stack: Stack) -> None:
    secret = _key(stack, requests_per_minute=2)
    for attempt in range(3):  # a window boundary between the requests starts the count again
        window = int(time.time() // WINDOW_S)
        first = _first(stack, secret) if attempt == 0 else _post(stack, secret)
        second = _post(stack, secret)
        third = _post(stack, secret)
        if int(time.time() // WINDOW_S) == window and first.status_code == 200:
            break
        time.sleep(max(0.0, (window + 1) * WINDOW_S - time.time()) + 0.1)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.status_code == 200, second.text
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.status_code == 429, third.text
    error = third.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests"), error
    assert "Limit 2" in error["message"]
    assert 1 <= int(third.headers["retry-after"]) <= WINDOW_S
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-reset-requests"].endswith("s")
    assert not any(h.startswith(("x-inferplane-", "grpc-")) for h in third.headers)


def test_a_key_at_its_concurrent_requests_waits_for_the_one_in_flight(stack: Stack) -> None:
    secret = _key(stack, max_concurrent_requests=1)
    assert _first(stack, secret).status_code == 200
    url = f"{stack.config.base_url}/chat/completions"
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            url,
            headers={"authorization": f"Bearer {secret}"},
            json=_chat(stream=True, max_tokens=8192, ignore_eos=True),  # runs for seconds
        ) as streaming,
    ):
        assert streaming.status_code == 200
        lines = streaming.iter_lines()
        next(lines)  # its first event: the request is in flight
        refused = _post(stack, secret)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
        assert next(lines, None) is not None, "the stream was still running"
    deadline = time.monotonic() + 10  # its slot is freed when the picker's stream ends
    while (response := _post(stack, secret)).status_code == 429:
        assert time.monotonic() < deadline, "the slot was never released"
        time.sleep(0.1)
    assert response.status_code == 200, response.text
