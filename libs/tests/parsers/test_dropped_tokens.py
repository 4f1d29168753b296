"""A tokenizer's special tokens and chat markers that are not the format's markers
(``build_parser(..., drop=...)``: ``<|im_assistant|>``, ``<|im_middle|>``, ``<|im_end|>``)
never show in reasoning or content, whatever the split; inside a call's arguments they are
data; spelled in other tokens they are text; the leak check knows them."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from inferplane.fixtures import kimi_tiny, qwen3_tiny
from inferplane.parsers import Parser, ParseResult, build_parser


@cache
def tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    path = kimi_tiny.model_path() if model == "kimi_k2" else qwen3_tiny.model_path()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def parser(model: str) -> Parser:
    tok = tokenizer(model)
    added = [t.content for t in tok.added_tokens_decoder.values()]
    return build_parser(model, vocab=tok.get_vocab(), drop=added)


def stream(model: str, text: str, *, thinking: bool, step: int, **start: Any) -> ParseResult:
    """`text` tokenized by the fixture's tokenizer, fed `step` tokens at a time with ids."""
    tok = tokenizer(model)
    ids = tok.encode(text, add_special_tokens=False)
    session = parser(model).start(thinking, **start)
    for i in range(0, len(ids), step):
        part = ids[i : i + step]
        session.feed(tok.decode(part, skip_special_tokens=False), part)
    session.finish()
    return session.result()


@pytest.mark.parametrize("step", [1, 2, 3, 7])
@pytest.mark.parametrize(
    ("model", "output", "reasoning", "content"),
    [
        (
            "kimi_k2",
            "Plan <|im_middle|>it.</think>Hello <|im_assistant|>world<|im_end|>!",
            "Plan it.",
            "Hello world!",
        ),
        (
            "qwen3",
            "<think>Plan <|im_start|>it.</think>Hello <|endoftext|>world<tool_response>!",
            "Plan it.",
            "Hello world!",
        ),
    ],
)
def test_special_tokens_never_show_in_reasoning_or_content(
    model: str, output: str, reasoning: str, content: str, step: int
) -> None:
    result = stream(model, output, thinking=model == "kimi_k2", step=step)
    assert (result.reasoning, result.content) == (reasoning, content)
    assert not result.marker_leaked


@pytest.mark.parametrize("constrained", [True, False])
def test_inside_arguments_a_special_token_is_data(constrained: bool) -> None:
    args = '{"text": "x<|im_end|>y"}'
    output = (
        f"{kimi_tiny.SECTION_BEGIN}{kimi_tiny.CALL_BEGIN}functions.f:0{kimi_tiny.ARGUMENT_BEGIN}"
        f"{args}{kimi_tiny.CALL_END}{kimi_tiny.SECTION_END}"
    )
    result = stream("kimi_k2", output, thinking=False, step=1, constrained=constrained)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", args)]


def test_a_special_token_spelled_in_other_tokens_is_text() -> None:
    """With token ids, a marker is the marker's own token; its text written in byte tokens is
    what the model wrote, as for the format's markers."""
    tok = tokenizer("kimi_k2")
    spelled = [i for ch in "<|im_end|>" for i in tok.encode(ch, add_special_tokens=False)]
    session = parser("kimi_k2").start(False)
    for tid in spelled:
        session.feed(tok.decode([tid]), [tid])
    session.finish()
    assert session.result().content == "<|im_end|>"


def test_the_leak_check_knows_the_dropped_texts() -> None:
    assert parser("kimi_k2").leaks("", "a <|im_assistant|> b", [])
    assert not build_parser("kimi_k2").leaks("", "a <|im_assistant|> b", [])
