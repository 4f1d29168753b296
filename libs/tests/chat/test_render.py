"""render_chat through the fixture model's real tokenizer and K2.5-like template (issue 3 §1).

Each test's docstring states the invariant it protects; the broken behaviours they pin down are
the template faults that broke Kimi tool calling on vLLM (``add_generation_prompt`` not passed,
an empty content rendered as ``[{'type': 'text', 'text': ''}]``, history ids not in
``functions.{name}:{n}`` form: vLLM blog, "Chasing 100% Accuracy: A Deep Dive into Debugging
Kimi K2's Tool-Calling on vLLM", 2025-10-28; ``docs/kimi.md``).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from inferplane.chat import ChatRenderError, RenderedPrompt, prepare_chat, render_chat
from inferplane.fixtures import kimi_tiny as kt

transformers = pytest.importorskip("transformers")

GEN_THINKING = "<|im_assistant|>assistant<|im_middle|><think>"
GEN_NO_THINKING = "<|im_assistant|>assistant<|im_middle|><think></think>"


@pytest.fixture(scope="module")
def tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(kt.model_path()))


def render(tok: Any, messages: list[dict[str, Any]], **request: Any) -> RenderedPrompt:
    return render_chat({"messages": messages, **request}, tok)


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(cid: str | None, name: str, arguments: Any = "{}") -> dict[str, Any]:
    c: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if cid is not None:
        c["id"] = cid
    return c


def tool_result(cid: str, content: Any = "ok") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": content}


# --- generation prompt and thinking ----------------------------------------------------------


def test_generation_prompt_always_added(tok: Any) -> None:
    """A chat request always ends with the assistant generation prompt, opening <think> by
    default, even though the request never asks for it (missing add_generation_prompt was
    one of the production template bugs)."""
    p = render(tok, [user("hi")])
    assert p.text.endswith(GEN_THINKING)
    assert p.thinking is True


def test_thinking_off_closes_think_in_generation_prompt(tok: Any) -> None:
    """chat_template_kwargs.thinking=false renders <think></think> so output starts as content,
    and RenderedPrompt.thinking tells the parser not to start in reasoning."""
    p = render(tok, [user("hi")], chat_template_kwargs={"thinking": False})
    assert p.text.endswith(GEN_NO_THINKING)
    assert p.thinking is False


def test_thinking_must_be_boolean(tok: Any) -> None:
    """A non-boolean thinking flag is a client error naming the field, not a truthy guess."""
    with pytest.raises(ChatRenderError) as e:
        render(tok, [user("hi")], chat_template_kwargs={"thinking": "no"})
    assert e.value.param == "chat_template_kwargs.thinking"


def test_reserved_template_kwargs_rejected(tok: Any) -> None:
    """Clients cannot override what the renderer owns (e.g. add_generation_prompt)."""
    with pytest.raises(ChatRenderError) as e:
        render(tok, [user("hi")], chat_template_kwargs={"add_generation_prompt": False})
    assert "add_generation_prompt" in str(e.value)


# --- content ----------------------------------------------------------------------------------


def test_empty_and_none_content_render_nothing(tok: Any) -> None:
    """content "" and None render as nothing: no "None", no list repr, no stray text."""
    for content in ("", None):
        p = render(tok, [{"role": "system", "content": content}, user(content)])
        assert "<|im_system|>system<|im_middle|><|im_end|>" in p.text
        assert "<|im_user|>user<|im_middle|><|im_end|>" in p.text
        assert "None" not in p.text


def test_content_parts_render_their_text(tok: Any) -> None:
    """A list of text parts renders exactly like the string of its texts concatenated, never
    as a Python list repr ("[{'type': 'text', ...}]" was the production bug)."""
    parts = [{"type": "text", "text": "What is the weather "}, {"type": "text", "text": "in Oslo?"}]
    as_parts = render(tok, [user(parts)])
    as_string = render(tok, [user("What is the weather in Oslo?")])
    assert as_parts == as_string
    assert "'type'" not in as_parts.text and "[{" not in as_parts.text


def test_empty_content_part_list_renders_nothing(tok: Any) -> None:
    """[] and [{"type": "text", "text": ""}] render like empty content."""
    assert render(tok, [user([])]) == render(tok, [user("")])
    assert render(tok, [user([{"type": "text", "text": ""}])]) == render(tok, [user(None)])


def test_non_text_part_rejected(tok: Any) -> None:
    """An image part is a clear client error naming the part; it is never rendered as text."""
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(ChatRenderError) as e:
        render(tok, [user(parts)])
    assert e.value.param == "messages[0].content[0].type"


def test_assistant_none_content_with_tool_calls(tok: Any) -> None:
    """An assistant turn with tool calls and content None renders only its tool section."""
    msgs = [
        user("List the files in the workspace."),
        {"role": "assistant", "content": None, "tool_calls": [call("x", "list_files")]},
        tool_result("x"),
    ]
    p = render(tok, msgs, tools=kt.tools("list_files"))
    assert (
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
        in p.text
    )
    assert "None" not in p.text


# --- tool-call ids ----------------------------------------------------------------------------


def test_history_ids_gain_functions_prefix(tok: Any) -> None:
    """`search:2` renders as `functions.search:2` in the call and in its result's header."""
    msgs = [
        user("q"),
        {"role": "assistant", "tool_calls": [call("search:2", "search", '{"q": "x"}')]},
        tool_result("search:2", "found"),
    ]
    text = render(tok, msgs).text
    assert "<|tool_call_begin|>functions.search:2<|tool_call_argument_begin|>" in text
    assert "## Return of functions.search:2\nfound" in text
    assert "search:2<" not in text.replace("functions.search:2", "")


def test_client_ids_renumbered_across_conversation(tok: Any) -> None:
    """Client ids like `call_abc` or `toolu_A` become `functions.{name}:{n}`, n counting every
    call of the conversation, and each tool result's `## Return of` names its own call."""
    msgs = [
        user("a"),
        {"role": "assistant", "tool_calls": [call("toolu_A", "get_time"), call("toolu_B", "f")]},
        tool_result("toolu_B", "B"),
        tool_result("toolu_A", "A"),
        {"role": "assistant", "content": "done"},
        user("b"),
        {"role": "assistant", "tool_calls": [call("toolu_C", "get_time")]},
        tool_result("toolu_C", "C"),
    ]
    text = render(tok, msgs).text
    for cid in ("functions.get_time:0", "functions.f:1", "functions.get_time:2"):
        assert f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>" in text
    assert "## Return of functions.f:1\nB" in text
    assert "## Return of functions.get_time:0\nA" in text
    assert "## Return of functions.get_time:2\nC" in text
    assert "toolu_" not in text


def test_per_turn_restarted_ids_are_made_unique(tok: Any) -> None:
    """A client that restarted numbering each turn (`:0` twice) gets conversation-wide ids, and
    each result maps to the most recent call with that id."""
    msgs = [
        user("a"),
        {"role": "assistant", "tool_calls": [call("functions.get_time:0", "get_time")]},
        tool_result("functions.get_time:0", "first"),
        user("b"),
        {"role": "assistant", "tool_calls": [call("functions.get_time:0", "get_time")]},
        tool_result("functions.get_time:0", "second"),
    ]
    text = render(tok, msgs).text
    assert "## Return of functions.get_time:0\nfirst" in text
    assert "## Return of functions.get_time:1\nsecond" in text


def test_model_ids_render_as_written_when_unique(tok: Any) -> None:
    """The model's own ids render as it wrote them, also where its numbering went backwards
    (`functions.f:1` after `functions.get_time:2`: the history then renders as generated, so
    the next prompt extends this one); a later client id takes a number above every one seen."""
    msgs = [
        user("a"),
        {"role": "assistant", "tool_calls": [call("functions.get_time:2", "get_time")]},
        tool_result("functions.get_time:2", "A"),
        {"role": "assistant", "tool_calls": [call("functions.f:1", "f")]},
        tool_result("functions.f:1", "B"),
        {"role": "assistant", "tool_calls": [call("call_x", "f")]},
        tool_result("call_x", "C"),
    ]
    text = render(tok, msgs).text
    for cid, result in (
        ("functions.get_time:2", "A"),
        ("functions.f:1", "B"),
        ("functions.f:3", "C"),
    ):
        assert f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>" in text
        assert f"## Return of {cid}\n{result}" in text


def test_client_ids_render_like_kimi_ids(tok: Any) -> None:
    """The canonical tool loop with OpenAI-style ids renders byte-identical to the Kimi-id one,
    so the model sees its own format whatever ids the client keeps."""
    req = kt.TOOL_LOOP_FOLLOWUP.request()
    client = copy.deepcopy(req)
    for tc, cid in zip(client["messages"][1]["tool_calls"], ("call_abc", "call_def"), strict=True):
        tc["id"] = cid
    client["messages"][2]["tool_call_id"] = "call_abc"
    client["messages"][3]["tool_call_id"] = "call_def"
    assert render_chat(client, tok) == render_chat(req, tok)


def test_missing_call_id_gets_next_number(tok: Any) -> None:
    """A history call without an id still renders a Kimi id with the next number."""
    msgs = [user("a"), {"role": "assistant", "tool_calls": [call(None, "list_files")]}]
    assert "<|tool_call_begin|>functions.list_files:0<|tool_call_argument_begin|>{}" in (
        render(tok, msgs).text
    )


def test_tool_result_with_unknown_id_rejected(tok: Any) -> None:
    """A tool message whose tool_call_id matches no earlier call is a 400 naming the field,
    not a prompt with a dangling `## Return of`."""
    msgs = [
        user("a"),
        {"role": "assistant", "tool_calls": [call("call_a", "get_time")]},
        tool_result("call_zzz"),
    ]
    with pytest.raises(ChatRenderError) as e:
        render(tok, msgs)
    assert e.value.param == "messages[2].tool_call_id"
    assert "call_zzz" in str(e.value)


def test_tool_result_without_id_rejected(tok: Any) -> None:
    """role 'tool' requires tool_call_id."""
    with pytest.raises(ChatRenderError) as e:
        render(tok, [user("a"), {"role": "tool", "content": "x"}])
    assert e.value.param == "messages[1].tool_call_id"


def test_duplicate_ids_in_one_message_rejected(tok: Any) -> None:
    """Two calls of one assistant message sharing an id would make results ambiguous."""
    msgs = [user("a"), {"role": "assistant", "tool_calls": [call("x", "f"), call("x", "g")]}]
    with pytest.raises(ChatRenderError) as e:
        render(tok, msgs)
    assert e.value.param == "messages[1].tool_calls[1].id"


def test_arguments_rendered_verbatim_or_as_kimi_json(tok: Any) -> None:
    """String arguments render exactly as the model wrote them; object arguments (a protobuf
    Struct) render as Kimi writes JSON, integral floats as ints; empty → {}."""
    msgs = [
        user("a"),
        {
            "role": "assistant",
            "tool_calls": [
                call("a:0", "a", '{"x":1}'),
                call("b:1", "b", {"n": 3.0, "r": 0.5, "s": "é"}),
                call("c:2", "c", ""),
            ],
        },
    ]
    text = render(tok, msgs).text
    assert '<|tool_call_argument_begin|>{"x":1}<|tool_call_end|>' in text
    assert '<|tool_call_argument_begin|>{"n": 3, "r": 0.5, "s": "é"}<|tool_call_end|>' in text
    assert "<|tool_call_argument_begin|>{}<|tool_call_end|>" in text


# --- reasoning of earlier turns ---------------------------------------------------------------


def test_reasoning_dropped_before_last_user_kept_in_tool_loop(tok: Any) -> None:
    """As the K2.5 template does: reasoning of turns before the last user message is dropped
    (<think></think>), reasoning in the current tool loop is kept; `reasoning` (vLLM's field
    name) counts as reasoning_content."""
    msgs = [
        user("first"),
        {"role": "assistant", "content": "one", "reasoning_content": "OLD THOUGHT"},
        user("second"),
        {
            "role": "assistant",
            "reasoning": "CURRENT THOUGHT",
            "tool_calls": [call("t:0", "get_time", '{"city": "Oslo"}')],
        },
        tool_result("t:0", '{"time": "09:30"}'),
    ]
    text = render(tok, msgs).text
    assert "OLD THOUGHT" not in text
    assert "<|im_middle|><think></think>one<|im_end|>" in text
    assert "<think>CURRENT THOUGHT</think><|tool_calls_section_begin|>" in text


def test_thinking_off_drops_loop_reasoning(tok: Any) -> None:
    """With thinking off the current loop's assistant turn renders <think></think> too."""
    msgs = [
        user("q"),
        {"role": "assistant", "reasoning_content": "R", "tool_calls": [call("t:0", "f")]},
        tool_result("t:0"),
    ]
    text = render(tok, msgs, chat_template_kwargs={"thinking": False}).text
    assert "<think>R</think>" not in text
    assert "<|im_middle|><think></think><|tool_calls_section_begin|>" in text


# --- tools --------------------------------------------------------------------------------------


def test_tools_declared_first_normalised(tok: Any) -> None:
    """Tools render first, in a tool_declare system turn, as name/description/parameters only."""
    text = render(tok, [user("hi")], tools=kt.tools("get_time")).text
    fn = kt.TOOLS["get_time"]["function"]
    decl = json.dumps([fn], separators=(",", ":"))
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{decl}<|im_end|>")


def test_extra_tool_fields_do_not_change_prompt(tok: Any) -> None:
    """Fields other than name/description/parameters (strict, vendor extras, a missing type)
    leave the prompt byte-identical."""
    plain = render(tok, [user("hi")], tools=kt.tools("get_weather", "web_search"))
    noisy_tools = kt.tools("get_weather", "web_search")
    noisy_tools[0]["function"]["strict"] = True
    noisy_tools[0]["x-vendor"] = {"cache": 1}
    del noisy_tools[1]["type"]
    noisy_tools[1]["function"]["title"] = "Web search"
    assert render(tok, [user("hi")], tools=noisy_tools) == plain


def test_struct_floats_render_as_ints(tok: Any) -> None:
    """A schema that crossed protobuf Struct (every number a double: 1.0, 10.0, 0.0) renders
    exactly like the client's ints; non-integral numbers and booleans are kept."""
    plain = render(tok, [user("hi")], tools=kt.tools("web_search", "convert_currency"))
    floats = kt.tools("web_search", "convert_currency")
    props = floats[0]["function"]["parameters"]["properties"]["max_results"]
    props["minimum"], props["maximum"] = 1.0, 10.0
    floats[1]["function"]["parameters"]["properties"]["amount"]["minimum"] = 0.0
    assert render(tok, [user("hi")], tools=floats) == plain
    odd = kt.tools("web_search")
    odd[0]["function"]["parameters"]["properties"]["max_results"]["multipleOf"] = 0.5
    odd[0]["function"]["parameters"]["additionalProperties"] = False
    text = render(tok, [user("hi")], tools=odd).text
    assert '"multipleOf":0.5' in text and '"additionalProperties":false' in text


def test_invalid_tools_rejected(tok: Any) -> None:
    """Malformed tools are 400s naming the field: non-function type, missing or duplicate name."""
    cases = [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name"),
        (kt.tools("get_time", "get_time"), "tools[1].function.name"),
    ]
    for tools, param in cases:
        with pytest.raises(ChatRenderError) as e:
            render(tok, [user("hi")], tools=tools)
        assert e.value.param == param


def test_tool_choice_checked_against_tools(tok: Any) -> None:
    """tool_choice naming an undeclared function, or 'required' without tools, is a 400;
    'auto', 'none' and a declared name render."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("auto", "none", "required", named):
        render(tok, [user("hi")], tools=kt.tools("get_time"), tool_choice=choice)
    bad = [
        ({"type": "function", "function": {"name": "nope"}}, kt.tools("get_time")),
        ("required", None),
        ("sometimes", kt.tools("get_time")),
    ]
    for choice, tools in bad:
        with pytest.raises(ChatRenderError) as e:
            render(tok, [user("hi")], tools=tools, tool_choice=choice)
        assert e.value.param is not None and e.value.param.startswith("tool_choice")


# --- roles and request shape ----------------------------------------------------------------


def test_unknown_role_rejected(tok: Any) -> None:
    """An unknown role is a 400 naming messages[i].role, never silently rendered."""
    with pytest.raises(ChatRenderError) as e:
        render(tok, [user("a"), {"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[1].role"
    assert "wizard" in str(e.value)


def test_developer_renders_as_system(tok: Any) -> None:
    """OpenAI's `developer` role is the system role for this template."""
    dev = render(tok, [{"role": "developer", "content": "be brief"}, user("hi")])
    sys_ = render(tok, [{"role": "system", "content": "be brief"}, user("hi")])
    assert dev == sys_


def test_empty_messages_rejected(tok: Any) -> None:
    """No messages (or not an array) is a 400 on `messages`."""
    for messages in ([], None, "hi"):
        with pytest.raises(ChatRenderError) as e:
            render_chat({"messages": messages}, tok)
        assert e.value.param == "messages"


def test_error_type_is_one_value_error() -> None:
    """Every request error is a ChatRenderError (a ValueError) with OpenAI's error type."""
    with pytest.raises(ValueError) as e:
        prepare_chat({"messages": [{"role": "user", "content": 3}]})
    assert isinstance(e.value, ChatRenderError)
    assert e.value.type == "invalid_request_error"
    assert e.value.param == "messages[0].content"


# --- tokens -----------------------------------------------------------------------------------


def test_token_ids_encode_text_with_markers_as_single_tokens(tok: Any) -> None:
    """token_ids are the text's ids (no extra BOS/EOS), each marker a single vocabulary token."""
    p = render_chat(kt.SECOND_TURN.request(), tok)
    assert p.token_ids == tok.encode(p.text, add_special_tokens=False)
    vocab = tok.get_vocab()
    for marker in ("<|im_end|>", "<|tool_call_begin|>", "<think>", "</think>"):
        assert p.token_ids.count(vocab[marker]) == p.text.count(marker)
    assert tok.decode(p.token_ids) == p.text


def test_canonical_weather_prompt_golden(tok: Any) -> None:
    """The full weather prompt, byte for byte: tools first, user turn, generation prompt."""
    text = render_chat(kt.WEATHER.request(), tok).text
    decls = [kt.TOOLS[n]["function"] for n in kt.WEATHER.tool_names]
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>"
        + json.dumps(decls, separators=(",", ":"))
        + "<|im_end|><|im_user|>user<|im_middle|>What is the weather in Tokyo?<|im_end|>"
        + GEN_THINKING
    )
