"""Randomised OpenAI `tools`, and `tool_choice: "auto"` requests for the fixture model that
use them, for constrained-decoding tests and benchmarks (hypothesis).

`tool_sets()` draws 1 to `max_tools` function tools with random names and random object
schemas: integer / number / boolean / string properties (some with bounds or a maximum
length), string enums, nested objects and short arrays, each object with a random `required`
list. `draw(strategy, n, seed_value)` returns `n` examples of a strategy outside a test, the
same ones for the same seed (for tests that send them all at once, and for benchmarks).
`weather_requests(tool_sets)` asks the fixture model, trained to call a tool for weather
questions, one such question per tool set.

Needs `hypothesis` (the `dev` extra), unlike the rest of `inferplane.testing`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from inferplane.fixtures import kimi_tiny

JSON = dict[str, Any]

# OpenAI function names: ^[a-zA-Z0-9_-]{1,64}$ (a letter first keeps them readable).
FUNCTION_NAME = r"[A-Za-z][A-Za-z0-9_-]{0,31}"
PROPERTY_NAME = r"[a-z][a-z0-9_]{0,15}"
CITIES = ("Tokyo", "Paris", "Rome", "Oslo", "Lima", "Berlin", "Madrid", "Cairo", "Seoul")

_words = st.from_regex(r"[a-z]{1,8}", fullmatch=True)


@st.composite
def _integer(draw: st.DrawFn) -> JSON:
    schema: JSON = {"type": "integer"}
    if draw(st.booleans()):
        lo = draw(st.integers(-100, 100))
        schema["minimum"] = lo
        if draw(st.booleans()):
            schema["maximum"] = lo + draw(st.integers(0, 1000))
    return schema


@st.composite
def _number(draw: st.DrawFn) -> JSON:
    schema: JSON = {"type": "number"}
    if draw(st.booleans()):
        schema["minimum"] = draw(st.integers(-50, 50))
    return schema


@st.composite
def _string(draw: st.DrawFn, max_length: int, bounded: bool) -> JSON:
    schema: JSON = {"type": "string"}
    if bounded or draw(st.booleans()):
        schema["maxLength"] = draw(st.integers(1, max_length))
    if draw(st.booleans()):
        schema["description"] = " ".join(draw(st.lists(_words, min_size=1, max_size=4)))
    return schema


def _enum() -> st.SearchStrategy[JSON]:
    values = st.lists(_words, min_size=1, max_size=5, unique=True)
    return st.one_of(
        values.map(lambda v: {"type": "string", "enum": v}),
        values.map(lambda v: {"enum": v}),
    )


def leaf_schemas(max_length: int = 40, bounded: bool = False) -> st.SearchStrategy[JSON]:
    """A scalar property: integer, number, boolean, string (`maxLength` up to `max_length`
    for some, for all when `bounded`) or string enum."""
    return st.one_of(
        _integer(), _number(), st.just({"type": "boolean"}), _string(max_length, bounded), _enum()
    )


@st.composite
def _object(
    draw: st.DrawFn, children: st.SearchStrategy[JSON], max_properties: int, min_properties: int
) -> JSON:
    names = draw(
        st.lists(
            st.from_regex(PROPERTY_NAME, fullmatch=True),
            min_size=min_properties,
            max_size=max_properties,
            unique=True,
        )
    )
    properties = {name: draw(children) for name in names}
    schema: JSON = {"type": "object", "properties": properties}
    required = [n for n in names if draw(st.booleans())]
    empty_too = draw(st.booleans())  # `"required": []` as well as no `required`
    if required or empty_too:
        schema["required"] = required
    return schema


def property_schemas(
    depth: int = 2, max_length: int = 40, bounded: bool = False
) -> st.SearchStrategy[JSON]:
    """A property's schema: a leaf, or (while `depth` > 0) a nested object or a short array."""
    leaves = leaf_schemas(max_length, bounded)
    if depth <= 0:
        return leaves
    arrays = st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n},
        leaves,
        st.integers(1, 3),
    )
    nested = _object(property_schemas(depth - 1, max_length, bounded), 3, 0)
    return st.one_of(leaves, leaves, nested, arrays)


def object_schemas(max_length: int = 40, bounded: bool = False) -> st.SearchStrategy[JSON]:
    """An object schema with 1 to 5 properties of `property_schemas` (nested objects and
    arrays included) and a random `required` list: a `response_format` json_schema, or a
    tool's `parameters`."""
    return _object(property_schemas(2, max_length, bounded), 5, 1)


@st.composite
def tool_sets(
    draw: st.DrawFn, max_tools: int = 4, max_length: int = 40, bounded: bool = False
) -> list[JSON]:
    """1 to `max_tools` function tools with unique random names; each `parameters` is an
    object schema with 1 to 5 properties (`max_length`: the largest `maxLength` of a string;
    `bounded`: every free string has one)."""
    names = draw(
        st.lists(
            st.from_regex(FUNCTION_NAME, fullmatch=True),
            min_size=1,
            max_size=max_tools,
            unique_by=str.lower,
        )
    )
    tools = []
    for name in names:
        # At least one property: a tool without parameters (`{}`) leaves nothing to constrain.
        function: JSON = {
            "name": name,
            "parameters": draw(object_schemas(max_length, bounded)),
        }
        if draw(st.booleans()):
            function["description"] = " ".join(draw(st.lists(_words, min_size=1, max_size=6)))
        tools.append({"type": "function", "function": function})
    return tools


def draw(strategy: st.SearchStrategy[Any], n: int, seed_value: int = 0) -> list[Any]:
    """`n` distinct examples of `strategy` (by their JSON), deterministic for `seed_value`:
    the generate phase of hypothesis only (no shrinking, no example database).

    Raises:
        RuntimeError: the strategy gave fewer than `n` distinct examples.
    """
    seen: dict[str, Any] = {}

    @seed(seed_value)
    @settings(
        max_examples=n * 3,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Any) -> None:
        if len(seen) < n:
            seen.setdefault(json.dumps(example, sort_keys=True), example)

    collect()
    if len(seen) < n:
        raise RuntimeError(f"only {len(seen)} distinct examples of {n} asked")
    return list(seen.values())


def weather_requests(tool_sets_: Sequence[Sequence[JSON]], **extra: Any) -> list[JSON]:
    """One OpenAI chat request per tool set, asking the fixture model about the weather in a
    city (it was trained to call a tool for that): `tool_choice: "auto"`, greedy, thinking off
    for every third request and `parallel_tool_calls: false` for every third (another third);
    `extra` adds fields (e.g. `max_tokens`)."""
    out = []
    for i, tools in enumerate(tool_sets_):
        body: JSON = {
            "model": kimi_tiny.SERVED_MODEL_NAME,
            "messages": [
                {"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}
            ],
            "tools": [dict(t) for t in tools],
            "tool_choice": "auto",
            "chat_template_kwargs": {"thinking": i % 3 != 1},
            "temperature": 0,
            **extra,
        }
        if i % 3 == 2:
            body["parallel_tool_calls"] = False
        out.append(body)
    return out
