"""What real coding agents send is served: every request body recorded from the pinned agents
(`tests/data/agents/`, recorded by `tests/agents/capture.py`: Claude Code's Messages requests,
Codex CLI's Responses requests, OpenCode's chat completions, each with the agent's own headers)
is replayed through the session stack's edge with a fresh key.

Each must be accepted: a 2xx whose stream starts with no error event. A body longer than the
stack's context may instead be refused for its length only (`context_length_exceeded`, in the
API's own error shape), never for a field, a header or a value. So a change that would refuse
an agent fails here, not in a user's terminal. The stream is closed after its first event (the
request is then cancelled): acceptance is decided before the first token, and the full turns
run in the scenario suite (`test_agents.py`). Chat and Responses streams start before the
prefill; a Messages stream's first event comes after it (~35 s for Claude Code's body with
every tool declared): ~45 s in all for the 11 bodies at low load, plus the session stack.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[1] / "data" / "agents"
RECORDS = sorted(DATA.glob("*/*.json"))
# Anthropic's error shape has no code: the replica's context refusal is worded as OpenAI's.
CONTEXT_WORDING = "maximum context length"


def _is_context_refusal(status: int, body: Any) -> bool:
    if status != 400 or not isinstance(body, dict):
        return False
    error = body.get("error")
    if not isinstance(error, dict):
        return False
    if error.get("code") == "context_length_exceeded":
        return True
    return body.get("type") == "error" and CONTEXT_WORDING in str(error.get("message", ""))


def _first_event(response: httpx.Response) -> list[str]:
    """The lines of the stream's first SSE event (up to its blank line)."""
    lines: list[str] = []
    for line in response.iter_lines():
        if not line and lines:
            break
        if line:
            lines.append(line)
    return lines


def test_records_exist() -> None:
    agents = {path.parent.name for path in RECORDS}
    assert agents == {"claude-code", "codex", "opencode"}, agents
    for path in RECORDS:
        assert json.loads(path.read_text())["body"]["model"] == MODEL_NAME, path


@pytest.mark.parametrize("record_path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_agent_request_is_accepted(stack: Stack, api_key: str, record_path: Path) -> None:
    record = json.loads(record_path.read_text())
    headers = dict(record["headers"])
    if record["auth"] == "x-api-key":
        headers["x-api-key"] = api_key
    else:
        headers["authorization"] = f"Bearer {api_key}"
    url = stack.config.base_url.removesuffix("/v1") + record["path"]
    timeout = httpx.Timeout(300, connect=10)
    with (
        httpx.Client(timeout=timeout) as http,
        http.stream(record["method"], url, json=record["body"], headers=headers) as response,
    ):
        if response.is_success:
            event = _first_event(response)
            assert event, f"{record_path.name}: {response.status_code} with an empty stream"
            assert not any(line.startswith("event: error") for line in event), event
            data = [
                line.removeprefix("data:").strip() for line in event if line.startswith("data:")
            ]
            assert data, event
            first = json.loads(data[0])
            assert "error" not in first and first.get("type") != "error", first
            return
        raw = response.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    assert _is_context_refusal(response.status_code, body), (
        f"{record_path.parent.name}'s {record['path']} refused: {response.status_code} {body}"
    )
