"""The Kimi parser with the request's tools: name resolution, schema coercion, trailing-comma
repair, verbatim ids, dropped calls, and the streamed arguments being split-invariant."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.parsers import ParseResult, ToolSet, build_parser, validate_tool_calls
from inferplane.parsers._arguments import ArgumentsStream

TB, TE = "<think>", "</think>"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
PARSER = build_parser("kimi_k2")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fn(name: str, properties: dict[str, Any] | None = None, required: tuple[str, ...] = ()):
    params: dict[str, Any] = {"type": "object", "properties": properties or {}}
    if required:
        params["required"] = list(required)
    return {"type": "function", "function": {"name": name, "parameters": params}}


S, I, N, B = ({"type": t} for t in ("string", "integer", "number", "boolean"))  # noqa: E741
WEATHER = fn("get_weather", {"city": S, "days": I, "metric": B}, ("city",))
FLIGHT = fn("book_flight", {"origin": S, "destination": S}, ("origin", "destination"))
# SGLang's resolution suite (kimik2 detector tests): Claude-Code-like tools.
CODE_TOOLS = [
    fn("Read", {"file_path": S, "offset": I}, ("file_path",)),
    fn("Write", {"file_path": S, "content": S}, ("file_path", "content")),
    fn("Glob", {"pattern": S, "path": S}, ("pattern",)),
    fn("Grep", {"pattern": S, "path": S, "output_mode": S}, ("pattern",)),
    fn("LS", {"path": S}, ("path",)),
    fn("Ping"),
]


def call(header: str, args: str) -> str:
    return f"{CB}{header}{AB}{args}{CE}"


def section(*calls: str) -> str:
    return SB + "".join(calls) + SE


def streamed(text: str, size: int, **start: Any) -> tuple[ParseResult, Any]:
    s = PARSER.start(**start)
    deltas = [s.feed(text[i : i + size]) for i in range(0, len(text), size)]
    deltas.append(s.finish())
    return PARSER.collect(deltas), s


def parsed(text: str, **start: Any) -> ParseResult:
    """The one-piece result, checked equal to streaming at several chunk sizes."""
    s = PARSER.start(**start)
    s.feed(text)
    s.finish()
    whole = s.result()
    for size in (1, 2, 3, 7, 23):
        result, session = streamed(text, size, **start)
        assert result == whole, size
        assert session.result() == whole
        assert [c.repairs for c in session.result().tool_calls] == [
            c.repairs for c in whole.tool_calls
        ]
    return whole


def calls(result: ParseResult) -> list[tuple[str, str, Any]]:
    return [(c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls]


# -- ids and names ------------------------------------------------------------------------------


def test_ids_are_the_models_own_and_names_drop_prefix_and_counter() -> None:
    out = TE + section(
        call("functions.get_weather:0", '{"city": "Oslo"}'),
        call(" get_weather:7 ", '{"city": "Rome"}'),
        call("functions.get_weather", '{"city": "Nice"}'),
    )
    result = parsed(out, tools=[WEATHER])
    assert calls(result) == [
        ("functions.get_weather:0", "get_weather", {"city": "Oslo"}),
        ("get_weather:7", "get_weather", {"city": "Rome"}),
        ("functions.get_weather:2", "get_weather", {"city": "Nice"}),  # no id written: made
    ]


@pytest.mark.parametrize("header", ["0", "3", "call_3", "toolu_01A09q90qw90lq917835lq9", "x@y"])
def test_an_id_style_header_resolves_to_the_single_declared_tool(header: str) -> None:
    """A single declared tool is the answer whatever the arguments (SGLang's rule); the id is
    what the model wrote."""
    result = parsed(TE + section(call(header, '{"city": "Oslo", "days": "2"}')), tools=[WEATHER])
    assert calls(result) == [(header, "get_weather", {"city": "Oslo", "days": 2})]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"file_path": "a.py"}', "Read"),
        ('{"file_path": "a.py", "offset": "10"}', "Read"),  # coerced for Read, then valid
        ('{"file_path": "a.py", "content": "x"}', "Write"),
        ('{"path": "src"}', "LS"),  # Glob and Grep require "pattern"
        ('{"pattern": "*.py", "output_mode": "files"}', "Grep"),
        ("{}", "Ping"),  # the one tool without required keys
        ('{"pattern": "*.py", "path": "src"}', None),  # Glob or Grep: ambiguous
        ('{"pattern": "*.py"}', None),
        ('{"file_path": "a.py", "bogus": 1}', None),  # an undeclared key fits no tool
        ('{"path": 5}', None),  # the wrong type fits no tool
        ('["a.py"]', None),  # not an object
        ('{"file_path": ', None),  # not JSON
    ],
)
def test_an_id_style_header_resolves_by_arguments_among_several_tools(
    arguments: str, expected: str | None
) -> None:
    """Several tools: exactly one whose schema (closed to undeclared properties) accepts the
    arguments, else the call is dropped, never invented; the next call still parses; the
    result does not depend on the order of the tools."""
    out = TE + section(call("call_1", arguments), call("functions.LS:1", '{"path": "/"}'))
    for tools in (CODE_TOOLS, CODE_TOOLS[::-1]):
        result = parsed(out, tools=tools)
        names = [c.name for c in result.tool_calls]
        assert names == ([expected] if expected else []) + ["LS"]
        assert result.tool_calls[-1].id == "functions.LS:1"
        if expected:
            assert result.tool_calls[0].id == "call_1"
        _, session = streamed(out, 3, tools=tools)
        assert session.dropped_tool_calls == (0 if expected else 1)


def test_a_header_that_names_an_undeclared_function_is_kept_for_its_verdict() -> None:
    """`functions.delete_file:0` names a function by its form: it is never re-targeted at a
    declared tool (that would invent a call); the verdict says unknown_tool."""
    out = TE + section(call("functions.delete_file:0", '{"path": "/"}'))
    result = parsed(out, tools=[fn("read_file", {"path": S})])
    assert calls(result) == [("functions.delete_file:0", "delete_file", {"path": "/"})]
    (verdict,) = validate_tool_calls(result.tool_calls, [fn("read_file", {"path": S})])
    assert verdict.reason == "unknown_tool"


def test_without_tools_the_header_is_the_name_as_written() -> None:
    result = parsed(TE + section(call("call_3", "{}")))
    assert calls(result) == [("functions.call_3:0", "call_3", {})]


@pytest.mark.parametrize("tool_calls", [True, False])
def test_no_declared_tools_means_no_calls_and_no_text(tool_calls: bool) -> None:
    """A request that offered no tools (or tool_choice none) never gets a call: the section is
    parsed out of the text and the calls are counted as dropped."""
    out = f"plan{TE}Sure.{section(call('functions.get_weather:0', '{}'), call('1', '{}'))}"
    tools: list[Any] = [] if tool_calls else [WEATHER]
    result = parsed(out, tools=tools, tool_calls=tool_calls)
    assert (result.reasoning, result.content, result.tool_calls) == ("plan", "Sure.", [])
    _, session = streamed(out, 5, tools=tools, tool_calls=tool_calls)
    assert session.dropped_tool_calls == 2


def test_max_tool_calls_keeps_the_first_call_only() -> None:
    out = TE + section(
        call("functions.get_weather:0", '{"city": "A"}'),
        call("functions.get_weather:1", '{"city": "B"}'),
        call("2", '{"city": "C"}'),
    )
    result = parsed(out, tools=[WEATHER], max_tool_calls=1)
    assert calls(result) == [("functions.get_weather:0", "get_weather", {"city": "A"})]
    _, session = streamed(out, 4, tools=[WEATHER], max_tool_calls=1)
    assert session.dropped_tool_calls == 2


# -- arguments ----------------------------------------------------------------------------------


def test_coercion_follows_the_schema_and_is_recorded_in_the_verdict() -> None:
    args = '{"city": "5", "days": " 3 ", "metric": "TRUE", "extra": "7"}'
    result = parsed(TE + section(call("functions.get_weather:0", args)), tools=[WEATHER])
    (c,) = result.tool_calls
    assert json.loads(c.arguments) == {"city": "5", "days": 3, "metric": True, "extra": "7"}
    assert c.repairs == ("coerced",)
    (verdict,) = validate_tool_calls(result.tool_calls, [WEATHER])
    assert verdict.valid and verdict.repairs == ("coerced",)


@pytest.mark.parametrize(
    ("schema", "value", "expected"),
    [
        (I, '"5"', 5),
        (I, '"-12"', -12),
        (I, '"5.5"', "5.5"),  # not an integer: left as written
        (I, '"05"', "05"),
        (N, '"2.5e3"', 2500.0),
        (N, '"abc"', "abc"),
        (B, '"false"', False),
        (B, '"yes"', "yes"),
        ({"type": ["integer", "null"]}, '"7"', 7),
        ({"type": ["integer", "string"]}, '"7"', "7"),  # a string is allowed: kept
        ({"anyOf": [I]}, '"7"', "7"),  # only plain "type" is followed
        (I, "5", 5),
        (I, '"\\u0035"', 5),  # escapes are decoded before converting
    ],
)
def test_coercion_cases(schema: dict[str, Any], value: str, expected: Any) -> None:
    tool = fn("f", {"x": schema})
    result = parsed(TE + section(call("functions.f:0", f'{{"x": {value}}}')), tools=[tool])
    assert json.loads(result.tool_calls[0].arguments) == {"x": expected}


def test_nested_values_are_not_coerced() -> None:
    tool = fn("f", {"o": {"type": "object", "properties": {"n": I}}, "n": I})
    args = '{"o": {"n": "1"}, "n": "2", "l": ["3"]}'
    result = parsed(TE + section(call("functions.f:0", args)), tools=[tool])
    assert json.loads(result.tool_calls[0].arguments) == {"o": {"n": "1"}, "n": 2, "l": ["3"]}


def test_trailing_commas_are_repaired_and_recorded() -> None:
    args = '{"city": "Oslo", "tags": ["a", "b",\n ],\n}'
    result = parsed(TE + section(call("functions.get_weather:0", args)), tools=[WEATHER])
    (c,) = result.tool_calls
    assert json.loads(c.arguments) == {"city": "Oslo", "tags": ["a", "b"]}
    assert c.repairs == ("trailing_comma",)
    assert parsed(TE + section(call("functions.f:0", '{"s": "a,}"}'))).tool_calls[0].repairs == ()


def test_marker_text_inside_arguments_is_data() -> None:
    args = f'{{"note": "ends with {TE} and {TB} and ◁/think▷"}}'
    result = parsed(TE + section(call("functions.f:0", args)), tools=[fn("f", {"note": S})])
    assert json.loads(result.tool_calls[0].arguments)["note"].endswith(f"{TB} and ◁/think▷")
    assert not result.marker_leaked


def test_marker_tokens_inside_arguments_are_data_with_token_ids() -> None:
    """With a vocab, a real `</think>` token in arguments is also data; a variant marker the
    vocab lacks is plain text (the model could only spell it)."""
    markers = [TB, TE, SB, SE, CB, AB, CE]
    vocab = {m: 100 + i for i, m in enumerate(markers)}
    parser = build_parser("kimi_k2", vocab=vocab)
    pieces = [
        ("r", []), (TE, [101]), (SB, [102]), (CB, [104]), ("functions.f:0", []), (AB, [105]),
        ('{"a": "x', []), (TE, [101]), ('◁think▷"}', []), (CE, [106]), (SE, [103]),
    ]  # fmt: skip
    s = parser.start(tools=[fn("f", {"a": S})])
    for text, ids in pieces:
        s.feed(text, ids)
    s.finish()
    assert s.result().tool_calls[0].arguments == f'{{"a": "x{TE}◁think▷"}}'
    assert s.result().reasoning == "r"


# -- variants -----------------------------------------------------------------------------------


def test_singular_section_markers_and_old_think_markers() -> None:
    out = (
        "◁think▷plan◁/think▷Sure.<|tool_call_section_begin|>"
        + call("functions.get_weather:0", '{"city": "Oslo"}')
        + "<|tool_call_section_end|> tail"
    )
    result = parsed(out, thinking=False, tools=[WEATHER])
    assert (result.reasoning, result.content) == ("plan", "Sure.")
    assert calls(result) == [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]


# -- the arguments stream on its own: split invariance ------------------------------------------

keys = st.sampled_from(["n", "b", "s", "k", 'q"uote', "x\\y", "é"])
scalars = (
    st.integers(-1000, 1000).map(str)
    | st.integers(-1000, 1000).map(lambda i: f'"{i}"')
    | st.sampled_from(['"true"', '"False"', "true", "null", '"5.5"', '"a,}"', '"\\"]"', "1.5e2"])
    | st.text(st.sampled_from('ab,:{}[]"\\ 7'), max_size=6).map(json.dumps)
)


@st.composite
def json_objects(draw: st.DrawFn, depth: int = 0) -> str:
    """Object text with optional trailing commas and odd whitespace."""
    ws = st.sampled_from(["", " ", "\n  "])
    items = []
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        value = draw(scalars) if depth >= 2 or draw(st.booleans()) else None
        if value is None:
            inner = draw(json_objects(depth + 1))
            value = inner if draw(st.booleans()) else f"[{inner}{draw(ws)},{draw(ws)}]"
        items.append(f"{draw(ws)}{json.dumps(key)}{draw(ws)}:{draw(ws)}{value}")
    trailing = "," if items and draw(st.booleans()) else ""
    return "{" + ",".join(items) + trailing + draw(ws) + "}"


COERCE = {"n": ("integer",), "b": ("boolean",), "k": ("number",)}


@SETTINGS
@given(text=json_objects(), cuts=st.sets(st.integers(1, 400), max_size=30))
def test_arguments_stream_is_split_invariant_and_yields_valid_json(
    text: str, cuts: set[int]
) -> None:
    whole = ArgumentsStream(COERCE)
    expected = whole.feed(text) + whole.finish()
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    split = ArgumentsStream(COERCE)
    assert "".join(split.feed(p) for p in pieces) + split.finish() == expected
    assert split.repairs == whole.repairs
    value = json.loads(expected)  # trailing commas repaired: always valid JSON
    assert isinstance(value, dict)
    for key, types in COERCE.items():
        if isinstance(value.get(key), str):
            raw = value[key].strip()
            assert not (types == ("integer",) and raw.lstrip("-").isdigit() and raw[:1] != "0")


def test_toolset_ignores_malformed_tools() -> None:
    tools = ToolSet([{"type": "function"}, {"function": {"name": ""}}, WEATHER, WEATHER])
    assert list(tools.by_name) == ["get_weather"]


def test_a_constrained_calls_string_may_hold_a_marker() -> None:
    """Under the tool grammar, arguments are valid JSON by construction, so a marker inside an
    open JSON string is data; unconstrained, the marker ends the call (the model may never
    close its string)."""
    args = f'{{"note": "a{CE}b{SE}c"}}'
    out = TE + section(call("functions.f:0", args), call("functions.f:1", '{"note": "x"}'))
    tools = [fn("f", {"note": S})]
    result = parsed(out, tools=tools, constrained=True)
    assert [json.loads(c.arguments)["note"] for c in result.tool_calls] == [f"a{CE}b{SE}c", "x"]
    loose = parsed(out, tools=tools)
    assert loose.tool_calls[0].arguments == '{"note": "a'
