"""The errors of inferplane.chat: `ChatRenderError` (the client's) and `UnknownChatFamilyError`
(the deployment's)."""

from __future__ import annotations


class ChatRenderError(ValueError):
    """The chat request cannot be rendered: a client error, an OpenAI ``400 invalid_request_error``.

    ``str(error)`` is a message fit to show to the client; ``param`` names the offending field in
    OpenAI's style (``messages[3].tool_call_id``) or is None when no single field is at fault.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        """The OpenAI error type this maps to."""
        return "invalid_request_error"


class UnknownChatFamilyError(LookupError):
    """No chat family is known for a parser name: a deployment error, not the client's.

    Attributes:
        name: the name asked for.
        known: the names that are known, sorted.
    """

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(f"no chat rendering for parser {name!r}; known: {', '.join(known)}")
        self.name = name
        self.known = known
