"""Hand-written Kimi K2 / K2.5 outputs, each replayed at chunk sizes 1, 2, 3, 5, 11, 23, whole,
and with every marker as its own delta (streaming Kimi parsers have crashed with ``IndexError``
mid-stream: vLLM issue #54701, SGLang issue #8269; ``docs/kimi.md``).

Invariants checked for every vector: the one-shot result is the expected one, every streamed
split concatenates to exactly the one-shot result, and no marker ever leaks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from inferplane.parsers import KIMI_K2_MARKERS, Parser, ParseResult, ToolCall, build_parser

TB, TE = "<think>", "</think>"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKER_RE = re.compile("|".join(re.escape(m) for m in KIMI_K2_MARKERS))
# In arguments only the markers that end or begin a call can never be data.
ARGS_MARKER_RE = re.compile("|".join(re.escape(m) for m in (CE, CB, SE)))
CHUNK_SIZES = (1, 2, 3, 5, 11, 23, None)


def call(header: str, args: str | None) -> str:
    """One call in Kimi's format; ``args=None`` omits the argument marker."""
    if args is None:
        return f"{CB}{header}{CE}"
    return f"{CB}{header}{AB}{args}{CE}"


def section(*calls: str) -> str:
    return SB + "".join(calls) + SE


@dataclass(frozen=True)
class Vector:
    name: str
    output: str
    thinking: bool = True
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)


WEATHER = call("functions.get_weather:0", '{"city": "Tokyo"}')
WEATHER_CALL = ("functions.get_weather:0", "get_weather", '{"city": "Tokyo"}')

VECTORS = [
    Vector(
        "k25_happy_path",
        f"Let me check the weather.{TE}I'll look it up.{section(WEATHER)}",
        reasoning="Let me check the weather.",
        content="I'll look it up.",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "missing_think_end_with_tool_section",
        f"I need the weather for Tokyo{section(WEATHER)}",
        reasoning="I need the weather for Tokyo",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "tool_section_inside_reasoning_then_think_end",
        f"Thinking about it{section(WEATHER)}{TE}Here you go",
        reasoning="Thinking about it",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "explicit_think_with_thinking_off",
        f"{TB}plan the answer{TE}The answer is 4.",
        thinking=False,
        reasoning="plan the answer",
        content="The answer is 4.",
    ),
    Vector(
        "explicit_think_after_leading_whitespace",
        f"\n {TB}plan{TE}\n\nok",
        thinking=False,
        reasoning="plan",
        content="ok",
    ),
    Vector(
        "explicit_think_when_prompt_opened_it",
        f"{TB}plan{TE}answer",
        reasoning="plan",
        content="answer",
    ),
    Vector("thinking_off_plain_answer", "Hello there!", thinking=False, content="Hello there!"),
    Vector(
        "thinking_off_empty_think_block",
        f"{TE}\n\nHi",
        thinking=False,
        content="Hi",
    ),
    Vector(
        "thinking_off_tool_call",
        f"Checking.{section(WEATHER)}",
        thinking=False,
        content="Checking.",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "think_after_content_is_not_reasoning",
        f"Sure. {TB}not reasoning{TE} done",
        thinking=False,
        content="Sure. not reasoning done",
    ),
    Vector(
        "arguments_with_marker_like_text_and_unicode",
        TE
        + section(
            call(
                "functions.search:0",
                '{"q": "a <| b |> <|tool_call </thi <think", "city": "東京 🌸", "e": "\\u00e9"}',
            )
        ),
        calls=[
            (
                "functions.search:0",
                "search",
                '{"q": "a <| b |> <|tool_call </thi <think", "city": "東京 🌸", "e": "\\u00e9"}',
            )
        ],
    ),
    Vector(
        "three_parallel_calls_whitespace_around_markers",
        f"plan{TE}\n\n{SB}\n"
        f'{CB} functions.a:0 {AB} {{"x": 1}} {CE}\n'
        f"{CB}functions.b:1{AB}{{}}{CE}\n"
        f'{CB}\nfunctions.c:2\n{AB}\n{{"y": [1, 2]}}\n{CE}\n{SE}\n',
        reasoning="plan",
        calls=[
            ("functions.a:0", "a", '{"x": 1}'),
            ("functions.b:1", "b", "{}"),
            ("functions.c:2", "c", '{"y": [1, 2]}'),
        ],
    ),
    Vector(
        "ids_without_functions_prefix_are_kept_verbatim",
        TE + section(call("get_weather:0", '{"city": "Paris"}'), call(" search:7 ", "{}")),
        calls=[
            ("get_weather:0", "get_weather", '{"city": "Paris"}'),
            ("search:7", "search", "{}"),
        ],
    ),
    Vector(
        "header_without_counter_is_numbered_by_index",
        TE + section(call("functions.a", "{}"), call("b", "{}")),
        calls=[("functions.a:0", "a", "{}"), ("functions.b:1", "b", "{}")],
    ),
    Vector(
        "dotted_function_name",
        TE + section(call("functions.mcp.files.read:4", '{"p": 1}')),
        calls=[("functions.mcp.files.read:4", "mcp.files.read", '{"p": 1}')],
    ),
    Vector(
        "empty_arguments",
        TE
        + section(
            call("functions.now:0", ""),
            call("functions.now:1", " \n "),
            call("functions.now:2", None),
        ),
        calls=[
            ("functions.now:0", "now", "{}"),
            ("functions.now:1", "now", "{}"),
            ("functions.now:2", "now", "{}"),
        ],
    ),
    Vector(
        "text_after_section_is_dropped",
        f"r{TE}c{section(WEATHER)}\n\nSure, I called the tool!",
        reasoning="r",
        content="c",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "reasoning_never_comes_back",
        f"r1{TE}c1{TB}r2{TE}c2",
        reasoning="r1",
        content="c1r2c2",
    ),
    Vector(
        "reasoning_never_comes_back_after_tools",
        f"{section(WEATHER)}{TB}more{TE}",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "markers_without_meaning_inside_arguments_are_data",
        TE + section(call("functions.f:0", f'{{"a": "x{TE}y{SB}z{AB}{TB}"}}')),
        calls=[("functions.f:0", "f", f'{{"a": "x{TE}y{SB}z{AB}{TB}"}}')],
    ),
    Vector(
        "whitespace_only_content_before_tools",
        f"r{TE}\n\n  \n{section(WEATHER)}",
        reasoning="r",
        calls=[WEATHER_CALL],
    ),
    Vector(
        "inner_whitespace_is_kept",
        f"  step 1\n\n  step 2  \n{TE}\n line 1\n\n line 2 \n",
        reasoning="step 1\n\n  step 2",
        content="line 1\n\n line 2",
    ),
    Vector(
        "call_without_section_marker",
        f"r{TE}{call('functions.f:0', '{}')}",
        reasoning="r",
        calls=[("functions.f:0", "f", "{}")],
    ),
    Vector(
        "second_section_adds_calls",
        f"{TE}{section(call('functions.a:0', '{}'))}junk{section(call('functions.b:1', '{}'))}",
        calls=[("functions.a:0", "a", "{}"), ("functions.b:1", "b", "{}")],
    ),
    Vector(
        "nameless_header_is_dropped",
        TE + section(call("  ", '{"x": 1}'), call("functions.f:3", '{"y": 2}')),
        calls=[("functions.f:3", "f", '{"y": 2}')],
    ),
    Vector("empty_output", "", reasoning=""),
    Vector("truncated_reasoning", "still thinking about", reasoning="still thinking about"),
    Vector(
        "truncated_in_arguments_keeps_what_streamed",
        f"{TE}{SB}{CB}functions.f:0{AB}" + '{"a": "par',
        calls=[("functions.f:0", "f", '{"a": "par')],
    ),
    Vector(
        "truncated_in_header_drops_the_call",
        f"{TE}ok{SB}{CB}functions.get_wea",
        content="ok",
    ),
    Vector(
        "truncated_partial_marker_is_flushed_as_text",
        f"{TE}answer <|tool_ca",
        content="answer <|tool_ca",
    ),
    Vector("less_than_signs_in_content", f"{TE}a < b and <3 <| x", content="a < b and <3 <| x"),
]


def chunks(text: str, size: int | None) -> list[str]:
    if size is None:
        return [text]
    return [text[i : i + size] for i in range(0, len(text), size)]


def marker_split(text: str) -> list[str]:
    """Every marker as its own delta, text between them as one delta each."""
    return [p for p in re.split(f"({MARKER_RE.pattern})", text) if p]


def stream(parser: Parser, deltas: list[str], thinking: bool) -> ParseResult:
    s = parser.start(thinking=thinking)
    return parser.collect([*(s.feed(d) for d in deltas), s.finish()])


@pytest.fixture(scope="module")
def parser() -> Parser:
    return build_parser("kimi_k2")


@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_one_shot_result(parser: Parser, v: Vector) -> None:
    """The complete output parses into the expected reasoning, content and calls."""
    res = parser.parse(v.output, thinking=v.thinking)
    assert res.reasoning == v.reasoning
    assert res.content == v.content
    assert [(c.id, c.name, c.arguments) for c in res.tool_calls] == v.calls
    assert not res.marker_leaked


@pytest.mark.parametrize("size", CHUNK_SIZES, ids=lambda s: f"chunk{s or 'all'}")
@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_streaming_equals_one_shot(parser: Parser, v: Vector, size: int | None) -> None:
    """Streaming at any chunk size concatenates to exactly the one-shot result."""
    assert stream(parser, chunks(v.output, size), v.thinking) == parser.parse(
        v.output, thinking=v.thinking
    )


@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_marker_as_its_own_delta(parser: Parser, v: Vector) -> None:
    """A marker arriving alone in a delta (vLLM raised IndexError) changes nothing."""
    res = stream(parser, marker_split(v.output), v.thinking)
    assert res == parser.parse(v.output, thinking=v.thinking)
    assert not res.marker_leaked


@pytest.mark.parametrize("size", CHUNK_SIZES, ids=lambda s: f"chunk{s or 'all'}")
@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_no_delta_ever_carries_a_marker(parser: Parser, v: Vector, size: int | None) -> None:
    """No single streamed delta (not just the concatenation) contains a marker or part of
    one that later completes."""
    s = parser.start(thinking=v.thinking)
    for d in [*(s.feed(c) for c in chunks(v.output, size)), s.finish()]:
        for text in (d.reasoning, d.content):
            assert not MARKER_RE.search(text)
        for tc in d.tool_calls:
            assert not ARGS_MARKER_RE.search(tc.arguments)
        for tc in d.tool_calls:
            assert tc.id is None or not MARKER_RE.search(tc.id)
            assert tc.name is None or not MARKER_RE.search(tc.name)


def test_history_tool_calls_number_ids_without_counter(parser: Parser) -> None:
    """A header without ``:N`` gets an id that does not collide with earlier turns' ids."""
    out = TE + section(call("functions.a", "{}"), call("b", "{}"))
    res = parser.parse(out, history_tool_calls=3)
    assert [c.id for c in res.tool_calls] == ["functions.a:3", "functions.b:4"]


def test_an_id_written_twice_in_one_response_is_made_unique(parser: Parser) -> None:
    """A model that writes one id twice in a turn (kimi-tiny does deep into a session): a call
    whose id an earlier call of the response carries gets the id the format generates for its
    place in the conversation, or the next free one (the third call's `:4` was taken by the
    second's), streamed as in the whole result; the first keeps the model's."""
    out = TE + section(
        call("functions.a:3", "{}"), call("functions.a:3", "{}"), call("functions.a:4", "{}")
    )
    whole = [c.id for c in parser.parse(out, history_tool_calls=3).tool_calls]
    assert whole == ["functions.a:3", "functions.a:4", "functions.a:5"]
    s = parser.start(thinking=True, history_tool_calls=3)
    streamed = [d for c in chunks(out, 1) for d in s.feed(c).tool_calls if d.id is not None]
    assert [d.id for d in streamed] == whole


def test_result_types(parser: Parser) -> None:
    res = parser.parse(f"r{TE}{section(WEATHER)}")
    assert res.tool_calls == [ToolCall(*WEATHER_CALL)]
    assert res.reasoning_chars == 1


@pytest.mark.parametrize("size", CHUNK_SIZES, ids=lambda s: f"chunk{s or 'all'}")
@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_session_result_is_what_its_deltas_assemble_to(
    parser: Parser, v: Vector, size: int | None
) -> None:
    """The session's own ``result()`` equals a client's assembly of the deltas it returned, at
    any split: a caller needs no accumulator of its own."""
    s = parser.start(thinking=v.thinking)
    deltas = [*(s.feed(c) for c in chunks(v.output, size)), s.finish()]
    assert s.result() == parser.collect(deltas) == parser.parse(v.output, thinking=v.thinking)


@pytest.mark.parametrize("size", CHUNK_SIZES, ids=lambda s: f"chunk{s or 'all'}")
@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_calls_not_allowed_are_dropped_and_counted(
    parser: Parser, v: Vector, size: int | None
) -> None:
    """``start(tool_calls=False)`` (``tool_choice: "none"``): no delta and no result carries a
    call, reasoning and content are unchanged, and every call the model made is counted."""
    s = parser.start(thinking=v.thinking, tool_calls=False)
    deltas = [*(s.feed(c) for c in chunks(v.output, size)), s.finish()]
    assert all(not d.tool_calls for d in deltas)
    res = s.result()
    assert (res.reasoning, res.content, res.tool_calls) == (v.reasoning, v.content, [])
    assert not res.marker_leaked
    assert s.dropped_tool_calls == len(v.calls)
