"""A Kimi-sized vocabulary for grammar tests: 163,840 token texts with Kimi K2.5's markers and
special tokens at their K2.5 ids, built in about a second with no training and no download.

Kimi's own tokenizer is not on the test machines. What a grammar's token mask depends on is the
set of token texts: this one has K2.5's size, every single byte, JSON punctuation and digits,
~160k word pieces (with and without a leading space, capitalised), fragments of the markers
(``<``, ``<|``, ``|>``, ``think>``, ``im_end``...), and the 256 ids from 163,584 that Kimi
reserves for special tokens: the named ones at the ids K2.5's tokenizer gives them (its
``tokenizer_config.json``, ``added_tokens_decoder``), ``<|reserved_token_N|>`` elsewhere. A
trained 163k BPE (``bench/kimi_sized_tokenizer.py``) is the benchmarks' vocabulary; this one is
the default suite's.
"""

from __future__ import annotations

import itertools
import string

__all__ = ["KIMI_MARKER_IDS", "KIMI_VOCAB_SIZE", "kimi_sized_vocab", "special_texts"]

KIMI_VOCAB_SIZE = 163_840
FIRST_SPECIAL_ID = 163_584

# K2.5's named special tokens and markers (ids as the K2.5 tokenizer has them).
KIMI_MARKER_IDS: dict[str, int] = {
    "[BOS]": 163_584,
    "[EOS]": 163_585,
    "<|im_end|>": 163_586,
    "<|im_user|>": 163_587,
    "<|im_assistant|>": 163_588,
    "<|im_system|>": 163_594,
    "<|tool_calls_section_begin|>": 163_595,
    "<|tool_calls_section_end|>": 163_596,
    "<|tool_call_begin|>": 163_597,
    "<|tool_call_argument_begin|>": 163_598,
    "<|tool_call_end|>": 163_599,
    "<|im_middle|>": 163_601,
    "<think>": 163_606,
    "</think>": 163_607,
}

_FRAGMENTS = (
    "<",
    ">",
    "</",
    "<|",
    "|>",
    "|",
    "think",
    "think>",
    " think",
    "im_end",
    "tool_call",
    "_begin",
    "_end",
    "<br>",
    "<div>",
    "</div>",
    "->",
    "<=",
    ">=",
    "<<",
    ">>",
)
_PUNCT = ('"', '":', '": "', '", "', '{"', '"}', "{", "}", "[", "]", ", ", ": ", "\\n", "\\")
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def special_texts() -> list[str]:
    """The texts of the 256 special ids (named markers and reserved tokens)."""
    named = {tid: text for text, tid in KIMI_MARKER_IDS.items()}
    return [
        named.get(tid, f"<|reserved_token_{tid}|>")
        for tid in range(FIRST_SPECIAL_ID, KIMI_VOCAB_SIZE)
    ]


def kimi_sized_vocab() -> list[str]:
    """163,840 distinct token texts, index = token id (deterministic)."""
    seen: set[str] = set()
    out: list[str] = []

    def add(text: str) -> None:
        if text not in seen and len(out) < FIRST_SPECIAL_ID:
            seen.add(text)
            out.append(text)

    for b in range(256):
        add(chr(b))  # every byte, as a one-character text
    for text in (*_PUNCT, *_FRAGMENTS, *(str(i) for i in range(1000))):
        add(text)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS] + list(_VOWELS)
    for size in (1, 2, 3):
        for parts in itertools.product(syllables, repeat=size):
            word = "".join(parts)
            for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
                add(form)
            if len(out) >= FIRST_SPECIAL_ID:
                break
        if len(out) >= FIRST_SPECIAL_ID:
            break
    filler = (
        "".join(p)
        for n in itertools.count(4)
        for p in itertools.product(string.ascii_lowercase, repeat=n)
    )
    while len(out) < FIRST_SPECIAL_ID:
        add(next(filler))
    return out + special_texts()
