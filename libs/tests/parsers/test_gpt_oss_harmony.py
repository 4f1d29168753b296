"""The gpt_oss parser against openai-harmony itself: conversations rendered by the library's
encoder (``o200k_harmony``, loaded offline from the vocabulary embedded in the wheel), fed one
token at a time with their ids as the replica feeds them, must parse to what the library's
own ``StreamableParser`` reads from the same tokens, mapped to OpenAI fields by vLLM's rules
(``vllm/parser/harmony.py``: a function recipient is a call, ``analysis`` reasoning, ``final``
and a recipient-less ``commentary`` content, the rest dropped)."""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
from openai_harmony import (
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    Role,
    StreamableParser,
    load_harmony_encoding,
)

from inferplane.parsers import GPT_OSS_MARKERS, Parser, build_parser


@cache
def _encoding() -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@cache
def _parser() -> Parser:
    enc = _encoding()
    vocab = {m: enc.encode(m, allowed_special="all")[0] for m in GPT_OSS_MARKERS}
    return build_parser("gpt_oss", vocab=vocab)


WORDS = ["Tokyo", "weather", "the user", "asks", "JSON", "{", "}", "<think>", "🙂", "\n", "  "]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))).strip() or "x"


def _conversation(rng: random.Random) -> list[Message]:
    msgs: list[Message] = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["analysis", "final", "commentary", "call", "call_analysis", "builtin"])
        if kind in ("analysis", "final", "commentary"):
            msg = Message.from_role_and_content(Role.ASSISTANT, _text(rng))
            msgs.append(msg.with_channel(kind))
        elif kind == "builtin":
            msgs.append(
                Message.from_role_and_content(Role.ASSISTANT, '{"query": "x"}')
                .with_channel("analysis")
                .with_recipient("browser.search")
            )
        else:
            args = json.dumps({"city": _text(rng), "n": rng.randint(0, 9)}, ensure_ascii=False)
            channel = "analysis" if kind == "call_analysis" else "commentary"
            msg = (
                Message.from_role_and_content(Role.ASSISTANT, args)
                .with_channel(channel)
                .with_recipient(f"functions.fn_{rng.randint(0, 2)}")
            )
            msgs.append(msg.with_content_type("<|constrain|>json") if rng.random() < 0.5 else msg)
    return msgs


def _output_tokens(msgs: list[Message]) -> list[int]:
    """The tokens the model writes after the prompt's ``<|start|>assistant``."""
    enc = _encoding()
    tokens = [t for m in msgs for t in enc.render(m)]
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    assert tokens[: len(prefix)] == prefix
    return tokens[len(prefix) :]


def _oracle(tokens: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    """What openai-harmony's parser reads, mapped to OpenAI fields by vLLM's rules."""
    sp = StreamableParser(_encoding(), role=Role.ASSISTANT)
    for t in tokens:
        sp.process(t)
    sp.process_eos()
    reasoning, content, calls = [], [], []
    for m in sp.messages:
        text = m.content[0].text if m.content else ""
        recipient = m.recipient
        if recipient and recipient.startswith("functions."):
            calls.append((recipient.removeprefix("functions."), text))
        elif recipient:
            continue
        elif m.channel == "analysis":
            reasoning.append(text.strip())
        elif m.channel in ("final", "commentary"):
            content.append(text.strip())
    return "\n".join(reasoning), "\n".join(content), calls


@pytest.mark.parametrize("seed", range(60))
def test_token_stream_parses_as_openai_harmony_reads_it(seed: int) -> None:
    """Fed one token at a time with ids, the parser gives the library's reading of the same
    output: the same reasoning, content and calls (names and JSON arguments), no marker."""
    rng = random.Random(seed)
    tokens = _output_tokens(_conversation(rng))
    enc = _encoding()
    parser = _parser()
    session = parser.start(thinking=False)
    deltas = [session.feed(enc.decode_utf8([t]), token_ids=[t]) for t in tokens]
    deltas.append(session.finish())
    got = parser.collect(deltas)
    reasoning, content, calls = _oracle(tokens)
    assert got.reasoning == reasoning
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        (n, json.loads(a)) for n, a in calls
    ]
    assert not got.marker_leaked
    assert session.result() == got


def test_text_spelling_a_marker_is_text_when_ids_are_known() -> None:
    """With the vocab, only the special token is a marker: a final answer that spells
    ``<|end|>`` in ordinary tokens shows it (the library encodes it as text too)."""
    enc = _encoding()
    final = Message.from_role_and_content(Role.ASSISTANT, "write <|end|> to stop")
    msgs = [final.with_channel("final")]
    tokens = _output_tokens(msgs)
    session = _parser().start()
    for t in tokens:
        session.feed(enc.decode_utf8([t]), token_ids=[t])
    session.finish()
    assert session.result().content == "write <|end|> to stop"


def test_markers_resolve_to_the_special_token_ids() -> None:
    """The vocab's marker ids are o200k_harmony's special tokens (never hard-coded)."""
    ids = _parser().marker_token_ids
    enc = _encoding()
    assert set(ids) == set(GPT_OSS_MARKERS)
    assert all(enc.is_special_token(i) for i in ids.values())
