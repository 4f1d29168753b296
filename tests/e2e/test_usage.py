"""The usage ledger through the whole stack: a request served by the fixture model becomes one
ledger row (tokens, deployment, replica, TTFT) readable at `GET /v1/admin/usage` with an admin
key; a key with a monthly token budget is refused with OpenAI's `insufficient_quota` once the
budget is spent."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack


def _admin(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.admin_key}"}


def _create_key(stack: Stack, **limits: int) -> tuple[str, str]:
    body = {"tenant": "ledger-e2e", "scopes": ["inference"], "limits": limits}
    answer = httpx.post(
        f"{stack.config.base_url}/admin/api-keys", json=body, headers=_admin(stack), timeout=30
    )
    assert answer.status_code == 200, answer.text
    created = answer.json()
    return created["secret"], created["api_key"]["name"].removeprefix("api-keys/")


def _rows(stack: Stack, key_id: str, want: int) -> list[dict[str, Any]]:
    """The key's ledger rows once `want` of them are there (reports arrive after the response)."""
    deadline = time.monotonic() + 30
    while True:
        answer = httpx.get(
            f"{stack.config.base_url}/admin/usage",
            params={"key_id": key_id},
            headers=_admin(stack),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        rows = answer.json().get("rows", [])
        if len(rows) >= want:
            return list(rows)
        assert time.monotonic() < deadline, f"{len(rows)} of {want} ledger rows arrived"
        time.sleep(0.2)


def _chat(stack: Stack, secret: str) -> Any:
    client = openai.OpenAI(base_url=stack.config.base_url, api_key=secret, max_retries=0)
    request = kimi_tiny.NO_TOOL.request()
    return client.chat.completions.create(
        model=request["model"],
        messages=request["messages"],
        temperature=0,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    )


def test_a_served_request_is_one_ledger_row_at_the_admin_api(stack: Stack) -> None:
    secret, key_id = _create_key(stack)
    answer = _chat(stack, secret)
    (row,) = _rows(stack, key_id, 1)
    assert row["key_id"] == key_id and row["tenant"] == "ledger-e2e"
    assert row["model"] == MODEL_NAME and row["deployment"] == MODEL_NAME
    assert row["replica"].startswith(f"{MODEL_NAME}-") and row["status"] == "completed"
    assert int(row["prompt_tokens"]) == answer.usage.prompt_tokens
    assert int(row["completion_tokens"]) == answer.usage.completion_tokens
    assert 0 < row["ttft_seconds"] <= row["duration_seconds"]
    # Totals per model for the key, and the refusal of a non-admin.
    grouped = httpx.get(
        f"{stack.config.base_url}/admin/usage",
        params={"key_id": key_id, "group_by": "model"},
        headers=_admin(stack),
        timeout=30,
    ).json()
    assert [(g["group"], g["requests"]) for g in grouped["groups"]] == [(MODEL_NAME, "1")]
    refused = httpx.get(
        f"{stack.config.base_url}/admin/usage",
        headers={"authorization": f"Bearer {secret}"},
        timeout=30,
    )
    assert refused.status_code == 403


def test_a_spent_monthly_budget_is_insufficient_quota(stack: Stack) -> None:
    secret, key_id = _create_key(stack, monthly_token_budget=1)
    _chat(stack, secret)  # under budget when it started; its tokens spend the budget
    _rows(stack, key_id, 1)
    with pytest.raises(openai.RateLimitError) as info:
        _chat(stack, secret)
    assert info.value.status_code == 429
    assert info.value.code == "insufficient_quota"
