"""A short scripted agent session through the edge (issue 27 §8; the 100-turn run on every API
is bench/agent_session.py): chat completions on the session stack's kimi-tiny, the history sent
back as the API returned it (reasoning, tool calls, tool results). Every turn is ok (no marker
in content or reasoning, every tool call declared and schema-valid), and every turn's prompt
extends the previous prompt and output: the prefix cache serves all of it, in whole blocks.
Prints each turn's figures."""

from __future__ import annotations

import openai
import pytest

from inferplane.localstack import MODEL_NAME
from inferplane.testing.agent_apis import ChatSession
from inferplane.testing.agent_session import TurnResult, run_session, summarize

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TURNS = 5
CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on CPU when none is set (vllm/platforms/cpu.py): the prefix cache
serves whole blocks of it, so a turn's cached tokens are a multiple of 128."""


def _show(t: TurnResult) -> None:
    a = t.answer
    assert a is not None, t.problems
    print(
        f"turn {t.index + 1}: {len(a.calls)} calls, prompt {a.prompt_tokens}, cached "
        f"{a.cached_tokens} ({t.cached_share:.2f}), template keeps {t.template_reusable}, "
        f"TTFT {a.ttft * 1000:.0f} ms, {'; '.join(t.problems + t.notes) or 'ok'}"
    )


def test_agent_session_turns_are_ok_and_extend_the_cached_prefix(client: openai.OpenAI) -> None:
    """5 chat turns (a weather call and its answer, then the next tasks: a time question, a
    currency conversion): every turn is ok; from turn 2 on, each prompt's cached tokens reach
    what the template keeps of the previous prompt and output (all of it inside a tool loop;
    up to the finished task's first answer after a new user message, where Kimi's template
    drops that task's reasoning), in whole 128-token blocks; the first question was answered
    with a call.

    The cached share itself (goal >= 0.9 from turn 2, bench/agent_session.py's figure) is not
    asserted here: with prompts of 400-600 tokens, one partial 128-token block plus the new
    message is 20-40 % of a prompt, however stable the rendering."""
    turns = run_session(ChatSession(client, MODEL_NAME), turns=TURNS, on_turn=_show)
    summary = summarize("chat", turns, block=CPU_BLOCK_SIZE)
    assert summary.turns_ok == TURNS, [t.problems for t in turns]
    # Turn 1 is a weather question kimi-tiny answers with a call (a canonical case), so at
    # least turn 2 is checked inside a tool loop; later turns are the model's to shape (greedy
    # decoding on a loaded CPU may answer a question with or without a call).
    assert turns[0].answer is not None and turns[0].answer.calls
    assert turns[1].checks_prefix and not turns[1].after_user
    assert summary.prefix_held == summary.prefix_checked, [
        (t.answer.cached_tokens if t.answer else None, t.template_reusable) for t in turns
    ]
