"""The incremental detokenizer and stop-string matcher, on the real fixture tokenizer."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.replica.pipeline.detokenize import IncrementalDetokenizer
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_ids

TEXT = "Größe: 日本語のテキスト 😀🎉 </think> café <|tool_call_begin|> done"


def _detokenizer(stop: tuple[str, ...] = (), min_tokens: int = 0) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(kimi_tiny_assets().backend, kimi_tiny_ids("Hi"), stop, min_tokens)


def _run(
    detokenizer: IncrementalDetokenizer, ids: list[int], sizes: list[int]
) -> list[tuple[str, list[int]]]:
    pieces = []
    i = 0
    for n in sizes:
        pieces += detokenizer.push(ids[i : i + n])
        i += n
        if i >= len(ids):
            break
    if i < len(ids):
        pieces += detokenizer.push(ids[i:])
    return pieces + detokenizer.finish()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=80))
def test_any_increment_split_gives_the_text_without_replacement_characters(
    sizes: list[int],
) -> None:
    """Whatever the increments, the pieces join to the exact text, no piece holds U+FFFD, and
    every id appears exactly once, with the text it produced (markers whole, with their id)."""
    ids = kimi_tiny_ids(TEXT)
    pieces = _run(_detokenizer(), ids, sizes)
    assert "".join(p[0] for p in pieces) == TEXT
    assert all("\ufffd" not in p[0] for p in pieces)
    assert [i for p in pieces for i in p[1]] == ids
    vocab = kimi_tiny_assets().tokenizer.get_vocab()
    marker_id = vocab["<|tool_call_begin|>"]
    assert any(marker_id in p[1] and "<|tool_call_begin|>" in p[0] for p in pieces)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=60), st.sampled_from(["テキ", "é <", "😀"]))
def test_stop_string_cuts_the_text_at_its_first_occurrence(sizes: list[int], stop: str) -> None:
    """The text ends right before the first stop string, wherever token boundaries fall (the
    stop text may span tokens and increments); the stop is reported; nothing of it leaks."""
    detokenizer = _detokenizer(stop=(stop, "never-there"))
    pieces = _run(detokenizer, kimi_tiny_ids(TEXT), sizes)
    assert "".join(p[0] for p in pieces) == TEXT[: TEXT.index(stop)]
    assert detokenizer.stopped == stop


def test_earliest_completing_stop_wins_and_later_pushes_are_ignored() -> None:
    """With several stop strings in one increment the one that completes first wins (vLLM's
    rule); after a stop nothing more comes out, and tokens after it are not counted."""
    ids = kimi_tiny_ids("abc def ghi jkl")
    detokenizer = _detokenizer(stop=("ghi", "def"))
    pieces = detokenizer.push(ids) + detokenizer.push(ids) + detokenizer.finish()
    assert "".join(p[0] for p in pieces) == "abc "
    assert detokenizer.stopped == "def"
    assert detokenizer.tokens < len(ids)


def test_min_tokens_delays_stop_matching() -> None:
    """A stop string that ends within the first min_tokens tokens does not count (vLLM's
    min_tokens rule; one that ends after them does, wherever it starts)."""
    ids = kimi_tiny_ids("stop here, then stop again")  # st|o|p| |her|e|,| the|n| |st|o|p...
    detokenizer = _detokenizer(stop=("stop",), min_tokens=4)
    pieces = [p for i in ids for p in detokenizer.push([i])] + detokenizer.finish()
    assert "".join(p[0] for p in pieces) == "stop here, then "


def test_hidden_last_token_is_counted_not_shown() -> None:
    """The final eos token counts as a completion token but never appears in the text."""
    ids = kimi_tiny_ids("done<|im_end|>")
    detokenizer = _detokenizer()
    pieces = detokenizer.push(ids, hide_last=True) + detokenizer.finish()
    assert "".join(p[0] for p in pieces) == "done"
    assert detokenizer.tokens == len(ids)


def test_cost_per_token_is_flat() -> None:
    """Decoding 4k and 16k tokens costs the same per token within noise (O(1) amortised): no
    re-decoding of the output so far, even with stop strings held back."""
    import time

    words = " ".join(
        random.Random(0).choice(["alpha", "日本", "beta😀", "gamma"]) for _ in range(9000)
    )
    ids = kimi_tiny_ids(words)

    def per_token(n: int) -> float:
        detokenizer = _detokenizer(stop=("zzzz-not-there",))
        start = time.perf_counter()
        for i in ids[:n]:
            detokenizer.push([i])
        return (time.perf_counter() - start) / n

    per_token(2000)  # warm up
    small = min(per_token(4000) for _ in range(3))
    large = min(per_token(16000) for _ in range(3))
    assert len(ids) >= 16000
    assert large < small * 2.0, (small, large)
