"""Property tests for the Qwen3, DeepSeek-V3.1 and GLM-4.5 parsers: generated well-formed
outputs parse to their meaning in any split; arbitrary interleavings of markers and text never
raise, never leak a marker and are split-invariant (with and without the request's tools)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.parsers import (
    DEEPSEEK_V31_MARKERS,
    GLM45_MARKERS,
    QWEN3_MARKERS,
    Parser,
    ParseResult,
    build_parser,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TB, TE = "<think>", "</think>"
DS_SB, DS_SE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_SEP, DS_CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
MARKERS = {"qwen3": QWEN3_MARKERS, "deepseek_v31": DEEPSEEK_V31_MARKERS, "glm45": GLM45_MARKERS}
# In arguments only the markers that end or begin a call (or a value) can never be data.
ARGS_MARKERS = {
    "qwen3": ("<tool_call>", "</tool_call>"),
    "deepseek_v31": (DS_CB, DS_CE, DS_SE),
    "glm45": ("</arg_value>", "</tool_call>"),
}
MARKER_RE = {f: re.compile("|".join(re.escape(m) for m in ms)) for f, ms in MARKERS.items()}
ARGS_MARKER_RE = {
    f: re.compile("|".join(re.escape(m) for m in ms)) for f, ms in ARGS_MARKERS.items()
}
PARSERS = {f: build_parser(f) for f in MARKERS}

# Text pieces chosen to sit near markers: partial markers, '<', '|', unicode, whitespace.
PIECES = [
    "a", "b", "Z", " ", "  ", "\n", "\t", "<", ">", "/", "|", "｜", "▁", "<｜", "<｜tool▁call",
    "<｜tool▁calls▁", "<｜tool▁se", "</thi", "<think", "<tool_", "</tool_call", "<arg_",
    "</arg_val", "<arg_value", "{", "}", "[", "]", '"', "\\", ":", ",", "name", "arguments",
    "東京", "🌸", "é", "x<y", "1", "true",
]  # fmt: skip
SOUP_EXTRAS = ['{"name": "f", "arguments": ', '{"a": 1}', "}", "f", "get_weather\n", "n"]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "a": {"type": "array"},
                    "s": {"type": "string"},
                },
            },
        },
    }
]


def text_for(family: str) -> st.SearchStrategy[str]:
    marker_re = MARKER_RE[family]
    return (
        st.lists(st.sampled_from(PIECES), max_size=10)
        .map("".join)
        .filter(lambda s: marker_re.search(s) is None)
    )


ws = st.sampled_from(["", " ", "\n", "\n\n", " \n "])
fn_name = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


@dataclass(frozen=True)
class Generated:
    output: str
    thinking: bool
    reasoning: str
    content: str
    calls: list[tuple[str, str, Any]]  # (id, name, arguments: parsed JSON)


def _prefix(draw: st.DrawFn, family: str) -> tuple[list[str], bool, str, str]:
    """Reasoning and content before the calls, in either thinking mode."""
    text = text_for(family)
    thinking = draw(st.booleans())
    reasoning, content = draw(text), draw(text)
    if thinking:
        return [reasoning, TE, content], True, reasoning.strip(), content.strip()
    if draw(st.booleans()):
        return [draw(ws), TB, reasoning, TE, content], False, reasoning.strip(), content.strip()
    return [content], False, "", content.strip()


def _json_args(draw: st.DrawFn, family: str) -> dict[str, Any]:
    text = text_for(family)
    value = st.recursive(
        st.none() | st.booleans() | st.integers(-(10**6), 10**6) | text,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=6,
    )
    args: dict[str, Any] = draw(st.dictionaries(text, value, max_size=3))
    return args


@st.composite
def qwen3_outputs(draw: st.DrawFn) -> Generated:
    parts, thinking, reasoning, content = _prefix(draw, "qwen3")
    calls: list[tuple[str, str, Any]] = []
    for i in range(draw(st.integers(0, 3))):
        name = draw(fn_name)
        args = _json_args(draw, "qwen3")
        ascii_ = draw(st.booleans())
        if draw(st.booleans()):
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_)
        elif args:
            body = json.dumps({"arguments": args, "name": name}, ensure_ascii=ascii_)
        else:
            body = json.dumps({"name": name})
        parts += ["<tool_call>", draw(ws), body, draw(ws), "</tool_call>", draw(ws)]
        calls.append((f"call_{i}", name, args))
    if calls:
        parts.append(draw(text_for("qwen3")))  # text after the calls is dropped
    return Generated("".join(parts), thinking, reasoning, content, calls)


@st.composite
def deepseek_outputs(draw: st.DrawFn) -> Generated:
    parts, thinking, reasoning, content = _prefix(draw, "deepseek_v31")
    calls: list[tuple[str, str, Any]] = []
    n = draw(st.integers(0, 3))
    if n:
        parts += [DS_SB, draw(ws)]
        for i in range(n):
            name = draw(fn_name)
            args = _json_args(draw, "deepseek_v31")
            written = json.dumps(args, ensure_ascii=draw(st.booleans())) if args else ""
            parts += [DS_CB, draw(ws), name, draw(ws), DS_SEP, draw(ws), written, draw(ws)]
            parts += [DS_CE, draw(ws)]
            calls.append((f"call_{i}", name, args))
        parts += [DS_SE, draw(text_for("deepseek_v31"))]  # text after the section is dropped
    return Generated("".join(parts), thinking, reasoning, content, calls)


@st.composite
def glm45_outputs(draw: st.DrawFn) -> Generated:
    parts, thinking, reasoning, content = _prefix(draw, "glm45")
    text = text_for("glm45")
    calls: list[tuple[str, str, Any]] = []
    for i in range(draw(st.integers(0, 3))):
        name = draw(fn_name)
        sep = draw(st.sampled_from(["", "\n"]))
        parts += ["<tool_call>", name, sep]  # GLM-4.7 writes no newline after the name
        args: dict[str, Any] = {}
        for _ in range(draw(st.integers(0, 3))):
            key, value = draw(text), draw(text)
            parts += [
                "<arg_key>",
                key,
                "</arg_key>",
                sep,
                "<arg_value>",
                value,
                "</arg_value>",
                sep,
            ]
            args[key.strip()] = value  # values are verbatim strings (no tools)
        parts += ["</tool_call>", draw(ws)]
        calls.append((f"call_{i}", name, args))
    return Generated("".join(parts), thinking, reasoning, content, calls)


GENERATORS: dict[str, Callable[[], st.SearchStrategy[Generated]]] = {
    "qwen3": qwen3_outputs,
    "deepseek_v31": deepseek_outputs,
    "glm45": glm45_outputs,
}


def split(draw: st.DrawFn, s: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(s) - 1)), max_size=40)))
    bounds = [0, *[c for c in cuts if c < len(s)], len(s)]
    return [s[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def streamed(
    family: str, deltas: list[str], thinking: bool, tools: list[dict[str, Any]] | None = None
) -> ParseResult:
    parser: Parser = PARSERS[family]
    s = parser.start(thinking=thinking, tools=tools)
    out = [s.feed(d) for d in deltas]
    out.append(s.finish())
    for d in out:  # no single delta carries a marker either
        for t in (d.reasoning, d.content):
            assert MARKER_RE[family].search(t) is None
        for tc in d.tool_calls:
            assert ARGS_MARKER_RE[family].search(tc.arguments) is None
    result = parser.collect(out)
    assert s.result() == result
    return result


@pytest.mark.parametrize("family", list(GENERATORS))
@SETTINGS
@given(data=st.data())
def test_generated_outputs_parse_to_their_meaning_in_any_split(
    family: str, data: st.DataObject
) -> None:
    g: Generated = data.draw(GENERATORS[family]())
    parser = PARSERS[family]
    one_shot = parser.parse(g.output, thinking=g.thinking)
    assert one_shot.reasoning == g.reasoning
    assert one_shot.content == g.content
    got = [(c.id, c.name, json.loads(c.arguments)) for c in one_shot.tool_calls]
    assert got == g.calls
    assert not one_shot.marker_leaked
    assert streamed(family, split(data.draw, g.output), g.thinking) == one_shot


@pytest.mark.parametrize("family", list(GENERATORS))
@SETTINGS
@given(data=st.data(), thinking=st.booleans(), with_tools=st.booleans())
def test_any_marker_soup_never_raises_never_leaks_and_is_split_invariant(
    family: str, data: st.DataObject, thinking: bool, with_tools: bool
) -> None:
    soup = st.lists(st.sampled_from([*MARKERS[family], *PIECES, *SOUP_EXTRAS]), max_size=40)
    out = "".join(data.draw(soup))
    tools = TOOLS if with_tools else None
    parser = PARSERS[family]
    one_shot = parser.parse(out, thinking=thinking, tools=tools)
    assert not one_shot.marker_leaked
    for c in one_shot.tool_calls:
        assert c.name and c.id.startswith("call_")
        assert MARKER_RE[family].search(c.name) is None
    assert streamed(family, split(data.draw, out), thinking, tools) == one_shot
