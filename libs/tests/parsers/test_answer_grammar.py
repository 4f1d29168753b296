"""A constrained JSON answer (``build_json_constraint`` with the tokenizer's marker texts), run by
xgrammar as vLLM runs it, on the fixture model's real vocabulary and on a Kimi-sized one
(163,840 tokens, ``inferplane.testing.kimi_vocab``): random models (each step a token drawn
from the grammar's mask) walk random schemas; inside the answer no token whose text holds a
marker is ever allowed, and every answer that ends validates against the client's schema (its
string length bounds included). Without the marker texts the same grammar lets a JSON string
hold ``<|tool_calls_section_begin|>``: the fault the exclusion fixes."""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import jsonschema
import numpy as np
import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.parsers import answer_excludes, build_json_constraint, unenforced_keyword
from inferplane.parsers._answer import bounded_strings_as_patterns
from inferplane.testing.kimi_vocab import KIMI_MARKER_IDS, kimi_sized_vocab, special_texts
from inferplane.testing.tool_schemas import draw, object_schemas

xgr = pytest.importorskip("xgrammar")

THINK_END = "</think>"


class Vocab:
    """A vocabulary as xgrammar sees it, with what the walk needs."""

    def __init__(self, raw: list[bytes], info: Any, markers: list[str], stop: int) -> None:
        # Token texts for checks; answers are decoded from the bytes (a token may hold part of
        # a UTF-8 character).
        texts = [t.decode("utf-8", "replace") for t in raw]
        self.raw = raw
        self.texts = texts
        self.info = info
        self.markers = markers
        self.stop = stop
        self.size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        holds = np.zeros(self.size, dtype=bool)
        for i, t in enumerate(texts):
            holds[i] = any(m in t for m in markers)
        holds[stop] = False  # the stop token ends the answer; it is never shown
        self.holds_marker = holds
        short = np.zeros(self.size, dtype=bool)
        for i, t in enumerate(texts):
            short[i] = len(t) == 1 or t == THINK_END
        self.short = short


@cache
def fixture_vocab() -> Vocab:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(kimi_tiny.model_path()), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    markers = [t.content for t in tok.added_tokens_decoder.values()]
    return Vocab(list(info.decoded_vocab), info, markers, int(tok.eos_token_id))


@cache
def kimi_sized() -> Vocab:
    texts = kimi_sized_vocab()
    stop = KIMI_MARKER_IDS["<|im_end|>"]
    info = xgr.TokenizerInfo(
        texts, vocab_type=xgr.VocabType.RAW, vocab_size=len(texts), stop_token_ids=[stop]
    )
    return Vocab([t.encode() for t in texts], info, special_texts(), stop)


def allowed(matcher: Any, vocab: Vocab) -> np.ndarray:
    bitmask = xgr.allocate_token_bitmask(1, vocab.size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return bits[: vocab.size].astype(bool)


def walk(vocab: Vocab, value: str, thinking: bool, rng: random.Random) -> tuple[str | None, int]:
    """A random model under the constraint: `(answer text or None when it ran out of steps,
    marker-holding tokens the grammar allowed inside the answer)`."""
    matcher = xgr.GrammarMatcher(vocab.compiler.compile_structural_tag(value))
    text: list[bytes] = []
    in_answer = not thinking
    leaks = 0
    for _ in range(400):
        mask = allowed(matcher, vocab)
        if in_answer:
            leaks += int((mask & vocab.holds_marker).sum())
        if mask[vocab.stop]:
            answer = b"".join(text)
            if thinking:
                answer = answer.split(THINK_END.encode(), 1)[1]
            return answer.decode("utf-8"), leaks
        ids = np.flatnonzero(mask & vocab.short) if rng.random() < 0.7 else []
        if len(ids) == 0:
            ids = np.flatnonzero(mask)
        token = int(ids[rng.randrange(len(ids))])
        assert matcher.accept_token(token)
        text.append(vocab.raw[token])
        if not in_answer and vocab.texts[token] == THINK_END:
            in_answer = True
    return None, leaks


SCHEMAS = draw(object_schemas(max_length=40), 12, 27)


@pytest.mark.parametrize("vocab_of", [fixture_vocab, kimi_sized], ids=["kimi-tiny", "kimi-sized"])
@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
def test_a_random_model_writes_only_valid_answers_without_markers(
    vocab_of: Any, thinking: bool
) -> None:
    vocab = vocab_of()
    rng = random.Random(27)
    ended = 0
    for schema in SCHEMAS:
        built = build_json_constraint(schema, thinking=thinking, markers=vocab.markers)
        assert built.kind == "structural_tag"
        answer, leaks = walk(vocab, built.value, thinking, rng)
        assert leaks == 0, f"the grammar allowed a marker token inside the answer: {schema}"
        if answer is None:
            continue  # the response would end with finish_reason "length"
        ended += 1
        assert not any(m in answer for m in vocab.markers), answer
        jsonschema.validate(json.loads(answer), schema)
    assert ended >= len(SCHEMAS) // 2, f"only {ended} of {len(SCHEMAS)} walks ended"


@pytest.mark.parametrize("vocab_of", [fixture_vocab, kimi_sized], ids=["kimi-tiny", "kimi-sized"])
def test_without_the_markers_a_json_string_may_hold_a_marker_token(vocab_of: Any) -> None:
    """The root cause, shown on the grammar: xgrammar treats the marker tokens as text, so an
    open JSON string allows them unless the constraint excludes them."""
    vocab = vocab_of()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    section = vocab.texts.index("<|tool_calls_section_begin|>")
    for markers, allows in (((), True), (vocab.markers, False)):
        built = build_json_constraint(schema, thinking=False, markers=markers)
        grammar = (
            vocab.compiler.compile_json_schema(built.value)
            if built.kind == "json_schema"
            else vocab.compiler.compile_structural_tag(built.value)
        )
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string('{"a": "x')
        assert bool(allowed(matcher, vocab)[section]) is allows


def test_excludes_cover_every_marker_with_few_short_strings() -> None:
    kimi = [*special_texts(), "<think>", "</think>"]
    assert answer_excludes(kimi) == ("<|", "[BOS]", "[EOS]", "think>")
    qwen = ["<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>", "\n\n"]
    assert answer_excludes(qwen) == ("<|", "think>", "tool_call>")
    deepseek = ["<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>"]
    assert answer_excludes(deepseek) == ("<｜",)
    for texts in (kimi, qwen, deepseek):
        covers = answer_excludes(texts)
        assert all(any(c in t for c in covers) for t in texts if not t.isspace())


def test_length_bounded_strings_keep_their_bounds_as_a_pattern() -> None:
    schema = {
        "type": "object",
        "properties": {
            "long": {"type": "string", "minLength": 2, "maxLength": 40},
            "short": {"type": "string", "maxLength": 3},
            "list": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "own": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
            "free": {"type": "string"},
        },
    }
    out = bounded_strings_as_patterns(schema, ["<|im_end|>", "<think>"])
    props = out["properties"]
    assert props["long"] == {"type": "string", "pattern": "^[^<]{2,40}$"}
    assert props["short"] == {"type": "string", "pattern": r"^[\s\S]{0,3}$"}
    assert props["list"]["items"] == {"type": "string", "pattern": "^[^<]{1,}$"}
    assert props["own"] == schema["properties"]["own"]  # the client's pattern rules it
    assert props["free"] == {"type": "string"}
    assert schema["properties"]["long"]["maxLength"] == 40  # the input is not changed


def test_without_markers_the_constraint_is_vllms_own() -> None:
    schema = {"type": "object"}
    assert build_json_constraint(schema, thinking=False).kind == "json_schema"
    assert build_json_constraint(None, thinking=False).kind == "json_object"
    tag = json.loads(build_json_constraint(None, thinking=False, markers=["<|im_end|>"]).value)
    assert tag["format"]["excludes"] == ["<|"]
    assert tag["format"]["json_schema"] == {"type": "object"}


def test_the_answer_grammar_keeps_string_bounds_and_refuses_only_marker_text() -> None:
    vocab = fixture_vocab()
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 1, "maxLength": 3},
            "note": {"type": "string", "maxLength": 20},
            "free": {"type": "string"},
        },
        "required": ["code", "note", "free"],
    }
    built = build_json_constraint(schema, thinking=False, markers=vocab.markers)
    grammar = vocab.compiler.compile_structural_tag(built.value)

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(grammar).accept_string(text))

    assert accepts('{"code": "a<b", "note": "x", "free": "if a < b or c > d: <b>"}')
    assert not accepts('{"code": "abcd"')  # maxLength 3
    assert not accepts('{"code": "",')  # minLength 1
    assert not accepts('{"code": "a", "note": "a <')  # a bounded string that fits a marker
    assert not accepts('{"code": "a", "note": "b", "free": "x <|im_end|>')
    assert not accepts('{"code": "a", "note": "b", "free": "</think>')


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "multipleOf": 3}, "schema: multipleOf"),
        ({"type": "array", "uniqueItems": True}, "schema: uniqueItems / contains"),
        ({"type": "string", "format": "ipv5"}, "schema: format 'ipv5'"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "^a", "maxLength": 3}},
            },
            "properties.a: pattern or format with minLength / maxLength",
        ),
        ({"allOf": [{"type": "string"}, {"enum": ["y"]}]}, "schema: allOf"),
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, None),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, None),
    ],
)
def test_unenforced_keywords_are_found_where_they_are(schema: Any, where: str | None) -> None:
    assert unenforced_keyword(schema) == where
