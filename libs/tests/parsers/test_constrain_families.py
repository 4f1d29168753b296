"""Tool-call constraints in every family's own format (``EngineConfig.call_syntax``), compiled
and run by xgrammar as vLLM does: a constrained grammar accepts the calls the family writes
(which its parser then reads back as valid calls) and rejects undeclared functions, arguments
against the schema, another family's format, and text where a call is required."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from inferplane.parsers import build_parser, build_tool_constraint, default_registry

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "now"}},
]
ARGS = {"city": "Tokyo", "days": 2}


def qwen3(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def deepseek(name: str, args: dict[str, Any]) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def glm45(name: str, args: dict[str, Any]) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def gpt_oss(name: str, args: dict[str, Any]) -> str:
    head = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
    return head + json.dumps(args)


def kimi(name: str, args: dict[str, Any], n: int = 0) -> str:
    return (
        f"<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>"
        f"{json.dumps(args)}<|tool_call_end|>"
    )


DS_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")


def calls(family: str, *pairs: tuple[str, dict[str, Any]]) -> str:
    """The family's own writing of these calls, as its model emits them."""
    if family == "qwen3":
        return "\n".join(qwen3(n, a) for n, a in pairs)
    if family == "deepseek_v31":
        return DS_SECTION[0] + "".join(deepseek(n, a) for n, a in pairs) + DS_SECTION[1]
    if family == "glm45":
        return "".join(glm45(n, a) for n, a in pairs)
    if family == "gpt_oss":
        return "<|start|>assistant".join(gpt_oss(n, a) for n, a in pairs)
    inner = "".join(kimi(n, a, i) for i, (n, a) in enumerate(pairs))
    return KIMI_SECTION[0] + inner + KIMI_SECTION[1]


# What a family's model writes before a forced call when it reasons (thinking on, or a model
# that opens reasoning itself).
REASONING = {
    "kimi_k2": "Check the weather.</think>",
    "deepseek_v31": "Check the weather.</think>",
    "qwen3": "<think>\nCheck the weather.\n</think>\n\n",
    "glm45": "<think>Check the weather.</think>",
    "gpt_oss": "<|channel|>analysis<|message|>Check the weather.<|end|><|start|>assistant",
}
# Whether the prompt opened reasoning for that output (RenderedPrompt.thinking).
THINKING = {"kimi_k2": True, "deepseek_v31": True, "qwen3": True, "glm45": False, "gpt_oss": False}
FAMILIES = tuple(REASONING)
OTHER = {"kimi_k2": "qwen3", "qwen3": "deepseek_v31", "deepseek_v31": "glm45", "glm45": "kimi_k2",
         "gpt_oss": "qwen3"}  # fmt: skip


def accepts(family: str, choice: Any, text: str, **kw: Any) -> bool:
    syntax = build_parser(family).config.call_syntax
    c = build_tool_constraint(TOOLS, choice, syntax=syntax, constrain_auto=True, **kw)
    assert c is not None and c.kind == "structural_tag"
    grammar = xgr.Grammar.from_structural_tag(c.value)  # what vLLM's validation does
    return bool(testing._is_grammar_accept_string(grammar, text))


def test_every_registered_format_has_a_call_syntax() -> None:
    """A deployment may name any registered parser with tool_choice required: each needs a
    grammar in its own format."""
    for name in default_registry().names:
        assert build_parser(name).config.call_syntax is not None, name
    assert set(FAMILIES) == set(default_registry().names)


@pytest.mark.parametrize("family", FAMILIES)
def test_required_accepts_the_familys_calls_and_they_parse_back(family: str) -> None:
    """A forced call in the family's own format, after its reasoning, is accepted, and the
    family's parser reads it back as the declared call with schema-valid arguments."""
    thinking = THINKING[family]
    text = REASONING[family] + calls(family, ("get_weather", ARGS), ("now", {}))
    assert accepts(family, "required", text, thinking=thinking)
    res = build_parser(family).parse(text, thinking=thinking, tools=TOOLS)
    assert [c.name for c in res.tool_calls] == ["get_weather", "now"]
    args = json.loads(res.tool_calls[0].arguments)
    if family == "glm45":
        args["days"] = int(args["days"])  # GLM values of a declared integer are decoded
    jsonschema.validate(args, WEATHER_SCHEMA)
    assert not res.marker_leaked


@pytest.mark.parametrize("family", FAMILIES)
def test_required_rejects_what_is_not_a_declared_valid_call(family: str) -> None:
    thinking = THINKING[family]
    r = REASONING[family]
    bad = {
        "undeclared function": r + calls(family, ("get_time", ARGS)),
        "argument outside the schema": r + calls(family, ("get_weather", {"town": "Tokyo"})),
        "another family's format": r + calls(OTHER[family], ("get_weather", ARGS)),
        "text instead of a call": r + "Sure, it is sunny.",
    }
    for what, text in bad.items():
        assert not accepts(family, "required", text, thinking=thinking), what


@pytest.mark.parametrize("family", FAMILIES)
def test_named_function_forces_exactly_that_call(family: str) -> None:
    thinking = THINKING[family]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = REASONING[family]
    assert accepts(family, named, r + calls(family, ("get_weather", ARGS)), thinking=thinking)
    assert not accepts(family, named, r + calls(family, ("now", {})), thinking=thinking)
    two = calls(family, ("get_weather", ARGS), ("get_weather", ARGS))
    assert not accepts(family, named, r + two, thinking=thinking)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_leaves_text_free_but_guards_calls(family: str) -> None:
    """Under ``auto`` the model may answer in text or call, but a call must be declared and
    schema-valid; one only when parallel_tool_calls is false."""
    thinking = THINKING[family]
    r = REASONING[family]
    answer = "It is sunny." if family != "gpt_oss" else (
        "<|channel|>final<|message|>It is sunny."
    )  # fmt: skip
    assert accepts(family, "auto", r + answer, thinking=thinking)
    assert accepts(family, "auto", r + calls(family, ("get_weather", ARGS)), thinking=thinking)
    bad = r + calls(family, ("get_weather", {"city": "Oslo", "days": "many"}))
    assert not accepts(family, "auto", bad, thinking=thinking)
    undeclared = r + calls(family, ("get_time", ARGS))
    assert not accepts(family, "auto", undeclared, thinking=thinking)
    if family != "gpt_oss":  # harmony: <|call|> stops generation after one call anyway
        two = r + calls(family, ("get_weather", ARGS), ("now", {}))
        assert accepts(family, "auto", two, thinking=thinking)
        assert not accepts(family, "auto", two, thinking=thinking, parallel_tool_calls=False)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v31", "kimi_k2"])
def test_thinking_off_forces_the_call_first(family: str) -> None:
    """With reasoning closed by the prompt, a forced call comes first: no reasoning block."""
    text = calls(family, ("get_weather", ARGS))
    assert accepts(family, "required", text, thinking=False)
    assert not accepts(family, "required", REASONING[family] + text, thinking=False)


def test_glm_and_gpt_oss_may_skip_their_own_reasoning() -> None:
    """Models that open reasoning themselves may also call straight away."""
    for family in ("glm45", "gpt_oss"):
        assert accepts(family, "required", calls(family, ("now", {})), thinking=False), family


@pytest.mark.parametrize(
    ("family", "model"), [("qwen3", "qwen_3"), ("deepseek_v31", "deepseek_v3_1")]
)
def test_agrees_with_xgrammars_builtin_tag(family: str, model: str) -> None:
    """Without reasoning, our grammar and xgrammar's built-in one for the model accept and
    reject the same forced calls."""
    from xgrammar.builtin_structural_tag import get_model_structural_tag

    theirs = xgr.Grammar.from_structural_tag(
        get_model_structural_tag(model, tools=TOOLS, tool_choice="required", reasoning="disabled")
    )
    for text in (
        calls(family, ("get_weather", ARGS)),
        calls(family, ("get_weather", {"city": 1})),
        calls(family, ("nope", {})),
    ):
        ours = accepts(family, "required", text, thinking=False)
        assert ours == bool(testing._is_grammar_accept_string(theirs, text)), text


ANSWER = '{"city": "Lima", "days": 1}'
# How each family answers after its reasoning: where a JSON answer goes.
ANSWER_AT = {
    "kimi_k2": ANSWER,
    "deepseek_v31": ANSWER,
    "qwen3": ANSWER,
    "glm45": ANSWER,
    "gpt_oss": "<|channel|>final <|constrain|>json<|message|>" + ANSWER,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_json_answer_follows_the_familys_reasoning(family: str) -> None:
    """response_format json_schema: the family's reasoning stays free, then the answer (in
    harmony's final channel) must be the schema's JSON, which the parser returns as content."""
    from inferplane.parsers import build_json_constraint

    thinking = THINKING[family]
    syntax = build_parser(family).config.call_syntax
    c = build_json_constraint(WEATHER_SCHEMA, syntax=syntax, thinking=thinking)
    grammar = xgr.Grammar.from_structural_tag(c.value)

    def ok(text: str) -> bool:
        return bool(testing._is_grammar_accept_string(grammar, text))

    text = REASONING[family] + ANSWER_AT[family]
    assert ok(text)
    assert not ok(REASONING[family] + ANSWER_AT[family].replace('"Lima"', "7"))
    assert not ok(REASONING[family] + "Sure: " + ANSWER)
    res = build_parser(family).parse(text, thinking=thinking)
    assert json.loads(res.content) == json.loads(ANSWER) and res.reasoning


def test_json_answer_without_reasoning_is_vllms_plain_constraint() -> None:
    """No reasoning and no answer header: the whole output is the JSON value."""
    from inferplane.parsers import build_json_constraint

    syntax = build_parser("qwen3").config.call_syntax
    assert build_json_constraint(None, syntax=syntax, thinking=False).kind == "json_object"
    c = build_json_constraint(WEATHER_SCHEMA, syntax=syntax, thinking=False)
    assert c.kind == "json_schema" and json.loads(c.value) == WEATHER_SCHEMA
