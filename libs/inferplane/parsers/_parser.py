"""``Parser``: a config compiled once (``Tables``), shared by every response; ``start`` opens
one ``Session`` per response, ``parse`` reads a whole output, ``collect`` assembles streamed
deltas the way a client does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from inferplane.parsers._arguments import ToolSet
from inferplane.parsers._config import EngineConfig
from inferplane.parsers._lexer import Tables
from inferplane.parsers._session import Session
from inferplane.parsers._types import Delta, ParseResult, ToolCall

__all__ = ["Parser"]


class Parser:
    """A compiled output format. Immutable and shared; ``start`` one ``Session`` per response.

    Args:
        config: the format.
        vocab: the tokenizer's vocab (``tokenizer.get_vocab()``) or None. When it holds every
            marker, ``feed(..., token_ids=...)`` matches markers by id (ids are looked up
            here, never hard-coded).
        drop: texts of tokens the response never shows besides the format's markers (the
            tokenizer's special tokens and chat markers, e.g. ``<|im_assistant|>``): dropped
            from reasoning and content, data inside arguments (``Tables``).

    Raises:
        ValueError: the config is inconsistent (a programming error, not model output).
    """

    __slots__ = ("_t",)

    def __init__(
        self,
        config: EngineConfig,
        vocab: Mapping[str, int] | None = None,
        drop: Sequence[str] = (),
    ) -> None:
        self._t = Tables(config, vocab, drop)

    @property
    def name(self) -> str:
        """The format's name."""
        return self._t.config.name

    @property
    def config(self) -> EngineConfig:
        """The format's declarative config."""
        return self._t.config

    @property
    def marker_token_ids(self) -> Mapping[str, int]:
        """Marker string -> token id, resolved from the vocab (empty without one)."""
        terms = list(self._t.config.terminals.items())
        return {terms[i][1]: tid for tid, i in self._t.id_to_term.items() if i < len(terms)}

    def start(
        self,
        thinking: bool = True,
        *,
        history_tool_calls: int = 0,
        tool_calls: bool = True,
        tools: Sequence[Mapping[str, Any]] | ToolSet | None = None,
        max_tool_calls: int | None = None,
        constrained: bool = False,
    ) -> Session:
        """Begin parsing one response.

        Args:
            thinking: True when the prompt opened the reasoning block (K2.5's generation
                prompt ends with ``<think>``), so output starts inside reasoning.
            history_tool_calls: tool calls earlier in the conversation; used only to number
                generated ids when the model gives a call without its own ``:N`` counter.
            tool_calls: False parses calls (their text never shows) but emits none and keeps
                none in ``result()``; they are counted in ``dropped_tool_calls`` (OpenAI's
                ``tool_choice: "none"``).
            tools: the request's ``tools`` (OpenAI shape), or None when unknown (names are
                then taken from the headers as written). With tools, names are resolved and
                arguments coerced against them (``CallAssembler``); an empty list means the
                request offered none, which implies ``tool_calls=False``.
            max_tool_calls: calls after this many are dropped (1 for OpenAI's
                ``parallel_tool_calls: false``); None = no limit.
            constrained: the engine decodes calls under a grammar that makes their arguments
                valid JSON (``build_tool_constraint``): a marker inside an open JSON string of
                the arguments is then data (the grammar lets a string hold it), not the end of
                the call. Unconstrained, the marker ends the call (a model that never closed
                its string must not swallow the rest of the output). Constrained, markers are
                also matched by text, not token id: the grammar works on strings, so a marker
                spelled in several tokens is a marker to it (an untrained model does that).
        """
        c = self._t.config
        toolset = tools if isinstance(tools, ToolSet) or tools is None else ToolSet(tools)
        return Session(
            self._t,
            c.thinking_state if thinking else c.initial_state,
            history_tool_calls,
            tool_calls and (toolset is None or bool(toolset)),
            toolset,
            max_tool_calls,
            constrained,
        )

    def parse(
        self,
        text: str,
        thinking: bool = True,
        *,
        token_ids: Sequence[int] | None = None,
        history_tool_calls: int = 0,
        tools: Sequence[Mapping[str, Any]] | ToolSet | None = None,
    ) -> ParseResult:
        """Parse a complete output at once; equal to streaming it in any split."""
        s = self.start(thinking, history_tool_calls=history_tool_calls, tools=tools)
        s.feed(text, token_ids)
        s.finish()
        return s.result()

    def collect(self, deltas: Iterable[Delta]) -> ParseResult:
        """Concatenate streamed deltas into the complete result (what a client assembles)."""
        reasoning: list[str] = []
        content: list[str] = []
        ids: dict[int, str] = {}
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}
        for d in deltas:
            if d.reasoning:
                reasoning.append(d.reasoning)
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls:
                if tc.id is not None:
                    ids[tc.index] = tc.id
                if tc.name is not None:
                    names[tc.index] = tc.name
                args.setdefault(tc.index, []).append(tc.arguments)
        calls = [
            ToolCall(ids.get(i, ""), names.get(i, ""), "".join(args.get(i, ())))
            for i in sorted(set(ids) | set(args))
        ]
        r = "".join(reasoning)
        c = "".join(content)
        return ParseResult(r, c, calls, self.leaks(r, c, calls))

    def leaks(self, reasoning: str, content: str, calls: Sequence[ToolCall]) -> bool:
        """True if any marker string appears in the given output parts."""
        return self._t.leaks(reasoning, content, calls)
