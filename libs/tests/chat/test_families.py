"""Rendering per chat family (issue 19): Kimi's fixes apply to Kimi only; a Qwen3 model gets
`enable_thinking`, its client's ids and argument text, through qwen3-tiny's real tokenizer
and Qwen3 template; every parser a deployment may name has a family.

Each test's docstring states the invariant it protects.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferplane.chat import (
    CHAT_FAMILIES,
    DEEPSEEK_V31,
    GENERIC,
    GLM45,
    KIMI_K2,
    QWEN3,
    ChatRenderError,
    UnknownChatFamilyError,
    chat_family,
    prepare_chat,
    render_chat,
)
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures import qwen3_tiny as qt

transformers = pytest.importorskip("transformers")

GEN = "<|im_start|>assistant\n"
GEN_NO_THINKING = GEN + "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen_tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(qt.model_path()))


@pytest.fixture(scope="module")
def kimi_tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(kt.model_path()))


class RecordingTokenizer:
    """A tokenizer whose template records what it was given and renders nothing of it."""

    chat_template = "recorded"

    def __init__(self) -> None:
        self.conversation: list[dict[str, Any]] = []
        self.kwargs: dict[str, Any] = {}

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> str:
        self.conversation = conversation
        self.kwargs = kwargs
        return "prompt"

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [ord(c) for c in text]


def loop_request(**extra: Any) -> dict[str, Any]:
    return {**qt.tools_request(), **extra}


# --- qwen3-tiny: the real tokenizer and Qwen3 template ---------------------------------------


def test_qwen3_tools_conversation_renders_as_qwen3_writes_it(qwen_tok: Any) -> None:
    """A tool loop for a Qwen3 model: tools declared as JSON lines in the system turn (after
    the client's system text), the history call as `<tool_call>` JSON with its string
    arguments verbatim (what the model wrote, token for token), the result as a
    `<tool_response>` in a user turn, then the bare generation prompt (thinking on by
    default: the model opens `<think>` itself). No Kimi id or marker is introduced, and the
    client's id is not shown."""
    p = render_chat(qt.tools_request(), qwen_tok, family=QWEN3)
    system, rest = p.text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a weather assistant.\n\n# Tools\n")
    for tool in qt.TOOLS:
        assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in system
    assert rest == (
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 celsius\n</tool_response><|im_end|>\n" + GEN
    )
    assert "functions." not in p.text and "call_w1" not in p.text and "<|im_user|>" not in p.text
    assert p.thinking is True
    vocab = qwen_tok.get_vocab()
    assert p.token_ids == qwen_tok.encode(p.text, add_special_tokens=False)
    for marker in qt.MARKERS[1:]:
        assert p.token_ids.count(vocab[marker]) == p.text.count(marker), marker


def test_qwen3_enable_thinking_switches_the_generation_prompt(qwen_tok: Any) -> None:
    """`chat_template_kwargs.enable_thinking: false` closes an empty think block in the prompt
    and the parser starts in content; Kimi's `thinking` key is not Qwen3's switch (it reaches
    the template untouched and changes nothing); a non-boolean switch is a 400 naming it."""
    messages = [{"role": "user", "content": "hi"}]
    off = render_chat(
        {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
        qwen_tok,
        family=QWEN3,
    )
    assert off.text.endswith(GEN_NO_THINKING) and off.thinking is False
    kimi_key = render_chat(
        {"messages": messages, "chat_template_kwargs": {"thinking": False}}, qwen_tok, family=QWEN3
    )
    assert kimi_key.text.endswith("hi<|im_end|>\n" + GEN) and kimi_key.thinking is True
    with pytest.raises(ChatRenderError) as e:
        render_chat(
            {"messages": messages, "chat_template_kwargs": {"enable_thinking": "no"}},
            qwen_tok,
            family=QWEN3,
        )
    assert e.value.param == "chat_template_kwargs.enable_thinking"


def test_qwen3_reasoning_of_the_current_tool_loop_is_kept(qwen_tok: Any) -> None:
    """`reasoning_content` of an assistant turn after the last user query renders inside
    `<think>` (Qwen3's template keeps the current loop's reasoning, drops older ones)."""
    request = qt.tools_request()
    request["messages"][2]["reasoning_content"] = "Need the weather."
    text = render_chat(request, qwen_tok, family=QWEN3).text
    assert "<|im_start|>assistant\n<think>\nNeed the weather.\n</think>\n\n<tool_call>" in text
    request["messages"].append({"role": "user", "content": "And now?"})
    assert "Need the weather." not in render_chat(request, qwen_tok, family=QWEN3).text


def test_same_request_kimi_ids_for_kimi_only(qwen_tok: Any, kimi_tok: Any) -> None:
    """One request, two families: the Kimi template sees `functions.get_weather:0` for the
    call and its result, the Qwen3 template the client's `call_w1`; both keep arguments as the
    client's text (both templates print a string verbatim)."""
    kimi = prepare_chat(qt.tools_request(), KIMI_K2).messages
    qwen = prepare_chat(qt.tools_request(), QWEN3).messages
    assert kimi[2]["tool_calls"][0]["id"] == kimi[3]["tool_call_id"] == "functions.get_weather:0"
    assert qwen[2]["tool_calls"][0]["id"] == qwen[3]["tool_call_id"] == "call_w1"
    assert kimi[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris","unit":"celsius"}'
    assert qwen[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris","unit":"celsius"}'
    kimi_text = render_chat(qt.tools_request(), kimi_tok).text
    assert "## Return of functions.get_weather:0" in kimi_text


# --- normalisation per family -------------------------------------------------------------------


def assistant_calls(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": list(calls)},
    ]


def fn_call(arguments: Any, cid: str | None = None, name: str = "f") -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if cid is not None:
        call["id"] = cid
    return call


def test_object_arguments_for_object_families() -> None:
    """GLM / no-parser templates get arguments as objects: a JSON-object string is
    parsed, an object keeps its values with integral floats as ints (protobuf Struct), empty
    is {}; a string that is not a JSON object stays verbatim (Qwen3's template prints it)."""
    calls = assistant_calls(
        fn_call('{"a": 1.5, "b": [1]}', "c1"),
        fn_call({"n": 3.0, "r": 0.5}, "c2"),
        fn_call("", "c3"),
        fn_call("not json", "c4"),
        fn_call("[1, 2]", "c5"),
    )
    for family in (GLM45, GENERIC):
        out = prepare_chat({"messages": calls}, family).messages[1]["tool_calls"]
        assert [c["function"]["arguments"] for c in out] == [
            {"a": 1.5, "b": [1]},
            {"n": 3, "r": 0.5},
            {},
            "not json",
            "[1, 2]",
        ], family.name


def test_text_arguments_for_text_families() -> None:
    """Kimi, DeepSeek-V3.1 and Qwen3 templates print arguments as text: a string verbatim (as
    the model wrote it: the history renders as generated), an object as JSON (integral floats
    as ints), empty as {}."""
    calls = assistant_calls(fn_call('{"a":1}', "f:0"), fn_call({"n": 3.0}, "f:1"), fn_call(""))
    for family in (KIMI_K2, DEEPSEEK_V31, QWEN3):
        out = prepare_chat({"messages": calls}, family).messages[1]["tool_calls"]
        assert [c["function"]["arguments"] for c in out] == ['{"a":1}', '{"n": 3}', "{}"]


def test_verbatim_ids_are_still_checked() -> None:
    """Outside Kimi, ids are the client's (a missing one stays missing), but a tool result
    must still answer an earlier call and one message may not use an id twice: 400s naming
    the field, as for Kimi."""
    out = prepare_chat({"messages": assistant_calls(fn_call("{}"))}, QWEN3).messages[1]
    assert "id" not in out["tool_calls"][0]
    orphan = [*assistant_calls(fn_call("{}", "a")), {"role": "tool", "tool_call_id": "b"}]
    with pytest.raises(ChatRenderError) as e:
        prepare_chat({"messages": orphan}, QWEN3)
    assert e.value.param == "messages[2].tool_call_id"
    twice = assistant_calls(fn_call("{}", "a"), fn_call("{}", "a"))
    with pytest.raises(ChatRenderError) as e:
        prepare_chat({"messages": twice}, GLM45)
    assert e.value.param == "messages[1].tool_calls[1].id"


@pytest.mark.parametrize(
    ("family", "kwargs", "sent", "parse_from_reasoning"),
    [
        (KIMI_K2, {}, {"thinking": True}, True),
        (KIMI_K2, {"enable_thinking": False}, {"thinking": True, "enable_thinking": False}, True),
        (QWEN3, {}, {"enable_thinking": True}, True),
        (QWEN3, {"enable_thinking": False}, {"enable_thinking": False}, False),
        (DEEPSEEK_V31, {}, {"thinking": False}, False),
        (DEEPSEEK_V31, {"thinking": True}, {"thinking": True}, True),
        (GLM45, {}, {"enable_thinking": True}, False),
        (GENERIC, {"thinking": True}, {"thinking": True}, False),
        (GENERIC, {}, {}, False),
    ],
)
def test_thinking_keyword_default_and_parser_start(
    family: Any, kwargs: dict[str, Any], sent: dict[str, Any], parse_from_reasoning: bool
) -> None:
    """The family's thinking keyword always reaches the template (client's value or the
    family's default), other keys pass through untouched, and `RenderedPrompt.thinking` (where
    the parser starts) is on only when thinking is on and the family's output starts inside
    reasoning (GLM-4.5 writes `<think>` itself after nothing; no parser: no switch)."""
    tok = RecordingTokenizer()
    p = render_chat(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs},
        tok,
        family=family,
    )
    owned = {"add_generation_prompt", "tokenize", "tools"}
    assert {k: v for k, v in tok.kwargs.items() if k not in owned} == sent
    assert tok.kwargs["add_generation_prompt"] is True
    assert p.thinking is parse_from_reasoning


# --- which family -------------------------------------------------------------------------------


def test_every_parser_a_deployment_may_name_has_a_family() -> None:
    """The orchestrator accepts any parser of inferplane.parsers; each must pick a chat family
    (else every request of such a deployment would fail at rendering). No parser: the generic
    family; an unknown name: an error listing the known ones."""
    from inferplane.parsers import default_registry

    assert set(default_registry().names) == set(CHAT_FAMILIES)
    for name in default_registry().names:
        assert chat_family(name).name == name
    assert chat_family(qt.PARSER) is QWEN3
    assert chat_family("") is chat_family(None) is GENERIC
    with pytest.raises(UnknownChatFamilyError) as e:
        chat_family("hermes")
    assert str(e.value) == (
        "no chat rendering for parser 'hermes'; known: deepseek_v31, glm45, gpt_oss, kimi_k2, qwen3"
    )
