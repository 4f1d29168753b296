"""Incremental detokenization (`IncrementalDetokenizer`): token ids → text pieces, with
OpenAI stop strings cut out.

Decoding uses the `tokenizers` library's `DecodeStream` (Rust; O(1) amortised per token, holds
back the bytes of a UTF-8 character split across tokens instead of emitting U+FFFD), the way
vLLM's `FastIncrementalDetokenizer` does (vllm/v1/engine/detokenizer.py). Stop-string handling
follows vLLM's `check_stop_strings`: the stop string and everything after it are dropped, the
earliest-completing stop string wins, and nothing of a possible stop string is released early.

Output is a list of *pieces* `(text, token_ids)`: the text of one or more whole tokens with the
ids it came from, so that the parser can match markers by id and the caller can count tokens
per parser state (reasoning tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

Piece = tuple[str, list[int]]
"""`(text, token_ids)`: text decoded from whole tokens, and those tokens' ids."""

# DecodeStream only needs a few tokens of left context (a leading-space rule of some decoders);
# priming it with the whole prompt would copy a 100k-token list per request for nothing.
_PROMPT_CONTEXT_TOKENS = 8
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """The incremental detokenizer of one request: token ids in, text deltas out (`Piece`s).

    O(1) amortised per token via `tokenizers.DecodeStream`: each token is decoded once, with
    a few tokens of left context, never the whole output again. The bytes of a multi-byte
    character split across tokens are held back until it is whole, so no delta carries
    U+FFFD. Stop strings are cut as vLLM does: the stop string and everything after it are
    dropped, the earliest-completing one wins, and the last (longest stop string − 1)
    characters are held back, as they could begin one. In the `Generation`'s line of stages
    it is the detokenize stage. Not thread-safe.

    Args:
        backend: the fast `tokenizers.Tokenizer`.
        prompt_ids: the prompt's token ids (its tail primes the decoder).
        stop: stop strings (empty strings are ignored); matched on the decoded output text.
        min_tokens: stop strings are not matched in text of the first `min_tokens` tokens
            (vLLM's rule, https://github.com/vllm-project/vllm/pull/22014).
        include_stop: a matched stop string stays at the end of the text (vLLM's
            `include_stop_str_in_output`); what follows it is still dropped.
        skip_special_tokens: special tokens decode to no text (their ids still go out with
            the next piece).

    Attributes:
        stopped: the stop string that ended the output, or None.
        tokens: output tokens consumed so far, those after a matched stop string excluded.
    """

    __slots__ = (
        "_backend",
        "_check_from",
        "_held",
        "_held_text_len",
        "_include_stop",
        "_max_stop",
        "_min_tokens",
        "_pending",
        "_skip_special",
        "_stop",
        "_stream",
        "_text_len",
        "stopped",
        "tokens",
    )

    def __init__(
        self,
        backend: Any,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = False,
    ) -> None:
        self._backend = backend
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._include_stop = include_stop
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._check_from = 0 if min_tokens <= 0 else -1  # text offset where matching starts
        self._pending: list[int] = []  # ids whose bytes do not form a whole character yet
        self._held: list[Piece] = []  # pieces that could still be part of a stop string
        self._held_text_len = 0
        self._text_len = 0  # characters decoded so far (released + held)
        self.stopped: str | None = None
        self.tokens = 0

    def push(self, token_ids: Sequence[int], *, hide_last: bool = False) -> list[Piece]:
        """Consumes new output tokens; returns the pieces that are safe to show now.

        Args:
            token_ids: the new ids of one engine increment.
            hide_last: the last id is an end-of-sequence / stop token: count it, but do not
                decode it (OpenAI's output never shows `<|im_end|>`).

        After a stop string matched (`stopped` set) further calls return nothing.
        """
        if self.stopped is not None:
            return []
        out: list[Piece] = []
        last = len(token_ids) - 1
        for k, tid in enumerate(token_ids):
            self.tokens += 1
            if hide_last and k == last:
                break
            text = self._step(tid)
            if text is None:
                self._pending.append(tid)
                continue
            if self._pending:
                ids = self._pending
                ids.append(tid)
                self._pending = []
            else:
                ids = [tid]
            if not self._stop:
                out.append((text, ids))
                continue
            if self._check_from < 0 and self.tokens > self._min_tokens:
                self._check_from = self._text_len
            self._text_len += len(text)
            self._held.append((text, ids))
            self._held_text_len += len(text)
            if self._check_from >= 0 and self._match(out):
                return out
            self._release(out, keep=self._max_stop - 1)
        return out

    def finish(self) -> list[Piece]:
        """End of output: releases held text. Bytes of an incomplete character are dropped,
        as vLLM does (a stream cut inside a character has no text for it)."""
        out: list[Piece] = []
        if self.stopped is None:
            self._release(out, keep=0)
        self._pending = []
        return out

    # -- internals -----------------------------------------------------------------------------

    def _step(self, tid: int) -> str | None:
        try:
            return self._stream.step(self._backend, tid)  # type: ignore[no-any-return]
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # tokenizers can produce non-monotonic UTF-8 on odd byte sequences, which breaks
            # DecodeStream's state; vLLM resets it (vllm-project/vllm#17448).
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            return self._stream.step(self._backend, tid)  # type: ignore[no-any-return]

    def _release(self, out: list[Piece], keep: int) -> None:
        """Moves held pieces to `out` while at least `keep` characters stay held."""
        held = self._held
        n = 0
        remaining = self._held_text_len
        while n < len(held) and remaining - len(held[n][0]) >= keep:
            remaining -= len(held[n][0])
            n += 1
        if n:
            out.extend(held[:n])
            del held[:n]
            self._held_text_len = remaining

    def _match(self, out: list[Piece]) -> bool:
        """Looks for a stop string in the held text; on a match, releases the text before it."""
        held_text = "".join(p[0] for p in self._held)
        base = self._text_len - len(held_text)  # absolute offset of held_text[0]
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stop:
            start = held_text.find(s)
            while start != -1 and base + start + len(s) <= self._check_from:
                start = held_text.find(s, start + 1)
            if start != -1 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start, s)
        if best is None:
            return False
        end, start, stop = best
        if self._include_stop:
            start = end
        # Release whole pieces before the stop string, then the cut piece's head (with its ids,
        # so a marker's id is never lost).
        for text, ids in self._held:
            if start <= 0:
                break
            if len(text) <= start:
                out.append((text, ids))
            else:
                out.append((text[:start], ids))
            start -= len(text)
        self._held = []
        self._held_text_len = 0
        self.stopped = stop
        return True
