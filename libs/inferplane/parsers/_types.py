"""Value types shared by the parser engine, the Kimi K2 configuration and the validator.

Everything here is a frozen, slotted dataclass so results can be handed across threads
and cached without defensive copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Delta", "ParseResult", "ToolCall", "ToolCallDelta"]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed fragment of a tool call; maps 1:1 onto an OpenAI chunk's ``tool_calls[i]``.

    Attributes:
        index: 0-based position of the call within this response (OpenAI ``index``),
            not the model's conversation-wide counter.
        id: set on the first fragment of a call only: the model's own id, verbatim
            (``functions.get_weather:0``, ``get_weather:0``, ``call_3``), or a generated one:
            ``functions.{name}:{n}`` when a Kimi header held only a name, ``call_{n}`` for
            formats that carry no ids (Qwen3, DeepSeek-V3.1, GLM-4.5); ``n`` counts calls
            across the conversation.
        name: set on the first fragment of a call only: the function name without the
            ``functions.`` prefix.
        arguments: a fragment of the JSON arguments string; the fragments of one call
            concatenate to its full arguments (``"{}"`` when the model gave none).
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class Delta:
    """What one ``feed`` (or ``finish``) call produced; empty strings mean "nothing new".

    Attributes:
        reasoning: new reasoning text (OpenAI ``reasoning_content``).
        content: new visible text.
        tool_calls: new tool-call fragments, at most one per call index, in index order.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when this delta carries nothing a client should see."""
        return not (self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call.

    Attributes:
        id: the model's id, verbatim, or a generated one (see ``ToolCallDelta.id``).
        name: function name without the ``functions.`` prefix.
        arguments: the JSON arguments as the model wrote them, trimmed of surrounding
            whitespace and with the streaming repairs applied (``repairs``); ``"{}"`` when the
            model gave none. Not guaranteed to be valid JSON: see
            ``inferplane.parsers.validate_tool_calls``.
        repairs: what the parser changed in the arguments: ``"trailing_comma"`` (dropped),
            ``"coerced"`` (a string turned into the integer / number / boolean its schema
            declares); empty when they are exactly as written. Not part of equality: a client
            assembling the streamed deltas (``Parser.collect``) never learns them.
    """

    id: str
    name: str
    arguments: str
    repairs: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class ParseResult:
    """The whole output of one response, parsed.

    Attributes:
        reasoning: reasoning text, trimmed ("" when none).
        content: visible text, trimmed ("" when none).
        tool_calls: complete tool calls in response order.
        marker_leaked: True if any format marker string survived into reasoning, content,
            a name or arguments. The parser's contract is that this is always False for
            text-matched markers; with token ids, text that merely spells a marker (not the
            marker token) is kept as text and reported here.
    """

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    marker_leaked: bool = False

    @property
    def reasoning_chars(self) -> int:
        """Number of reasoning characters (the caller counts tokens)."""
        return len(self.reasoning)
