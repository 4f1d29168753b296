"""gpt-oss chat rendering through openai-harmony (``inferplane.chat._harmony``): what the
model is shown for system / developer text, tools, reasoning effort and a tool loop, what is
refused, and that the model's own answer to such a prompt parses back through ``gpt_oss``."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from inferplane.chat import GPT_OSS, ChatRenderError, Renderer, chat_family, render_chat
from inferplane.parsers import GPT_OSS_MARKERS, build_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@cache
def _enc() -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyTokenizer:
    """The part of gpt-oss's tokenizer the renderer reads: its vocabulary's marker ids."""

    def __init__(self, shift: int = 0) -> None:
        enc = _enc()
        self.vocab = {m: enc.encode(m, allowed_special="all")[0] + shift for m in GPT_OSS_MARKERS}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def render(request: dict[str, Any]) -> Any:
    return render_chat(request, HarmonyTokenizer(), family=GPT_OSS)


def tool_loop() -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
        ],
        "tools": [WEATHER],
        "reasoning_effort": "low",
    }


def test_gpt_oss_is_rendered_by_harmony() -> None:
    assert chat_family("gpt_oss") is GPT_OSS and GPT_OSS.renderer is Renderer.HARMONY


def test_tool_loop_renders_as_harmony_writes_it() -> None:
    """System and developer text become the developer instructions, tools the `functions`
    namespace, the effort the system message's `Reasoning:` line; the history call goes to
    `functions.get_weather` with `<|constrain|>json` and its result comes back from it; the
    prompt ends where the model's next message starts. Ids are the library's o200k ids."""
    p = render(tool_loop())
    text = p.text
    assert text.startswith("<|start|>system<|message|>")
    assert "Reasoning: low" in text
    assert "Current date" not in text  # deterministic: no date that changes every day
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\nBe brief." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert "days?: number," in text  # from the JSON schema: optional integer
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    ) in text
    assert (
        "<|start|>functions.get_weather<|channel|>commentary to=assistant"
        "<|message|>sunny, 21 C<|end|>"
    ) in text
    assert text.endswith("<|start|>assistant")
    assert p.token_ids == _enc().encode(text, allowed_special="all")
    assert p.thinking is False


def test_analysis_before_a_final_answer_is_dropped() -> None:
    """An earlier turn's reasoning is not shown again once it was answered (harmony's rule;
    the library drops it), while its answer is."""
    request = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "easy sum"},
            {"role": "user", "content": "3+3?"},
        ]
    }
    text = render(request).text
    assert "easy sum" not in text
    assert "<|start|>assistant<|channel|>final<|message|>4<|end|>" in text
    assert "<|start|>developer" not in text  # no instructions, no tools: no developer message


def test_text_beside_calls_is_a_preamble() -> None:
    request = tool_loop()
    request["messages"][3]["content"] = "Checking."
    text = render(request).text
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" in text


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"reasoning_effort": "minimal"}, "reasoning_effort"),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(patch: dict[str, Any], param: str) -> None:
    """gpt-oss cannot turn reasoning off, and harmony has no template kwargs: both are
    client errors naming the field, as are the shared normalisation's."""
    with pytest.raises(ChatRenderError) as e:
        render({**tool_loop(), **patch})
    assert e.value.param == param


def test_a_tokenizer_that_is_not_o200k_harmony_is_refused() -> None:
    """Prompt ids are harmony's; a model whose vocabulary gives the markers other ids would
    read them as other tokens, so rendering refuses (a deployment error, not a 400)."""
    with pytest.raises(RuntimeError, match="not o200k_harmony"):
        render_chat(tool_loop(), HarmonyTokenizer(shift=1), family=GPT_OSS)


def test_the_answer_to_a_rendered_prompt_parses_back() -> None:
    """A prompt and the model's answer, tokenized by harmony as one conversation: the answer's
    tokens, fed to the ``gpt_oss`` parser with the same vocabulary, give the call the request
    declared, with arguments valid for its schema."""
    enc = _enc()
    prompt = render({**tool_loop(), "messages": tool_loop()["messages"][:3]})
    answer = (
        "<|channel|>analysis<|message|>Use get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "days": 2}<|call|>'
    )
    ids = enc.encode(answer, allowed_special="all")
    whole = enc.encode(prompt.text + answer, allowed_special="all")
    assert whole == prompt.token_ids + ids  # the answer continues the prompt token for token
    parser = build_parser("gpt_oss", vocab=HarmonyTokenizer().get_vocab())
    session = parser.start(thinking=prompt.thinking, tools=[WEATHER])
    for t in ids:
        session.feed(enc.decode_utf8([t]), token_ids=[t])
    session.finish()
    res = session.result()
    assert res.reasoning == "Use get_weather."
    assert [(c.id, c.name, c.arguments) for c in res.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Paris", "days": 2}')
    ]
