"""The router's prompt tokenization for `precise_prefix` on the fixture models' real
tokenizers: the token ids equal the replica's own (its `plan_chat` / text prompt), the cap,
the chat family read from the vocabulary, and `PromptTokens` (lazy load off the loop, block
size from the engine states, fallbacks)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.kvblocks import chain
from inferplane.replica.pipeline.assets import load_model_assets
from inferplane.replica.pipeline.requests import plan_chat
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.routes import Endpoint, ModelRoute
from inferplane.router.tokenize import PromptTokens, guess_family, load_tokenizer, prompt_ids

MODELS = Path(__file__).resolve().parents[3] / "models"
KIMI = str(MODELS / "kimi-tiny")
QWEN = str(MODELS / "qwen3-tiny")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(**body: Any) -> pb.ChatCompletionRequest:
    body.setdefault("model", "m")
    return json_format.ParseDict(body, pb.ChatCompletionRequest())


AGENT = chat(
    messages=[
        {"role": "system", "content": "You are a careful agent. " * 40},
        {"role": "user", "content": "What is the weather in Paris and in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And Tokyo?"},
    ],
    tools=[WEATHER],
    reasoning_effort="low",
)


def spec(path: str, parser: str) -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(
        model_source=path, served_model_name="m", tool_parser=parser, reasoning_parser=parser
    )


@pytest.mark.parametrize(("path", "parser"), [(KIMI, "kimi_k2"), (QWEN, "qwen3")])
def test_chat_token_ids_are_the_replicas(path: str, parser: str) -> None:
    loaded = load_tokenizer(path)
    assert loaded.family.name == parser  # read from the vocabulary's markers
    assets = load_model_assets(spec(path, parser))
    for request in (
        AGENT,
        chat(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none"),
    ):
        expected = plan_chat(request, assets).prompt.token_ids
        computed = prompt_ids(loaded, request, 1 << 20)
        assert computed is not None
        assert computed == (expected, len(expected))


def test_only_the_first_tokens_are_encoded_and_they_are_the_full_texts() -> None:
    loaded = load_tokenizer(KIMI)
    words = " ".join(f"word{i} and more text" for i in range(3000))  # ~ 60,000 characters
    request = chat(messages=[{"role": "user", "content": words}])
    full = prompt_ids(loaded, request, 1 << 20)
    assert full is not None and full[1] > 10_000
    capped = prompt_ids(loaded, request, 256)
    assert capped is not None
    assert capped[0] == full[0][:256]
    assert capped[1] > 1000  # an estimate of the whole prompt's tokens
    # A text completion: the tokenizer's special tokens unless asked not to; ids as given.
    text = json_format.ParseDict({"model": "m", "prompt": "hello world"}, pb.CompletionRequest())
    ids = loaded.tokenizer.encode("hello world", add_special_tokens=True)
    assert prompt_ids(loaded, text, 64) == (ids, len(ids))
    given = json_format.ParseDict({"model": "m", "prompt": [5, 6, 7]}, pb.CompletionRequest())
    assert prompt_ids(loaded, given, 2) == ([5, 6], 3)
    # A request the renderer refuses gets no ids (the replica answers the 400).
    assert prompt_ids(loaded, chat(messages=[{"role": "wizard", "content": "x"}]), 64) is None


def test_family_guess_falls_back_to_generic() -> None:
    assert guess_family({}).name == "generic"
    assert guess_family({"<tool_call>": 1, "<|tool_calls_section_begin|>": 2}).name == "kimi_k2"


def _route(policy: str = "precise_prefix", tokenizer: str = KIMI) -> ModelRoute:
    return ModelRoute(
        "m",
        (Endpoint("127.0.0.1:1", "r0"),),
        deployment="d",
        routing_policy=policy,
        tokenizer=tokenizer,
    )


def test_prompt_tokens_annotates_once_loaded_with_the_engines_block_size() -> None:
    async def scenario() -> None:
        states = EngineStates(time.monotonic)
        tokens = PromptTokens(states, max_tokens=512)
        features = RequestFeatures(prompt_tokens=7)
        route = _route()
        # No engine state yet: no block size, nothing to hash against.
        assert await tokens.annotate(route, AGENT, features) is features
        states.put(EngineState("r0", block_size=128, kv_events=True))
        assert await tokens.ready(route)
        out = await tokens.annotate(route, AGENT, features)
        ids = prompt_ids(load_tokenizer(KIMI), AGENT, 1 << 20)
        assert ids is not None and len(ids[0]) > 256
        assert out.kv_hashes == tuple(chain(ids[0][:512], 128))
        assert out.kv_block_size == 128 and out.prompt_tokens == len(ids[0])
        assert tokens.tokenized == 1 and tokens.seconds > 0
        # An adapter's route: the same ids, hashed under the adapter's name.
        lora = dataclasses.replace(route, adapter="fr")
        adapted = await tokens.annotate(lora, AGENT, features)
        assert adapted.kv_hashes == tuple(chain(ids[0][:512], 128, adapter="fr"))
        # Another policy, or a route without a tokenizer: never tokenized.
        assert await tokens.annotate(_route("least_load"), AGENT, features) is features
        assert await tokens.annotate(_route(tokenizer=""), AGENT, features) is features
        # The router's default policy counts for a route naming none.
        assert not PromptTokens(states).wants(_route(""))
        assert PromptTokens(states, default_policy="precise_prefix").wants(_route(""))
        tokens.close()

    asyncio.run(scenario())


def test_an_unloadable_tokenizer_is_a_fallback_not_an_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        states = EngineStates(time.monotonic)
        states.put(EngineState("r0", block_size=128, kv_events=True))
        tokens = PromptTokens(states)
        route = _route(tokenizer=str(tmp_path / "missing"))
        assert not await tokens.ready(route)
        features = RequestFeatures()
        assert await tokens.annotate(route, AGENT, features) is features
        assert tokens.skipped == 1
        tokens.close()

    asyncio.run(scenario())
