"""Property tests: generated Kimi outputs, split at random points, parse to the one-shot result
(which is the expected result), never raise and never leak a marker."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.parsers import (
    KIMI_K2_MARKER_VARIANTS,
    KIMI_K2_MARKERS,
    Parser,
    ParseResult,
    build_parser,
)

TB, TE = "<think>", "</think>"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (*KIMI_K2_MARKERS, *KIMI_K2_MARKER_VARIANTS)
MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
# In arguments only the markers that end or begin a call can never be data.
ARGS_MARKER_RE = re.compile("|".join(re.escape(m) for m in (CE, CB, SE)))
PARSER: Parser = build_parser("kimi_k2")
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text pieces chosen to sit near markers: partial markers, '<', '|', unicode, whitespace.
PIECES = [
    "a", "b", "Z", " ", "  ", "\n", "\t", "<", ">", "|", "/", "<|", "|>", "</", "<|tool_call",
    "<|tool_calls_section", "</thi", "<think", "<|tool_call_argument_beg", "functions.", ":",
    "東京", "🌸", "é", "{", "}", '"', "\\", "x<y", "1", "◁", "◁/thi", "<|tool_call_section",
]  # fmt: skip
text = (
    st.lists(st.sampled_from(PIECES), max_size=12)
    .map("".join)
    .filter(lambda s: MARKER_RE.search(s) is None)
)
ws = st.sampled_from(["", " ", "\n", "\n\n", " \n "])
name = st.from_regex(r"[a-z_][a-z0-9_]{0,10}(\.[a-z_]{1,6})?", fullmatch=True)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)


@dataclass(frozen=True)
class Generated:
    output: str
    thinking: bool
    reasoning: str
    content: str
    calls: list[tuple[str, str, str]]


@st.composite
def kimi_outputs(draw: st.DrawFn) -> Generated:
    """A well-formed (or truncation-free, whitespace-varied) Kimi output and its meaning."""
    thinking = draw(st.booleans())
    reasoning = draw(text)
    content = draw(text)
    n_calls = draw(st.integers(0, 3))
    has_section = n_calls > 0 or draw(st.booleans())
    parts: list[str] = []
    exp_reasoning = exp_content = ""
    if thinking:
        closed = draw(st.booleans())
        parts.append(reasoning)
        exp_reasoning = reasoning.strip()
        if closed:
            parts += [TE, content]
            exp_content = content.strip()
    else:
        explicit = draw(st.booleans())
        if explicit:
            parts += [draw(ws), TB, reasoning, TE]
            exp_reasoning = reasoning.strip()
        parts.append(content)
        exp_content = content.strip()
    calls: list[tuple[str, str, str]] = []
    if has_section:
        parts += [SB, draw(ws)]
        written: set[str] = set()
        for i in range(n_calls):
            fn = draw(name)
            n = draw(st.integers(0, 99))
            prefixed = draw(st.booleans())
            header = f"{'functions.' if prefixed else ''}{fn}:{n}"
            if header in written:  # an id written twice in one response is made unique
                header = f"{header}{100 + i}"  # (test_kimi_k2_vectors): keep them apart here
            written.add(header)
            if draw(st.booleans()):
                args = json.dumps(
                    draw(st.dictionaries(text, json_value, max_size=3)),
                    ensure_ascii=draw(st.booleans()),
                )
            else:
                args = draw(st.sampled_from(["", " ", "{}", "\n"]))
            parts += [CB, draw(ws), header, draw(ws), AB, draw(ws), args, draw(ws), CE, draw(ws)]
            calls.append((header, fn, args.strip() or "{}"))  # the id as written
        parts += [SE, draw(text)]  # text after the section is dropped
    return Generated("".join(parts), thinking, exp_reasoning, exp_content, calls)


def split(draw: st.DrawFn, s: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(s) - 1)), max_size=40)))
    bounds = [0, *[c for c in cuts if c < len(s)], len(s)]
    return [s[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def streamed(parser: Parser, deltas: list[str], thinking: bool) -> ParseResult:
    s = parser.start(thinking=thinking)
    out = [s.feed(d) for d in deltas]
    out.append(s.finish())
    for d in out:  # no single delta carries a marker either
        for t in (d.reasoning, d.content):
            assert MARKER_RE.search(t) is None
        for tc in d.tool_calls:
            assert ARGS_MARKER_RE.search(tc.arguments) is None
    return parser.collect(out)


@SETTINGS
@given(g=kimi_outputs(), data=st.data())
def test_generated_outputs_parse_to_their_meaning_in_any_split(
    g: Generated, data: st.DataObject
) -> None:
    one_shot = PARSER.parse(g.output, thinking=g.thinking)
    assert one_shot.reasoning == g.reasoning
    assert one_shot.content == g.content
    assert [(c.id, c.name, c.arguments) for c in one_shot.tool_calls] == g.calls
    assert not one_shot.marker_leaked
    pieces = split(data.draw, g.output)
    assert streamed(PARSER, pieces, g.thinking) == one_shot


# Arbitrary interleavings of markers and text: not well-formed Kimi, but the parser must
# still never raise, never leak and stay split-invariant.
soup = st.lists(st.sampled_from([*MARKERS, *PIECES]), max_size=40).map("".join)


@SETTINGS
@given(out=soup, thinking=st.booleans(), data=st.data())
def test_any_marker_soup_never_raises_never_leaks_and_is_split_invariant(
    out: str, thinking: bool, data: st.DataObject
) -> None:
    one_shot = PARSER.parse(out, thinking=thinking)
    assert not one_shot.marker_leaked
    for c in one_shot.tool_calls:
        assert c.name and c.id and MARKER_RE.search(c.id) is None
    assert streamed(PARSER, split(data.draw, out), thinking) == one_shot
