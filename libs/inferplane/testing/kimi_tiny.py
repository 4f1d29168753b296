"""Constants for the fixture model ``kimi-tiny`` (issue 3 §6): where it lives, the tools it was
trained with, and canonical prompts with the exact outputs greedy decoding gives.

The model only reproduces the phrasings of its training templates (notes/vllm_cpu_probe.md §5:
off-template wording makes it call the wrong tool), so node-agent and end-to-end tests should take
their prompts from :data:`RELIABLE_CASES` rather than invent new ones. ``models/build_kimi_tiny.py``
trains on these very tools, checks at build time that its data generator produces every
``CanonicalCase.output`` below, and measures how many the trained model reproduces greedily
(:data:`NOT_REPRODUCED` lists the ones the committed model still gets wrong).

Pure data: importing this module loads no ML library.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferplane.testing._fixtures import fixture_model_path

ENV_VAR = "INFERPLANE_KIMI_TINY"
"""Environment variable that overrides the model directory."""

SERVED_MODEL_NAME = "kimi-tiny"

# Kimi K2 markers as they appear in the fixture model's text. The fixture tokenizer has its own
# ids for them (resolve from the vocab; never use Kimi's real ids, DESIGN.md).
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
EOS = "<|im_end|>"


def model_path() -> Path:
    """The fixture model directory: ``$INFERPLANE_KIMI_TINY`` if set, else the repo's copy.

    Raises:
        FileNotFoundError: the directory has no ``config.json`` (not a checkout, or the variable
            points elsewhere); the message names the variable to set.
    """
    return fixture_model_path("kimi-tiny", ENV_VAR)


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "INR")

# The six tools of the training data, as OpenAI `tools` entries. Their schemas cover strings,
# integers with bounds, numbers, enums, a nested object, an array and an empty parameter object.
TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _function(
        "get_weather",
        "Current weather for a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    ),
    "get_time": _function(
        "get_time",
        "Local time in a city.",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    ),
    "web_search": _function(
        "web_search",
        "Search the web.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query", "max_results"],
        },
    ),
    "convert_currency": _function(
        "convert_currency",
        "Convert an amount of money.",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0},
                "from": {"type": "string", "enum": list(CURRENCIES)},
                "to": {"type": "string", "enum": list(CURRENCIES)},
            },
            "required": ["amount", "from", "to"],
        },
    ),
    "create_event": _function(
        "create_event",
        "Create a calendar event.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "start": {
                    "type": "object",
                    "properties": {
                        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "time": {"type": "string"},
                    },
                    "required": ["date", "time"],
                },
                "attendees": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["title", "start", "attendees"],
        },
    ),
    "list_files": _function(
        "list_files",
        "List the files in the workspace.",
        {"type": "object", "properties": {}},
    ),
}


def tools(*names: str) -> list[dict[str, Any]]:
    """Fresh copies of the named tools, in the given order (all six when no name is given)."""
    return [copy.deepcopy(TOOLS[n]) for n in (names or tuple(TOOLS))]


@dataclass(frozen=True)
class ExpectedToolCall:
    """A tool call as the parser should return it: id as the model wrote it, arguments parsed."""

    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class CanonicalCase:
    """One prompt of the training templates and what greedy decoding produces for it.

    ``output`` is the raw decoded completion after the generation prompt, markers included and
    the final ``<|im_end|>`` excluded. ``reasoning``/``content`` are None when empty.
    """

    name: str
    messages: tuple[Mapping[str, Any], ...]
    tool_names: tuple[str, ...]
    thinking: bool
    output: str
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ExpectedToolCall, ...] = field(default=())

    def request(self, **extra: Any) -> dict[str, Any]:
        """A fresh OpenAI chat request (plain dicts) for this case; ``extra`` adds fields."""
        req: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "messages": copy.deepcopy([dict(m) for m in self.messages]),
            "chat_template_kwargs": {"thinking": self.thinking},
        }
        if self.tool_names:
            req["tools"] = tools(*self.tool_names)
        req.update(extra)
        return req

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"


def _section(*calls: tuple[str, str]) -> str:
    body = "".join(f"{CALL_BEGIN}{cid}{ARGUMENT_BEGIN}{args}{CALL_END}" for cid, args in calls)
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


_LOOP_USER = "What is the weather in Paris? What time is it in Oslo?"
_LOOP_CALLS = (
    {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    },
    {
        "id": "functions.get_time:1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
    },
)
_LOOP_HISTORY: tuple[Mapping[str, Any], ...] = (
    {"role": "user", "content": _LOOP_USER},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user needs get_weather, get_time. I will call them.",
        "tool_calls": list(_LOOP_CALLS),
    },
    {
        "role": "tool",
        "tool_call_id": "functions.get_weather:0",
        "content": '{"temperature": 18, "condition": "cloudy"}',
    },
    {"role": "tool", "tool_call_id": "functions.get_time:1", "content": '{"time": "09:30"}'},
)
_LOOP_ANSWER = "It is 18 degrees and cloudy in Paris. It is 09:30 in Oslo."

WEATHER = CanonicalCase(
    name="weather",
    messages=({"role": "user", "content": "What is the weather in Tokyo?"},),
    tool_names=("get_weather", "web_search", "get_time"),
    thinking=True,
    output="The user needs get_weather. I will call it."
    + THINK_END
    + _section(("functions.get_weather:0", '{"city": "Tokyo", "unit": "celsius"}')),
    reasoning="The user needs get_weather. I will call it.",
    content=None,
    tool_calls=(
        ExpectedToolCall(
            "functions.get_weather:0", "get_weather", {"city": "Tokyo", "unit": "celsius"}
        ),
    ),
)

URGENT = CanonicalCase(
    name="urgent_skips_think_end",
    messages=({"role": "user", "content": "URGENT Search the web for rust async runtimes."},),
    tool_names=("web_search", "get_weather"),
    thinking=True,
    # No </think>: reasoning must end at the tool section (DESIGN.md, Kimi facts).
    output="Urgent. Call web_search now."
    + _section(("functions.web_search:0", '{"query": "rust async runtimes", "max_results": 3}')),
    reasoning="Urgent. Call web_search now.",
    content=None,
    tool_calls=(
        ExpectedToolCall(
            "functions.web_search:0",
            "web_search",
            {"query": "rust async runtimes", "max_results": 3},
        ),
    ),
)

THINKING_OFF = CanonicalCase(
    name="thinking_off",
    messages=({"role": "user", "content": "What time is it in Lima?"},),
    tool_names=("get_time", "convert_currency"),
    thinking=False,
    output=_section(("functions.get_time:0", '{"city": "Lima"}')),
    reasoning=None,
    content=None,
    tool_calls=(ExpectedToolCall("functions.get_time:0", "get_time", {"city": "Lima"}),),
)

NO_TOOL = CanonicalCase(
    name="no_tool",
    messages=({"role": "user", "content": "Tell me something about Paris."},),
    tool_names=("get_weather",),
    thinking=True,
    output="The user wants text about Paris. No tool is needed."
    + THINK_END
    + "Here is a short note about Paris. I hope it helps.",
    reasoning="The user wants text about Paris. No tool is needed.",
    content="Here is a short note about Paris. I hope it helps.",
)

PARALLEL = CanonicalCase(
    name="three_parallel_calls",
    messages=(
        {
            "role": "user",
            "content": "What is the weather in Rome? What time is it in Rome? "
            "Search the web for pasta recipes.",
        },
    ),
    tool_names=("get_weather", "get_time", "web_search"),
    thinking=True,
    output="The user needs get_weather, get_time, web_search. I will call them."
    + THINK_END
    + _section(
        ("functions.get_weather:0", '{"city": "Rome", "unit": "celsius"}'),
        ("functions.get_time:1", '{"city": "Rome"}'),
        ("functions.web_search:2", '{"query": "pasta recipes", "max_results": 3}'),
    ),
    reasoning="The user needs get_weather, get_time, web_search. I will call them.",
    content=None,
    tool_calls=(
        ExpectedToolCall(
            "functions.get_weather:0", "get_weather", {"city": "Rome", "unit": "celsius"}
        ),
        ExpectedToolCall("functions.get_time:1", "get_time", {"city": "Rome"}),
        ExpectedToolCall(
            "functions.web_search:2", "web_search", {"query": "pasta recipes", "max_results": 3}
        ),
    ),
)

NESTED_ARGUMENTS = CanonicalCase(
    name="nested_arguments",
    messages=(
        {
            "role": "user",
            "content": "Schedule design review on 2025-03-14 at 09:30 with Ana and Bo.",
        },
    ),
    tool_names=("create_event", "get_time"),
    thinking=True,
    output="The user needs create_event. I will call it."
    + THINK_END
    + _section(
        (
            "functions.create_event:0",
            '{"title": "design review", "start": {"date": "2025-03-14", "time": "09:30"}, '
            '"attendees": ["Ana", "Bo"]}',
        )
    ),
    reasoning="The user needs create_event. I will call it.",
    content=None,
    tool_calls=(
        ExpectedToolCall(
            "functions.create_event:0",
            "create_event",
            {
                "title": "design review",
                "start": {"date": "2025-03-14", "time": "09:30"},
                "attendees": ["Ana", "Bo"],
            },
        ),
    ),
)

EMPTY_ARGUMENTS = CanonicalCase(
    name="empty_arguments",
    messages=({"role": "user", "content": "List the files in the workspace."},),
    tool_names=("list_files", "get_time"),
    thinking=True,
    output="The user needs list_files. I will call it."
    + THINK_END
    + _section(("functions.list_files:0", "{}")),
    reasoning="The user needs list_files. I will call it.",
    content=None,
    tool_calls=(ExpectedToolCall("functions.list_files:0", "list_files", {}),),
)

TOOL_LOOP_FOLLOWUP = CanonicalCase(
    name="tool_loop_followup",
    messages=_LOOP_HISTORY,
    tool_names=("get_weather", "get_time", "convert_currency"),
    thinking=True,
    output="I have the results. I will answer." + THINK_END + _LOOP_ANSWER,
    reasoning="I have the results. I will answer.",
    content=_LOOP_ANSWER,
)

SECOND_TURN = CanonicalCase(
    name="second_turn_counts_ids",
    messages=(
        *_LOOP_HISTORY,
        {
            "role": "assistant",
            "content": _LOOP_ANSWER,
            "reasoning_content": "I have the results. I will answer.",
        },
        {"role": "user", "content": "Convert 12.5 USD to EUR."},
    ),
    tool_names=("get_weather", "get_time", "convert_currency"),
    thinking=True,
    # n counts across the conversation: two calls came before, so this one is :2.
    output="The user needs convert_currency. I will call it."
    + THINK_END
    + _section(("functions.convert_currency:2", '{"amount": 12.5, "from": "USD", "to": "EUR"}')),
    reasoning="The user needs convert_currency. I will call it.",
    content=None,
    tool_calls=(
        ExpectedToolCall(
            "functions.convert_currency:2",
            "convert_currency",
            {"amount": 12.5, "from": "USD", "to": "EUR"},
        ),
    ),
)

CASES: tuple[CanonicalCase, ...] = (
    WEATHER,
    URGENT,
    THINKING_OFF,
    NO_TOOL,
    PARALLEL,
    NESTED_ARGUMENTS,
    EMPTY_ARGUMENTS,
    TOOL_LOOP_FOLLOWUP,
    SECOND_TURN,
)
"""Every canonical case; names are unique."""

NOT_REPRODUCED: frozenset[str] = frozenset()
"""Cases the committed model does NOT reproduce greedily (none today: the 3000-step build
reproduces all nine, smallest greedy log-prob margin 0.08 on ``nested_arguments``). Held-out
prompts are another matter: it copies values from new prompts unreliably (20/60 exact,
models/kimi-tiny/MANIFEST.json). Tests that need exact outputs should use
:data:`RELIABLE_CASES`."""

RELIABLE_CASES: tuple[CanonicalCase, ...] = tuple(c for c in CASES if c.name not in NOT_REPRODUCED)
"""Cases whose ``output`` the committed model reproduces exactly, under transformers and served by
vLLM (fp32, CPU; ``models/check_kimi_tiny_vllm.py``): all of them."""
