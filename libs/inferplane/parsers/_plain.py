"""The session of a response that has no output format: every delta is content, verbatim."""

from __future__ import annotations

from collections.abc import Sequence

from inferplane.parsers._types import Delta, ParseResult

__all__ = ["PlainSession"]


class PlainSession:
    """``Session``'s surface for output with no parser (a text completion, or a model deployed
    without one): each fed text is content as is (not trimmed), nothing is reasoning, no
    markers, no tool calls. Not thread-safe; one per request."""

    __slots__ = ("_content", "_finished")

    reasoning_tokens = 0
    dropped_tool_calls = 0

    def __init__(self) -> None:
        self._content: list[str] = []
        self._finished = False

    def feed(self, text: str, token_ids: Sequence[int] | None = None) -> Delta:
        """``text`` as content (``token_ids`` are not needed)."""
        if self._finished or not text:
            return Delta()
        self._content.append(text)
        return Delta(content=text)

    def finish(self) -> Delta:
        """End of stream (nothing is ever held back)."""
        self._finished = True
        return Delta()

    def result(self) -> ParseResult:
        """The content so far (O(1) when nothing was fed since the last call)."""
        parts = self._content
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return ParseResult("", parts[0] if parts else "", [])
