"""Prefix-stable rendering (issue 27 §8): when a client sends the history back as the API
returned it (assistant content, `reasoning_content`, tool calls with their ids and argument
text, tool results), turn n+1's rendered prompt begins with turn n's prompt ids followed by the
ids the model generated, token for token, so the engine's prefix cache carries an agent loop.

Each turn runs through the replica's real gRPC path (`InferenceServicer`, the fixture's real
tokenizer, chat template and parser) with a scripted engine that records the prompt ids it was
asked to run and replays the model's output (the canonical token ids of the output text and the
end-of-message marker the model ends with). The client side is what an OpenAI client does: the
unary response's message as the edge prints it (`chat_completion_to_dict`) is appended, through
JSON, to the next request.

Where the model's own chat template drops earlier reasoning (Kimi K2's and Qwen3's drop the
reasoning of assistant turns before the last user message), the prefix breaks at the first
such assistant turn; the last tests pin where, so a change of that behaviour is seen."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures import qwen3_tiny as qt
from inferplane.replica.engines.base import SamplingParams
from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache, load_model_assets
from inferplane.replica.server import InferenceServicer
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    TickingClock,
    kimi_tiny_assets,
    kimi_tiny_spec,
    script,
    serve_inference,
)
from inferplane.wire import chat_completion_to_dict, chat_request_from_dict


@dataclass(frozen=True)
class Family:
    """One chat family's fixture: its replica spec, the marker it ends a message with, tools,
    and the model outputs of a scripted tool loop, written in the family's own format."""

    name: str
    spec: nodeagent_pb2.ReplicaSpec
    end_of_message: str
    tools: list[dict[str, Any]]
    # Turn 1 calls get_weather, turn 2 (after its result) calls get_time, turn 3 answers.
    loop: tuple[str, str, str]
    # After a new user message: one more call.
    next_task: str
    results: tuple[str, ...] = field(default=('{"temperature": 18}', '{"time": "09:30"}'))


def _qwen3_spec() -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(
        deployment=qt.SERVED_MODEL_NAME,
        served_model_name=qt.SERVED_MODEL_NAME,
        model_source=str(qt.model_path()),
        max_model_len=qt.MAX_MODEL_LEN,
        reasoning_parser=qt.PARSER,
        tool_parser=qt.PARSER,
        revision="rev-1",
    )


def _kimi_section(call_id: str, arguments: str) -> str:
    call = f"{kt.CALL_BEGIN}{call_id}{kt.ARGUMENT_BEGIN}{arguments}{kt.CALL_END}"
    return f"{kt.SECTION_BEGIN}{call}{kt.SECTION_END}"


def _qwen3_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


KIMI = Family(
    name="kimi_k2",
    spec=kimi_tiny_spec(),
    end_of_message=kt.EOS,
    tools=kt.tools("get_weather", "get_time"),
    loop=(
        "The user needs get_weather. I will call it."
        + kt.THINK_END
        + _kimi_section("functions.get_weather:0", '{"city": "Paris", "unit": "celsius"}'),
        # Compact arguments (the renderer must not re-serialise them), and an id whose number
        # went backwards (the model's own, unique: rendered as written, not renumbered).
        "Now the time." + kt.THINK_END + _kimi_section("functions.get_time:0", '{"city":"Oslo"}'),
        "I have the results. I will answer." + kt.THINK_END + "It is 18 degrees in Paris.",
    ),
    next_task="The user needs get_time. I will call it."
    + kt.THINK_END
    + _kimi_section("functions.get_time:2", '{"city": "Lima"}'),
)
QWEN3 = Family(
    name="qwen3",
    spec=_qwen3_spec(),
    end_of_message="<|im_end|>",
    tools=[dict(t) for t in qt.TOOLS],
    loop=(
        "<think>\nThe user needs the weather.\n</think>\n\n"
        + _qwen3_call("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        # Compact arguments, as a model may write them: sent back verbatim, not through tojson.
        "<think>\nNow the time.\n</think>\n\n" + _qwen3_call("get_time", '{"city":"Oslo"}'),
        "<think>\nI have the results.\n</think>\n\nIt is 18 degrees in Paris.",
    ),
    next_task="<think>\nThe user needs the time.\n</think>\n\n"
    + _qwen3_call("get_time", '{"city": "Lima"}'),
)
FAMILIES = [pytest.param(KIMI, id="kimi_k2"), pytest.param(QWEN3, id="qwen3")]


def _assets(family: Family) -> ModelAssets:
    return kimi_tiny_assets() if family is KIMI else load_model_assets(family.spec)


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    message: dict[str, Any]


def run_session(family: Family, outputs: Sequence[str], users: Sequence[str]) -> list[Turn]:
    """Runs one turn per output through the replica. After a turn with tool calls the client
    answers each call with the next scripted result; after a plain answer it sends the next of
    `users` (the first of which opens the conversation)."""
    assets = _assets(family)
    cache = ModelAssetsCache()
    cache.put(assets, family.name)
    end_id = assets.tokenizer.get_vocab()[family.end_of_message]
    assert end_id in assets.eos_token_ids
    turns: list[Turn] = []

    def generate(params: SamplingParams) -> list[Any]:
        text = outputs[len(turns)]
        ids = [*assets.backend.encode(text, add_special_tokens=False).ids, end_id]
        turns.append(Turn([], ids, {}))
        return script(ids)

    engine = ScriptedEngine(generate)
    servicer = InferenceServicer(
        FakeReplica("r1", family.spec, engine), cache, clock=TickingClock()
    )
    users_left = list(users)
    results = itertools.cycle(family.results)
    messages: list[dict[str, Any]] = [{"role": "user", "content": users_left.pop(0)}]

    async def session() -> None:
        async with serve_inference(servicer) as stub:
            for _ in outputs:
                body = {"model": family.spec.served_model_name, "messages": messages}
                body["tools"] = family.tools
                # What the client sends is JSON: the edge transcodes it to the typed request.
                request = chat_request_from_dict(json.loads(json.dumps(body)))
                response = await stub.CreateChatCompletion(
                    pb.CreateChatCompletionRequest(request=request)
                )
                message = chat_completion_to_dict(response)["choices"][0]["message"]
                message = {k: v for k, v in message.items() if v not in (None, "", [])}
                turns[-1].prompt_ids = engine.requests[-1][1]
                turns[-1].message = message
                messages.append(message)
                if message.get("tool_calls"):
                    for call in message["tool_calls"]:
                        messages.append(
                            {"role": "tool", "tool_call_id": call["id"], "content": next(results)}
                        )
                elif users_left:
                    messages.append({"role": "user", "content": users_left.pop(0)})

    asyncio.run(session())
    return turns


def divergence(before: Turn, after: Turn) -> int | None:
    """None when `after`'s prompt starts with `before`'s prompt and output ids, else the index
    of the first id that differs."""
    expected = before.prompt_ids + before.output_ids
    for i, (a, b) in enumerate(zip(expected, after.prompt_ids, strict=False)):
        if a != b:
            return i
    return None if len(after.prompt_ids) > len(expected) else len(after.prompt_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_loop_prompts_extend_the_previous_prompt_and_output(family: Family) -> None:
    """A 3-turn tool loop (call, tool result, call with compact arguments, tool result,
    answer): every turn's prompt ids begin with the previous prompt's ids and the ids the model
    generated, end-of-message marker included; the loop's reasoning, the call ids (Kimi: one
    numbered out of order) and the argument text come back as the model wrote them."""
    turns = run_session(family, family.loop, ["What is the weather in Paris?"])
    assert [bool(t.message.get("tool_calls")) for t in turns] == [True, True, False]
    assert turns[1].message["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'
    for before, after in itertools.pairwise(turns):
        assert before.message.get("reasoning_content")
        assert divergence(before, after) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_template_drops_earlier_reasoning_at_a_new_user_message(family: Family) -> None:
    """Both templates drop the reasoning of assistant turns before the last user message (the
    models were trained that way; Kimi K2.5 renders `<think></think>`, Qwen3 no think block):
    after the loop's answer and a new user question, the prompt departs from the previous one
    exactly at the first assistant turn of the finished loop, i.e. the cache keeps the system,
    tools and the first user message, and everything after is computed again."""
    turns = run_session(
        family,
        (*family.loop, family.next_task),
        ["What is the weather in Paris?", "What time is it in Lima?"],
    )
    assert divergence(turns[1], turns[2]) is None
    at = divergence(turns[2], turns[3])
    assert at is not None
    # The shared part ends where the first assistant turn's output began: Kimi's generation
    # prompt opened `<think>` and the history now closes it empty (`</think>`, where the model
    # wrote its reasoning); Qwen3's history turn has no `<think>` block at all.
    assert at == len(turns[0].prompt_ids)
