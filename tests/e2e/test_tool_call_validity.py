"""`tool_choice: "auto"` under the deployment option `constrain_tool_choice_auto` (on in the
local stack, as in the catalogue's default), through the edge: tool calls with random schemas
are schema-valid. Prints the measured counts and the wall time."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from inferplane.parsers import ToolCall, validate_tool_calls
from inferplane.testing.tool_schemas import draw, tool_sets, weather_requests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REQUESTS = 200
CONCURRENCY = 8  # below the profile's max_num_seqs (16): the router queues nothing
MAX_TOKENS = 256
# Every free string is at most 16 characters, so none can hold a call or section marker (17 or
# more): the grammar allows one inside a JSON string and the parser ends the arguments there
# (parsers/_constrain.py says why the grammar does not exclude them). The fixture model writes
# them in long strings it cannot end; bench/tool_call_validity.py draws unbounded strings too.
MAX_STRING_LENGTH = 16


def _ask(client: openai.OpenAI, body: dict[str, Any]) -> tuple[str, list[ToolCall]]:
    fields = ("messages", "tools", "tool_choice", "temperature", "max_tokens")
    kwargs: dict[str, Any] = {k: body[k] for k in fields}
    if "parallel_tool_calls" in body:
        kwargs["parallel_tool_calls"] = body["parallel_tool_calls"]
    choice = client.chat.completions.create(
        model=body["model"],
        extra_body={"chat_template_kwargs": body["chat_template_kwargs"]},
        **kwargs,
    ).choices[0]
    calls = [
        ToolCall(c.id, c.function.name, c.function.arguments)
        for c in choice.message.tool_calls or ()
    ]
    return choice.finish_reason, calls


def test_constrained_auto_tool_calls_are_schema_valid(client: openai.OpenAI) -> None:
    """200 weather questions with random tool sets (hypothesis: random names, object schemas of
    integer / number / boolean / string / enum / nested / array properties, random `required`):
    every call the model finished is schema-valid, with no call to an undeclared function, and
    `parallel_tool_calls: false` gets one call at most. A call cut by max_tokens (the last call
    of a `length` response) cannot be complete and is counted apart."""
    started = time.monotonic()
    bodies = weather_requests(
        draw(tool_sets(max_length=MAX_STRING_LENGTH, bounded=True), REQUESTS),
        max_tokens=MAX_TOKENS,
    )
    drawn = time.monotonic() - started
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda b: _ask(client, b), bodies))
    finishes: Counter[str] = Counter()
    complete = cut = valid = with_calls = 0
    invalid: list[str] = []
    for body, (finish, calls) in zip(bodies, answers, strict=True):
        finishes[finish] += 1
        with_calls += bool(calls)
        if body.get("parallel_tool_calls") is False:
            assert len(calls) <= 1, (body["tools"], calls)
        verdicts = validate_tool_calls(calls, body["tools"])
        for i, verdict in enumerate(verdicts):
            if finish == "length" and i == len(calls) - 1:
                cut += 1
                continue
            complete += 1
            valid += verdict.valid
            if not verdict.valid:
                invalid.append(f"{verdict.reason}: {verdict.message} {calls[i]} {body['tools']}")
    wall = time.monotonic() - started
    print(
        f"tool_call_validity_e2e: {REQUESTS} requests, {with_calls} with calls, "
        f"{complete} complete calls ({valid} schema-valid), {cut} cut by max_tokens, "
        f"finish reasons {dict(finishes)}, {wall:.1f} s ({drawn:.1f} s drawing the schemas)"
    )
    assert not invalid, "\n".join(invalid[:5])
    assert complete >= REQUESTS // 5, "too few tool calls to say anything"
