"""`inferplane.promptsize`: which tokenizers have a bytes-per-token bound (and which have
none), what text of a request is counted, and the refusal of a prompt whose size alone
exceeds the context, checked against the real tokenizer of the qwen3-tiny fixture."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.fixtures import qwen3_tiny
from inferplane.promptsize import (
    CONTEXT_LENGTH_EXCEEDED,
    NORMALIZATION_FACTOR,
    TokenBound,
    TokenBounds,
    check_prompt_size,
    prompt_text_bytes,
    tiktoken_bound,
    token_bound,
    token_bound_of,
)
from inferplane.runtime import InvalidArgumentError

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}


def _tokenizer(model: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"model": model, "normalizer": None, "pre_tokenizer": BYTE_LEVEL, **rest}


def _chat(*messages: dict[str, Any]) -> pb.ChatCompletionRequest:
    return json_format.ParseDict(
        {"model": "m", "messages": list(messages)}, pb.ChatCompletionRequest()
    )


def _completion(prompt: Any) -> pb.CompletionRequest:
    return json_format.ParseDict({"model": "m", "prompt": prompt}, pb.CompletionRequest())


def test_byte_level_bpe_counts_one_byte_per_character_and_added_tokens_in_utf8() -> None:
    bpe = {"type": "BPE", "vocab": {"ĠĠĠĠ": 0, "a": 1}, "merges": []}
    assert token_bound_of(_tokenizer(bpe)) == TokenBound(4)
    added = [{"content": "<|im_start|>"}]  # 12 bytes
    assert token_bound_of(_tokenizer(bpe, added_tokens=added)) == TokenBound(12)


def test_byte_fallback_counts_utf8_and_unicode_normalization_multiplies() -> None:
    """SentencePiece-style BPE (Metaspace, byte fallback): pieces in UTF-8 (`▁` is 3 bytes);
    an NFKC normalizer can shrink text to a quarter (U+1D400 → `A`)."""
    bpe = {"type": "BPE", "vocab": {"▁the": 0, "<0x41>": 1}, "byte_fallback": True}
    tokenizer = {
        "model": bpe,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "NFKC"}],
        },
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"},
    }
    bound = token_bound_of(tokenizer)
    assert bound == TokenBound(6, NORMALIZATION_FACTOR)  # "▁the": 3 + 3 bytes
    assert bound.bytes_per_token == 24 and bound.limit_bytes(100) == 2400


@pytest.mark.parametrize(
    "tokenizer",
    [
        # Unknown characters may fuse into one unknown token: no bound.
        {"model": {"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>"}},
        {"model": {"type": "Unigram", "vocab": [["a", 0.0]], "unk_id": 0}},
        {"model": {"type": "WordPiece", "vocab": {"a": 0}}},
        # Drops whitespace or characters: no bound.
        _tokenizer({"type": "BPE", "vocab": {"a": 0}}, normalizer={"type": "Strip"}),
        _tokenizer({"type": "BPE", "vocab": {"a": 0}}, normalizer={"type": "BertNormalizer"}),
        _tokenizer(
            {"type": "BPE", "vocab": {"a": 0}},
            normalizer={"type": "Replace", "pattern": {"String": " "}, "content": ""},
        ),
        _tokenizer({"type": "BPE", "vocab": {"a": 0}}, pre_tokenizer={"type": "Whitespace"}),
        _tokenizer(
            {"type": "BPE", "vocab": {"a": 0}, "byte_fallback": True},
            pre_tokenizer={"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"},
        ),
    ],
)
def test_tokenizers_that_can_lose_text_have_no_bound(tokenizer: dict[str, Any]) -> None:
    assert token_bound_of(tokenizer) is None


def test_the_fixture_tokenizer_and_a_missing_one(tmp_path: Path) -> None:
    bound = token_bound(qwen3_tiny.model_path())
    assert bound is not None and bound.normalization_factor == NORMALIZATION_FACTOR  # NFC
    assert token_bound(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("not json")
    assert token_bound(tmp_path) is None


def test_the_bound_holds_for_the_fixture_tokenizer() -> None:
    """Text bytes / bytes_per_token never exceeds the real token count (the rule's premise),
    on text built to be dense: long runs, whitespace, non-Latin scripts, special markers."""
    from tokenizers import Tokenizer

    folder = qwen3_tiny.model_path()
    bound = token_bound(folder)
    assert bound is not None
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    samples = [
        " " * 5000,
        "a" * 5000,
        "\n" * 777 + "x",
        "漢字かなカナ" * 300,
        "𝐀𝐁𝐂" * 300,  # NFC keeps these; NFKC would shrink them to a quarter
        "<think></think><tool_call>" * 100,
        "The quick brown fox jumps over the lazy dog. " * 200,
    ]
    for text in samples:
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert len(text.encode()) <= tokens * bound.bytes_per_token, text[:20]


def test_only_text_every_template_renders_is_counted() -> None:
    request = _chat(
        {"role": "system", "content": "  sys  "},  # stripped: 3 bytes
        {"role": "user", "content": [{"type": "text", "text": "hé"}, {"type": "image_url"}]},
        {"role": "assistant", "content": "x" * 1000},  # templates may cut earlier turns
        {"role": "tool", "tool_call_id": "c", "content": "y" * 1000},
        {"role": "developer", "content": "dev"},
    )
    assert prompt_text_bytes(request) == (3 + 3 + 3, 0)
    assert prompt_text_bytes(_completion(" ab ")) == (4, 0)
    assert prompt_text_bytes(_completion([1, 2, 3])) == (0, 3)
    assert prompt_text_bytes(_completion(["ab", "abcd"])) == (4, 0)
    assert prompt_text_bytes(_completion([[1, 2], [1, 2, 3, 4]])) == (0, 4)
    assert prompt_text_bytes(pb.EmbeddingRequest(model="m")) == (0, 0)


def test_a_prompt_over_the_bound_is_refused_one_at_it_passes() -> None:
    bound = TokenBound(4, 2)  # 8 bytes per token
    at_limit = _chat({"role": "user", "content": "x" * (8 * 100)})
    check_prompt_size(at_limit, 100, bound)
    over = _chat({"role": "user", "content": "x" * (8 * 100 + 1)})
    with pytest.raises(InvalidArgumentError) as refused:
        check_prompt_size(over, 100, bound)
    assert refused.value.code == CONTEXT_LENGTH_EXCEEDED
    assert refused.value.param == "messages"
    assert "100 tokens" in str(refused.value) and "at least 101 tokens" in str(refused.value)
    # Unknown context or no bound: nothing is refused by bytes; token ids count exactly.
    check_prompt_size(over, 0, bound)
    check_prompt_size(over, 100, None)
    check_prompt_size(_completion(list(range(100))), 100, None)
    with pytest.raises(InvalidArgumentError) as ids:
        check_prompt_size(_completion(list(range(101))), 100, None)
    assert ids.value.code == CONTEXT_LENGTH_EXCEEDED and ids.value.param == "prompt"


def test_an_8_mib_prompt_is_measured_in_milliseconds() -> None:
    request = _chat({"role": "user", "content": "x" * (8 << 20)})
    started = time.perf_counter()
    with pytest.raises(InvalidArgumentError):
        check_prompt_size(request, 2048, TokenBound(16, 4))
    assert time.perf_counter() - started < 0.5


def test_bounds_are_computed_once_per_folder_off_the_caller(tmp_path: Path) -> None:
    calls: list[str] = []

    def loader(folder: str) -> TokenBound | None:
        calls.append(folder)
        return TokenBound(len(folder))

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        bounds = TokenBounds(loader, executor)
        assert bounds.get("") is None
        first = bounds.get("abc")  # None until the worker has it
        deadline = time.monotonic() + 5
        while bounds.get("abc") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first in (None, TokenBound(3))
        assert bounds.get("abc") == TokenBound(3)
    assert calls == ["abc"]


def test_a_loader_failure_is_no_bound() -> None:
    def broken(folder: str) -> TokenBound | None:
        raise OSError(folder)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        bounds = TokenBounds(broken, executor)
        bounds.get("x")
        executor.shutdown(wait=True)
        assert bounds.get("x") is None


def test_fixture_tokenizer_json_is_what_is_read(tmp_path: Path) -> None:
    source = json.loads((qwen3_tiny.model_path() / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(source))
    assert token_bound(tmp_path) == token_bound(qwen3_tiny.model_path())


def test_a_tiktoken_vocabulary_is_bounded_by_its_longest_token(tmp_path: Path) -> None:
    """Kimi's form: `tiktoken.model` (base64 token, rank) and special tokens in
    tokenizer_config.json; read when the folder has no tokenizer.json."""
    import base64

    tokens = [b"a", b" the", b"=" * 40]
    (tmp_path / "tiktoken.model").write_bytes(
        b"\n".join(base64.b64encode(t) + b" %d" % i for i, t in enumerate(tokens)) + b"\n"
    )
    assert token_bound(tmp_path) == TokenBound(40)
    config = {"added_tokens_decoder": {"100": {"content": "<|" + "x" * 60 + "|>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tiktoken_bound(tmp_path) == TokenBound(64)
    (tmp_path / "tiktoken.model").write_text("not base64 at all!\n")
    assert token_bound(tmp_path) is None
