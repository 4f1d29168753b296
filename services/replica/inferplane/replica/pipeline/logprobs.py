"""Log probabilities in OpenAI's shapes (`choices[].logprobs`).

Chat (OpenAI's ChatCompletion `logprobs`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}`, one entry per
generated token the response shows (reasoning and tool-call tokens included, as vLLM does;
a hidden end-of-sequence token has none).

Text completions (OpenAI's legacy Completion `logprobs`): `{"tokens": [...],
"token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}`,
the offsets counting characters of the choice's text from its start (the echoed prompt
included), continued across streamed chunks.

A token's text is its id decoded alone (a byte-level token that is part of a UTF-8 character
decodes to U+FFFD, as in vLLM; `bytes` are that text's UTF-8), or "token_id:{id}" with vLLM's
`return_tokens_as_token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import struct_pb2

from inferplane.replica.engines.base import TokenLogprob


class TokenText:
    """Token id → its text for logprobs, cached per request.

    Args:
        backend: the fast `tokenizers.Tokenizer` of the model.
        as_ids: write tokens as "token_id:{id}" (vLLM's `return_tokens_as_token_ids`).
    """

    __slots__ = ("_as_ids", "_backend", "_cache")

    def __init__(self, backend: Any, as_ids: bool = False) -> None:
        self._backend = backend
        self._as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._as_ids:
                text = f"token_id:{token_id}"
            else:
                text = self._backend.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _value(obj: dict[str, Any]) -> struct_pb2.Value:
    value = struct_pb2.Value()
    value.struct_value.update(obj)
    return value


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> struct_pb2.Value:
    """OpenAI's chat `logprobs` object for `entries` (see the module docstring)."""
    content = []
    for entry in entries:
        token = text(entry.token_id)
        content.append(
            {
                "token": token,
                "logprob": entry.logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (t := text(tid)), "logprob": lp, "bytes": list(t.encode())}
                    for tid, lp in entry.top
                ],
            }
        )
    return _value({"content": content, "refusal": None})


class CompletionLogprobs:
    """Builds a text completion choice's `logprobs` objects, keeping the text offset across
    streamed chunks.

    Args:
        text: the token texts.
        offset: the characters before the first generated token (the echoed prompt's).
    """

    __slots__ = ("_offset", "_text")

    def __init__(self, text: TokenText, offset: int = 0) -> None:
        self._text = text
        self._offset = offset

    def build(self, entries: Sequence[TokenLogprob]) -> struct_pb2.Value:
        """The `logprobs` object of `entries`, the next tokens of the choice."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        text = self._text
        for entry in entries:
            token = text(entry.token_id)
            tokens.append(token)
            token_logprobs.append(entry.logprob)
            top.append({text(tid): lp for tid, lp in entry.top})
            offsets.append(self._offset)
            self._offset += len(token)
        return _value(
            {
                "tokens": tokens,
                "token_logprobs": token_logprobs,
                "top_logprobs": top,
                "text_offset": offsets,
            }
        )
