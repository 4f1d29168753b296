"""The fixture model's tokenizer as the platform loads it tokenizes like the one it was trained
with (issue 3 §6).

vLLM and the renderer load the folder with ``AutoTokenizer``; config.json says ``qwen2``, so
transformers builds a ``Qwen2Tokenizer`` that keeps only the vocab, merges and added tokens of
tokenizer.json and brings its own normalizer and pre-tokenizer. The model was trained on ids from
the tokenizer.json pipeline (``models/build_kimi_tiny.py``), so both must agree on every prompt
and completion the fixture serves, digits and punctuation included.
"""

from __future__ import annotations

from typing import Any

import pytest

from inferplane.chat import render_chat
from inferplane.fixtures import kimi_tiny as kt

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Digits, dates, times, decimals, negative numbers, JSON punctuation and spacing: where Qwen2's
# split regex and ByteLevel's own regex cut differently.
TRICKY = [
    'Convert 99.99 CHF to JPY. {"amount": 12.5, "from": "USD"}',
    "Schedule lunch on 2025-11-07 at 12:30 with Ana, Bo and Cy.",
    '{"temperature": -5, "condition": "snowy"}  It is -5 degrees.\n\n## Return of x:10',
    "Hello, Fay! It's 09:05 in Rome...   spaces\ttabs\r\nlines",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(kt.model_path()))


@pytest.fixture(scope="module")
def raw() -> Any:
    return tokenizers.Tokenizer.from_file(str(kt.model_path() / "tokenizer.json"))


@pytest.mark.parametrize("case", kt.CASES, ids=[c.name for c in kt.CASES])
def test_served_tokenizer_encodes_canonical_prompts_as_tokenizer_json(
    case: kt.CanonicalCase, tok: Any, raw: Any
) -> None:
    """The rendered prompt and the expected completion get the same ids from the AutoTokenizer
    the platform serves with as from tokenizer.json loaded raw (the training pipeline)."""
    prompt = render_chat(case.request(), tok)
    assert prompt.token_ids == raw.encode(prompt.text, add_special_tokens=False).ids
    completion = case.output + kt.EOS
    assert (
        tok.encode(completion, add_special_tokens=False)
        == raw.encode(completion, add_special_tokens=False).ids
    )


@pytest.mark.parametrize(
    "text", TRICKY, ids=["decimals_json", "date_time_names", "negatives_newlines", "whitespace"]
)
def test_served_tokenizer_splits_digits_and_punctuation_as_tokenizer_json(
    text: str, tok: Any, raw: Any
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
