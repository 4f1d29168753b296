"""Delta-level behaviour of the Qwen3, DeepSeek-V3.1, GLM-4.5 and gpt-oss parsers: the name streams
before the arguments, arguments stream before the call ends, ids are generated, markers are
matched by token id, and the session options (tool_choice none, parallel_tool_calls false,
history numbering) hold for every format."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from inferplane.parsers import (
    DEEPSEEK_V31_MARKERS,
    GLM45_MARKERS,
    QWEN3_MARKERS,
    ArgumentsFormat,
    Delta,
    EngineConfig,
    Parser,
    Sink,
    ToolCallDelta,
    build_parser,
    default_registry,
)
from inferplane.parsers.cli import app

SB, SE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, SEP, CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def qwen_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def ds_section(*calls: tuple[str, str]) -> str:
    return SB + "".join(f"{CB}{n}{SEP}{a}{CE}" for n, a in calls) + SE


def glm_call(name: str, *pairs: tuple[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{body}</tool_call>"


def harmony_call(name: str, args: str) -> str:
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
    return f"<|start|>assistant{header}<|message|>{args}<|call|>"


TWO_CALLS = {
    "qwen3": qwen_call("a", '{"x": 1}') + "\n" + qwen_call("b", "{}"),
    "deepseek_v31": ds_section(("a", '{"x": 1}'), ("b", "{}")),
    "glm45": glm_call("a", ("x", "1")) + glm_call("b"),
    "gpt_oss": harmony_call("a", '{"x": 1}') + harmony_call("b", ""),
}
TWO_CALLS_ARGS = {
    "qwen3": '{"x": 1}',
    "deepseek_v31": '{"x": 1}',
    "glm45": '{"x": "1"}',
    "gpt_oss": '{"x": 1}',
}
FAMILIES = tuple(TWO_CALLS)
# Kimi K2 writes its own ids (``functions.NAME:N``); its streaming is test_kimi_k2_streaming.py.
OWN_IDS = frozenset({"kimi_k2"})


def fragments(parser: Parser, text: str, **start: Any) -> list[ToolCallDelta]:
    s = parser.start(**start)
    return [tc for ch in text for tc in s.feed(ch).tool_calls] + s.finish().tool_calls


def test_every_registered_parser_is_streamed_here() -> None:
    """The parsers are discovered from the registry: a newly registered one needs its two calls
    in ``TWO_CALLS`` (or, writing its own ids, a streaming suite of its own)."""
    assert set(FAMILIES) == set(default_registry().names) - OWN_IDS


@pytest.mark.parametrize("family", FAMILIES)
def test_first_fragment_carries_generated_id_and_name_then_only_arguments(family: str) -> None:
    frags = fragments(build_parser(family), TWO_CALLS[family], thinking=False)
    firsts = [(f.index, f.id, f.name) for f in frags if f.id is not None]
    assert firsts == [(0, "call_0", "a"), (1, "call_1", "b")]
    assert all(f.name is None for f in frags if f.id is None)
    assert "".join(f.arguments for f in frags if f.index == 0) == TWO_CALLS_ARGS[family]
    assert "".join(f.arguments for f in frags if f.index == 1) == "{}"


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_count_calls_across_the_conversation(family: str) -> None:
    res = build_parser(family).parse(TWO_CALLS[family], thinking=False, history_tool_calls=4)
    assert [c.id for c in res.tool_calls] == ["call_4", "call_5"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_choice_none_and_parallel_false(family: str) -> None:
    parser = build_parser(family)
    s = parser.start(thinking=False, tool_calls=False)
    deltas = [s.feed(TWO_CALLS[family]), s.finish()]
    assert all(not d.tool_calls for d in deltas)
    assert s.result().tool_calls == [] and s.dropped_tool_calls == 2
    s = parser.start(thinking=False, max_tool_calls=1)
    s.feed(TWO_CALLS[family])
    s.finish()
    assert [c.name for c in s.result().tool_calls] == ["a"] and s.dropped_tool_calls == 1


def test_qwen3_arguments_stream_before_the_call_ends() -> None:
    s = build_parser("qwen3").start(thinking=False)
    assert s.feed('<tool_call>\n{"name": "write", "argu').tool_calls == [
        ToolCallDelta(0, "call_0", "write", "")
    ]
    d = s.feed('ments": {"text": "hello wor')
    assert d.tool_calls == [ToolCallDelta(0, None, None, '{"text": "hello wor')]


def test_qwen3_arguments_before_the_name_wait_for_it() -> None:
    s = build_parser("qwen3").start(thinking=False)
    assert s.feed('<tool_call>{"arguments": {"q": 1}, ').is_empty
    d = s.feed('"name": "search"}')
    assert d.tool_calls == [ToolCallDelta(0, "call_0", "search", '{"q": 1}')]


def test_qwen3_string_arguments_are_held_until_they_close() -> None:
    s = build_parser("qwen3").start(thinking=False)
    s.feed('<tool_call>{"name": "f", "arguments": "{\\"a\\"')
    assert s.feed(": 1").tool_calls == []
    assert s.feed('}"}').tool_calls == [ToolCallDelta(0, None, None, '{"a": 1}')]


def test_qwen3_constrained_call_keeps_a_marker_inside_a_json_string() -> None:
    """Under a grammar the arguments are valid JSON, so ``</tool_call>`` inside one of their
    strings is data; unconstrained, it ends the call."""
    out = '<tool_call>{"name": "f", "arguments": {"t": "a</tool_call>b"}}</tool_call>'
    parser = build_parser("qwen3")
    s = parser.start(thinking=False, constrained=True)
    s.feed(out)
    s.finish()
    assert [json.loads(c.arguments) for c in s.result().tool_calls] == [{"t": "a</tool_call>b"}]
    assert parser.parse(out, thinking=False).tool_calls[0].arguments == '{"t": "a'


def test_glm45_string_values_stream_and_typed_values_wait_for_their_end() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "write",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
                },
            },
        }
    ]
    s = build_parser("glm45").start(thinking=False, tools=tools)
    s.feed("<tool_call>write\n<arg_key>text</arg_key><arg_value>hel")
    assert s.feed('lo "x"').tool_calls == [ToolCallDelta(0, None, None, 'lo \\"x\\"')]
    assert s.feed("</arg_value><arg_key>n</arg_key><arg_value>4").tool_calls == [
        ToolCallDelta(0, None, None, '", "n": ')
    ]
    assert s.feed("2</arg_value>").tool_calls == [ToolCallDelta(0, None, None, "42")]
    assert s.feed("</tool_call>").tool_calls == [ToolCallDelta(0, None, None, "}")]
    assert json.loads(s.result().tool_calls[0].arguments) == {"text": 'hello "x"', "n": 42}


def test_deepseek_arguments_stream_before_the_call_ends() -> None:
    s = build_parser("deepseek_v31").start(thinking=False)
    s.feed(f"{SB}{CB}get_weather{SEP}")
    assert s.feed('{"city": "Tok').tool_calls == [ToolCallDelta(0, None, None, '{"city": "Tok')]


@pytest.mark.parametrize(
    ("family", "markers", "text"),
    [
        ("qwen3", QWEN3_MARKERS, "x</think>y" + qwen_call("f", "{}")),
        ("deepseek_v31", DEEPSEEK_V31_MARKERS, "x</think>y" + ds_section(("f", "{}"))),
        ("glm45", GLM45_MARKERS, "x</think>y" + glm_call("f", ("k", "v"))),
    ],
)
def test_markers_match_by_token_id_and_spelled_markers_stay_text(
    family: str, markers: tuple[str, ...], text: str
) -> None:
    """With a vocab holding every marker, a marker counts only when its token id was fed; the
    same text without the id is content (and reported as a leak)."""
    vocab = {m: 1000 + i for i, m in enumerate(markers)}
    parser = build_parser(family, vocab=vocab)
    assert set(parser.marker_token_ids) == set(markers)
    pieces = _tokenize(text, markers)
    s = parser.start(thinking=True)
    for piece in pieces:
        s.feed(piece, token_ids=[vocab[piece]] if piece in vocab else [7])
    s.finish()
    res = s.result()
    assert (res.reasoning, res.content, [c.name for c in res.tool_calls]) == ("x", "y", ["f"])
    assert s.reasoning_tokens == 2  # "x" and "</think>"
    spelled = parser.start(thinking=False)
    spelled.feed("say </think> now", token_ids=[7, 7, 7])
    spelled.finish()
    assert spelled.result().content == "say </think> now"
    assert spelled.result().marker_leaked


def _tokenize(text: str, markers: tuple[str, ...]) -> list[str]:
    """Markers as single tokens, every other character its own token."""
    out: list[str] = []
    i = 0
    while i < len(text):
        m = next((m for m in markers if text.startswith(m, i)), None)
        out.append(m or text[i])
        i += len(m) if m else 1
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_marker_alone_in_a_delta_changes_nothing(family: str) -> None:
    parser = build_parser(family)
    text = "plan</think>ok" + TWO_CALLS[family]
    markers = {"qwen3": QWEN3_MARKERS, "deepseek_v31": DEEPSEEK_V31_MARKERS}.get(
        family, GLM45_MARKERS
    )
    s = parser.start(thinking=True)
    deltas = [s.feed(p) for p in _tokenize(text, markers)] + [s.finish()]
    assert parser.collect(deltas) == parser.parse(text, thinking=True)
    assert all(isinstance(d, Delta) for d in deltas)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_cli_accepts_the_parser(family: str) -> None:
    case = {"name": "c", "model_output": TWO_CALLS[family], "stream_deltas": None}
    r = CliRunner().invoke(app, ["replay", "--parser", family, "-"], input=json.dumps(case))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [c["id"] for c in out["tool_calls"]] == ["call_0", "call_1"]
    assert out["tool_calls"][0]["arguments"] == json.loads(TWO_CALLS_ARGS[family])


@pytest.mark.parametrize(
    ("sink", "fmt"),
    [(Sink.BODY, ArgumentsFormat.JSON), (Sink.ARG_VALUE, ArgumentsFormat.ENVELOPE)],
)
def test_argument_sinks_need_their_arguments_format(sink: Sink, fmt: ArgumentsFormat) -> None:
    config = EngineConfig(
        name="bad",
        terminals={"A": "<a>"},
        transitions={},
        sinks={"s": Sink.CONTENT, "t": sink},
        initial_state="s",
        thinking_state="s",
        split_header=lambda h, n: None,
        arguments_format=fmt,
    )
    with pytest.raises(ValueError, match="arguments"):
        Parser(config)


def test_a_constrained_response_reads_markers_the_grammar_way() -> None:
    """Under a tool-call grammar (xgrammar's structural tags match strings), a marker the model
    spells in byte tokens is structural to the grammar, so the parser reads it as a marker too;
    unconstrained, only the marker's own token is one and the spelling is text."""
    vocab = {m: 1000 + i for i, m in enumerate(QWEN3_MARKERS)}
    call = qwen_call("a", '{"x": 1}')
    pieces = [call[i : i + 3] for i in range(0, len(call), 3)]  # no piece is a marker token

    def run(constrained: bool) -> Any:
        s = build_parser("qwen3", vocab=vocab).start(thinking=False, constrained=constrained)
        for piece in pieces:
            s.feed(piece, token_ids=[1])
        s.finish()
        return s.result()

    constrained = run(True)
    assert [(c.name, c.arguments) for c in constrained.tool_calls] == [("a", '{"x": 1}')]
    assert constrained.content == ""
    free = run(False)
    assert free.tool_calls == [] and free.content == call
