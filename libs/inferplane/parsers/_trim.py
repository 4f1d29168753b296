"""``Trim``: one text channel (reasoning, content, a call's arguments) trimmed while streaming."""

from __future__ import annotations

__all__ = ["Trim"]


class Trim:
    """Trims a text channel at both ends while streaming: leading whitespace is dropped,
    trailing whitespace is held until non-whitespace follows (then released) or the
    channel ends (then dropped). ``push`` returns what may be emitted now.

    Attributes:
        started: non-whitespace text has been emitted.
        pending: trailing whitespace held back (cleared by the owner when the channel ends).
    """

    __slots__ = ("pending", "started")

    def __init__(self) -> None:
        self.started = False
        self.pending: list[str] = []

    def push(self, s: str) -> str:
        """The part of ``s`` (with any held whitespace before it) that may be emitted now;
        ``""`` when it is all whitespace so far."""
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        body = s.rstrip()
        if not body:
            self.pending.append(s)
            return ""
        tail = s[len(body) :] if len(body) != len(s) else ""
        if self.pending:
            body = "".join(self.pending) + body
            self.pending.clear()
        if tail:
            self.pending.append(tail)
        return body
