"""Real coding agents complete turns through inferplane (issue 27, section 7).

Its own stack (module scope): kimi-tiny with the stack's default context (131,072 tokens, which
holds each agent's first prompt of 15-45k fixture tokens). Each pinned agent
(`tests/agents/`, `inferplane.testing.agents`) runs one non-interactive turn, configured only as
its documentation says for a custom endpoint, in a throw-away directory with its own HOME, and
with every host but the loopback behind an unreachable proxy (so nothing but the edge can serve
it): Codex CLI (`codex exec`, OpenAI Responses) and OpenCode (`opencode run`, chat
completions) and Claude Code (`claude -p`, Anthropic Messages). Each is given the
`get_weather` tool (the MCP server `inferplane.testing.weather_mcp`) and asked kimi-tiny's
trained weather question.

The stack is configured as `inferplane up` configures its kimi-tiny: the deployment profile's
sampling defaults `UP_SAMPLING_DEFAULTS` (`repetition_penalty` 1.3; vLLM's
`--override-generation-config`), which a request that omits a parameter gets. The agents send
no penalty (Claude Code no temperature either), and at the neutral defaults the fixture, far
outside its trained prompts, loops ("chess chess ...") until Claude Code's 32,000-token
maximum; with the penalty its reply ends after some hundreds to a few thousand tokens
(docs/agents.md). The e2e session stack sets none, so every other test samples as before.

A turn must end within `TURN_SECONDS` (the first request prefills the whole agent prompt:
docs/agents.md has the times measured) with exit status 0 and the agent's own report (its JSON
output) of a completed turn with output tokens (and, for Codex and OpenCode, text: Claude
Code's `result` is the answer's text only, and the fixture's answer is often all reasoning,
which Claude Code asks to be omitted): the fixture model, far outside its trained phrasings,
answers with well-formed gibberish reasoning, which each agent accepts as the turn's answer.
It does not call `get_weather` in an agent's prompt; a call it did make must reach the tool.
The tool round trip's requests (the agent's second request, with the tool result) are replayed
in the default suite (`test_agent_requests.py`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferplane.localstack import MODEL_NAME, UP_SAMPLING_DEFAULTS, Stack, running_stack
from inferplane.testing import agents

from .conftest import local_config

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(1200)]

PROMPT = "What is the weather in Tokyo?"
# one turn: up to 76 s for Codex, 168 s for OpenCode, 103 s for Claude Code (docs/agents.md)
TURN_SECONDS = 300


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[agents.Endpoint]:
    for agent in agents.AGENTS:
        agents.binary(agent)  # fails at once, saying how to install, when they are missing
    # kimi-tiny's sampling defaults as `inferplane up` sets them (module doc).
    config = local_config(
        tmp_path_factory.mktemp("agents-stack"), sampling_defaults=UP_SAMPLING_DEFAULTS
    )
    with running_stack(config, print) as stack:
        yield _endpoint(stack)


def _endpoint(stack: Stack) -> agents.Endpoint:
    root = stack.config.base_url.removesuffix("/v1")
    return agents.Endpoint(root, stack.create_api_key("agents"), MODEL_NAME)


@pytest.mark.parametrize("agent", [agents.CODEX, agents.OPENCODE, agents.CLAUDE_CODE])
def test_agent_completes_a_turn(agent: str, endpoint: agents.Endpoint, tmp_path: Path) -> None:
    run = agents.invocation(agent, endpoint, tmp_path, PROMPT, weather=True)
    done = run.run(TURN_SECONDS)
    turn = done.turn()
    calls = run.tool_calls()
    print(f"{agent}: {done.seconds:.1f} s, {turn.output_tokens} output tokens, get_weather {calls}")
    assert done.returncode == 0, done.summary()
    assert turn.completed, f"{turn.error}\n{done.summary()}"
    assert turn.output_tokens > 0, done.summary()
    assert turn.text.strip() or agent == agents.CLAUDE_CODE, done.summary()
    for call in calls:  # a call the model made reached the tool with its arguments
        assert isinstance(call.get("city"), str) and call["city"], call
    shutil.rmtree(tmp_path / "home", ignore_errors=True)
