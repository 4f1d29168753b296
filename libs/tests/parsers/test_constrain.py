"""The structural-tag constraint for vLLM's gRPC ``Generate`` (xgrammar's JSON format)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferplane.parsers import Constraint, ConstraintError, ParserError, build_tool_constraint

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
GOOD = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Tokyo", "unit": "c"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
TWO = GOOD.replace(
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>",
)


def tag(tool_choice: Any, **kw: Any) -> dict[str, Any]:
    c = build_tool_constraint(TOOLS, tool_choice, **kw)
    assert c is not None and c.kind == "structural_tag"
    value: dict[str, Any] = json.loads(c.value)
    return value


def test_required_shape() -> None:
    """Reasoning span closed by </think>, then exactly a section of declared calls."""
    fmt = tag("required")["format"]
    reasoning, calls = fmt["elements"]
    assert reasoning["type"] == "tag" and reasoning["begin"] == ""
    assert reasoning["end"] == "</think>"
    assert "<|tool_calls_section_begin|>" in reasoning["content"]["excludes"]
    begin, body, end = calls["elements"]
    assert begin == {"type": "const_string", "value": "<|tool_calls_section_begin|>"}
    assert end == {"type": "const_string", "value": "<|tool_calls_section_end|>"}
    assert body["type"] == "tags_with_separator" and body["at_least_one"] is True
    assert [t["begin"] for t in body["tags"]] == [
        "<|tool_call_begin|>functions.get_weather:",
        "<|tool_call_begin|>functions.now:",
    ]
    counter, arg_begin, schema = body["tags"][0]["content"]["elements"]
    assert counter == {"type": "regex", "pattern": r"\d{1,4}"}
    assert arg_begin["value"] == "<|tool_call_argument_begin|>"
    assert schema["json_schema"] == TOOLS[0]["function"]["parameters"]
    assert body["tags"][1]["content"]["elements"][2]["json_schema"] == {"type": "object"}


def test_named_function_forces_exactly_that_call() -> None:
    fmt = tag({"type": "function", "function": {"name": "now"}}, thinking=False)["format"]
    assert fmt["type"] == "sequence"
    assert [e["type"] for e in fmt["elements"]] == ["const_string", "tag", "const_string"]
    assert fmt["elements"][1]["begin"] == "<|tool_call_begin|>functions.now:"


def test_parallel_false_and_auto() -> None:
    assert tag("required", parallel_tool_calls=False)["format"]["elements"][1]["elements"][1][
        "stop_after_first"
    ]
    auto = tag("auto", constrain_auto=True, thinking=False)["format"]
    assert auto["type"] == "triggered_tags"
    assert auto["triggers"] == ["<|tool_calls_section_begin|>"]


@pytest.mark.parametrize("thinking", [True, False])
def test_auto_guards_only_the_tool_section(thinking: bool) -> None:
    """constrain_auto adds no reasoning span: free text (reasoning included) until a section,
    whose calls are the declared tools; `</think>` stays possible when the prompt opened
    `<think>`, so the model may end inside reasoning or open the section from it."""
    auto = tag("auto", constrain_auto=True, thinking=thinking)["format"]
    assert auto["type"] == "triggered_tags" and auto["at_least_one"] is False
    assert ("</think>" in auto["excludes"]) is not thinking
    assert {"<think>", "<|tool_call_begin|>"} <= set(auto["excludes"])
    (section,) = auto["tags"]
    assert section["begin"] == "<|tool_calls_section_begin|>"
    assert section["end"] == "<|tool_calls_section_end|>"
    assert [t["begin"] for t in section["content"]["tags"]] == [
        "<|tool_call_begin|>functions.get_weather:",
        "<|tool_call_begin|>functions.now:",
    ]


def test_parallel_tool_calls_false_under_auto_allows_one_call() -> None:
    """`parallel_tool_calls: false` with constrain_auto: one call in the section, and no text
    or second section after it (`stop_after_first` at both levels)."""
    auto = tag("auto", constrain_auto=True, parallel_tool_calls=False)["format"]
    assert auto["stop_after_first"] is True
    calls = auto["tags"][0]["content"]
    assert calls["type"] == "tags_with_separator"
    assert calls["stop_after_first"] is True and calls["at_least_one"] is True
    parallel = tag("auto", constrain_auto=True)["format"]
    assert parallel["stop_after_first"] is False
    assert parallel["tags"][0]["content"]["stop_after_first"] is False


def test_properties_follow_the_required_order() -> None:
    """The grammar makes the model write properties in the schema's order; a schema arrives
    with its properties in the wire's map order (`google.protobuf.Struct`), so each object's
    `required` order comes first (then the rest as they come), nested objects too.
    Validation is unchanged: the schema is the same but for the order."""
    search = {
        "type": "object",
        "properties": {  # as the Struct round trip hands it over
            "opts": {
                "type": "object",
                "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
                "required": ["z"],
            },
            "max_results": {"type": "integer"},
            "query": {"type": "string"},
        },
        "required": ["query", "max_results"],
    }
    tools = [{"type": "function", "function": {"name": "search", "parameters": search}}]
    c = build_tool_constraint(tools, "required", thinking=False)
    assert c is not None
    body = json.loads(c.value)["format"]["elements"][1]
    schema = body["tags"][0]["content"]["elements"][2]["json_schema"]
    assert list(schema["properties"]) == ["query", "max_results", "opts"]
    assert list(schema["properties"]["opts"]["properties"]) == ["z", "a"]
    assert schema == search


@pytest.mark.parametrize(
    ("tools", "choice", "kw"),
    [
        (TOOLS, "none", {}),
        (TOOLS, "auto", {}),
        (TOOLS, None, {}),
        ([], "auto", {"constrain_auto": True}),
    ],
)
def test_no_constraint(tools: list[dict[str, Any]], choice: Any, kw: dict[str, Any]) -> None:
    assert build_tool_constraint(tools, choice, **kw) is None


@pytest.mark.parametrize(
    ("tools", "choice", "match"),
    [
        ([], "required", "at least one"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not a declared tool"),
        (TOOLS, "sometimes", "unsupported"),
        (TOOLS, {"type": "function"}, "names no function"),
    ],
)
def test_errors(tools: list[dict[str, Any]], choice: Any, match: str) -> None:
    with pytest.raises(ConstraintError, match=match) as e:
        build_tool_constraint(tools, choice)
    assert isinstance(e.value, ParserError)


def test_constraint_is_a_plain_value() -> None:
    c = build_tool_constraint(TOOLS, "required")
    assert isinstance(c, Constraint)
    assert c == build_tool_constraint(TOOLS, "required")


# --- xgrammar (vLLM's structured-output backend) compiles and enforces it -----------------

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")


def accepts(choice: Any, text: str, **kw: Any) -> bool:
    c = build_tool_constraint(TOOLS, choice, **kw)
    assert c is not None
    grammar = xgr.Grammar.from_structural_tag(c.value)  # what vLLM's validation does
    return bool(testing._is_grammar_accept_string(grammar, text))


@pytest.mark.parametrize(
    ("choice", "thinking", "text", "ok"),
    [
        ("required", True, "hmm</think>" + GOOD, True),
        ("required", True, "hmm</think>" + TWO, True),
        ("required", False, GOOD, True),
        ("required", True, GOOD, False),  # reasoning must be closed
        ("required", True, "hmm</think>Sure!", False),  # a call is required
        ("required", True, "hmm" + GOOD + "</think>", False),  # no section inside reasoning
        ("required", False, GOOD.replace("get_weather", "get_time"), False),  # undeclared
        ("required", False, GOOD.replace('"city"', '"town"'), False),  # schema
        ("required", False, GOOD.replace('"c"}', '"k"}'), False),  # enum
        ("required", False, GOOD.replace(":0", ":x"), False),  # counter
        ("required", False, GOOD.replace('"Tokyo"', '\n    "Tokyo"'), True),  # pretty-printed
        ("required", False, GOOD.replace('"Tokyo"', " " * 9 + '"Tokyo"'), False),  # runaway
        ({"type": "function", "function": {"name": "now"}}, False, GOOD, False),
        ({"type": "function", "function": {"name": "get_weather"}}, False, GOOD, True),
        ({"type": "function", "function": {"name": "get_weather"}}, False, TWO, False),
        ("auto", False, "Just text.", True),
        ("auto", False, "Let me check." + GOOD, True),
        ("auto", False, "x" + GOOD.replace('"city"', '"town"'), False),
        ("auto", False, "x</think>", False),  # the prompt closed reasoning already
        ("auto", True, "hmm</think>Sure.", True),
        ("auto", True, "hmm", True),  # ends inside reasoning, as the model may
        ("auto", True, "hmm</think>" + GOOD, True),
        ("auto", True, "hmm" + GOOD, True),  # section straight from reasoning (Kimi skips)
        ("auto", True, "hmm</think>" + TWO, True),
        ("auto", True, "hmm</think>" + GOOD + "Done.", True),
        ("auto", True, "hmm<think>", False),
        ("auto", True, "hmm</think>" + GOOD.replace("get_weather", "get_time"), False),
        ("auto", True, "hmm</think>" + GOOD.replace('"c"}', '"k"}'), False),
        ("auto", True, "hmm" + GOOD.replace("<|tool_calls_section_begin|>", ""), False),
    ],
)
def test_xgrammar_enforces_the_constraint(choice: Any, thinking: bool, text: str, ok: bool) -> None:
    assert accepts(choice, text, thinking=thinking, constrain_auto=True) is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("hmm</think>" + GOOD, True),
        ("hmm" + GOOD, True),
        ("hmm</think>" + TWO, False),  # two calls
        ("hmm</think>" + GOOD + GOOD, False),  # two sections
        ("hmm</think>" + GOOD + "Done.", False),  # nothing after the one call
        ("hmm</think>Sure.", True),
    ],
)
def test_xgrammar_allows_one_call_without_parallel_tool_calls(text: str, ok: bool) -> None:
    kw = {"thinking": True, "constrain_auto": True, "parallel_tool_calls": False}
    assert accepts("auto", text, **kw) is ok


def test_matches_xgrammars_builtin_kimi_format_without_reasoning() -> None:
    """Without the reasoning span our tag is xgrammar's own Kimi tag (fields normalised), with
    the same whitespace cap, but for one deliberate difference: our call index is at most 4
    digits where xgrammar's is ``\\d+`` (an unbounded index let kimi-tiny write digits until
    max_tokens under a forced call)."""
    from xgrammar import StructuralTag
    from xgrammar.builtin_structural_tag import get_model_structural_tag

    from inferplane.parsers._constrain import MAX_WHITESPACE

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        ours = build_tool_constraint(TOOLS[:1], choice, thinking=False)
        assert ours is not None
        theirs = get_model_structural_tag(
            "kimi",
            tools=TOOLS[:1],
            tool_choice=choice,
            reasoning="disabled",
            max_whitespace_cnt=MAX_WHITESPACE,
        )
        bounded = ours.value.replace(json.dumps(r"\d{1,4}"), json.dumps(r"\d+"))
        assert bounded != ours.value
        assert StructuralTag.model_validate_json(bounded).model_dump() == theirs.model_dump()
