"""The session: one response's walk through a config's state machine, and the response
assembled so far.

``Session`` owns a ``Lexer`` (text and marker events), a ``CallAssembler`` (the tool calls) and
the reasoning / content channels. Rules that hold for every config (they are what makes the
output safe to stream):

* A marker never reaches reasoning, content or a name. A marker with no transition from the
  current state is dropped, never emitted as text, except in a ``verbatim_states`` state
  (arguments), where it is data (``{"text": "</think>"}``) and stays.
* Reasoning and content are trimmed at both ends; trailing whitespace is held back until
  more text proves it is inner whitespace. Arguments are trimmed the same way.
* Feeding costs amortised O(len(delta)) and never raises on model output: whatever the
  split, it yields the same concatenated result as parsing the whole output at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferplane.parsers._arguments import ToolSet
from inferplane.parsers._calls import CallAssembler
from inferplane.parsers._config import Action, Sink
from inferplane.parsers._lexer import Lexer, Tables
from inferplane.parsers._trim import Trim
from inferplane.parsers._types import Delta, ParseResult, ToolCallDelta

__all__ = ["Session"]


class Session:
    """Incremental parsing state of one response, and the response assembled so far. Not
    thread-safe; one per request.

    Create with ``Parser.start``. Call ``feed`` for every detokenized delta and ``finish``
    once at the end of the stream. Neither raises on any model output. ``result()``,
    ``reasoning_tokens`` and ``dropped_tool_calls`` describe the whole response: the caller
    keeps no copy of its own.
    """

    __slots__ = (
        "_all_content",
        "_all_reasoning",
        "_calls",
        "_constrained",
        "_content",
        "_finished",
        "_lexer",
        "_out_c",
        "_out_r",
        "_reasoning",
        "_reasoning_tokens",
        "_result",
        "_routed",
        "_sink",
        "_state",
        "_t",
    )

    def __init__(
        self,
        tables: Tables,
        state: str,
        history_tool_calls: int,
        tool_calls: bool = True,
        tools: ToolSet | None = None,
        max_tool_calls: int | None = None,
        constrained: bool = False,
    ) -> None:
        self._t = tables
        self._state = state
        self._sink = tables.sinks[state]
        self._lexer = Lexer(tables, constrained)
        self._calls = CallAssembler(tables, history_tool_calls, tool_calls, tools, max_tool_calls)
        self._reasoning = Trim()
        self._content = Trim()
        self._finished = False
        self._out_r: list[str] = []
        self._out_c: list[str] = []
        # The whole response (appended once per delta; joined by ``result``).
        self._reasoning_tokens = 0
        self._all_reasoning: list[str] = []
        self._all_content: list[str] = []
        self._result: ParseResult | None = None
        self._constrained = constrained
        self._routed = False  # a routing format (``EngineConfig.route``) has routed a message

    # -- public -----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """The machine's current state (for diagnostics and tests)."""
        return self._state

    @property
    def reasoning_tokens(self) -> int:
        """Token ids fed while the machine was in a reasoning state (OpenAI's
        ``completion_tokens_details.reasoning_tokens``). A feed counts all its ids when it
        starts in reasoning, so the marker that ends reasoning (``</think>``) is included;
        with one token per feed (the replica process's case) the count is exact. Feeds without
        ids count nothing."""
        return self._reasoning_tokens

    @property
    def dropped_tool_calls(self) -> int:
        """Calls the model made that the response does not carry: all of them when the session
        was started with ``tool_calls=False``, those beyond ``max_tool_calls``, and, with
        tools, those whose header named no declared function that their arguments resolve."""
        return self._calls.dropped

    def result(self) -> ParseResult:
        """The response so far, assembled: what ``Parser.collect`` makes of every delta this
        session returned (calls dropped by ``tool_calls=False`` excluded), with the leak check.
        Costs O(output) the first time after new output, O(1) when nothing changed."""
        if self._result is not None:
            return self._result
        reasoning = _joined(self._all_reasoning)
        content = _joined(self._all_content)
        calls = self._calls.calls()
        result = ParseResult(reasoning, content, calls, self._t.leaks(reasoning, content, calls))
        if self._finished:
            self._result = result  # nothing can change any more
        return result

    def feed(self, text: str, token_ids: Sequence[int] | None = None) -> Delta:
        """Consume one detokenized delta.

        Args:
            text: the new text (any length, any split, markers included as text).
            token_ids: the ids this delta's text came from, or None. When given and the
                parser has a vocab holding every marker, a marker string counts as a marker
                only if its token id was seen (text merely spelling a marker stays text).
                Ids are credits consumed in text order: if one delta holds both a spelled
                marker and the real marker token of the same kind, the first occurrence wins
                (deltas of one token, the replica process's case, are exact). Under a grammar
                (``constrained``) markers are matched as text (``Lexer``).

        Returns:
            What became visible: reasoning / content text and tool-call fragments.
        """
        if self._finished:
            return Delta()
        if token_ids is not None and self._sink is Sink.REASONING:
            self._reasoning_tokens += len(token_ids)
        self._lexer.feed(text, token_ids, self)
        return self._collect()

    def finish(self) -> Delta:
        """End of stream: flush held-back text, close an open call, drop trailing whitespace.

        A call whose header never completed (no arguments marker, no end marker) is dropped:
        its name may be truncated. A call cut inside its arguments keeps what was streamed.
        """
        if self._finished:
            return Delta()
        held = self._lexer.flush()
        if held:
            self._on_text(held)
        if not self._routed and self._t.config.route is not None and self._sink is Sink.HEADER:
            self._unrouted_output()
        self._calls.finish()
        self._reasoning.pending.clear()
        self._content.pending.clear()
        self._finished = True
        return self._collect()

    # -- lexer events (``LexerEvents``) -----------------------------------------------------

    def _on_marker(self, term: int, literal: str) -> None:
        """A marker: take the current state's transition for it and run its actions."""
        tr = self._t.transitions.get((self._state, term))
        calls = self._calls
        if self._constrained and self._state in self._t.verbatim and calls.in_json_string():
            tr = None  # a constrained call's JSON string holds the marker as data
        if tr is None:
            if self._state in self._t.verbatim:
                self._on_text(literal)  # data here (a JSON string holding "</think>")
            return  # a marker with no meaning here is dropped, never shown
        nxt = tr.next_state
        for action in tr.actions:
            if action is Action.END_REASONING:
                self._reasoning.pending.clear()
            elif action is Action.BEGIN_TOOLS:
                self._content.pending.clear()
            elif action is Action.BEGIN_CALL:
                calls.begin_call()
            elif action is Action.BEGIN_ARGS:
                calls.begin_args()
            elif action is Action.END_CALL:
                calls.end_call()
            elif action is Action.BEGIN_KEY:
                calls.begin_key()
            elif action is Action.BEGIN_VALUE:
                calls.begin_value()
            elif action is Action.END_VALUE:
                calls.end_value()
            elif action is Action.BEGIN_MESSAGE:
                calls.begin_message(literal)
            elif action is Action.ROUTE:
                nxt = self._route()
        self._state = nxt
        self._sink = self._t.sinks[nxt]

    def _on_text(self, s: str) -> None:
        """Plain text: to the current state's sink."""
        sink = self._sink
        if sink is Sink.REASONING:
            piece = self._reasoning.push(s)
            if piece:
                self._out_r.append(piece)
        elif sink is Sink.CONTENT:
            piece = self._content.push(s)
            if piece:
                self._out_c.append(piece)
            nxt = self._t.text_transitions.get(self._state)
            if nxt is not None and self._content.started:
                self._state = nxt
                self._sink = self._t.sinks[nxt]
        elif sink is Sink.ARGS:
            self._calls.args(s)
        elif sink is Sink.HEADER:
            self._calls.header.append(s)
        elif sink is Sink.ARG_VALUE:
            self._calls.arg_value(s)
        elif sink is Sink.BODY:
            self._calls.body(s)
        elif sink is Sink.ARG_KEY:
            self._calls.key.append(s)
        else:
            nxt = self._t.text_transitions.get(self._state)
            if nxt is not None and s.strip():
                self._state = nxt
                self._sink = self._t.sinks[nxt]

    # -- routing ----------------------------------------------------------------------------

    def _route(self) -> str:
        """``ROUTE``: the message header is complete; the config's router picks the state its
        body goes to (and opens the call it names)."""
        route = self._t.config.route
        assert route is not None  # EngineConfig.check
        nxt, call = route(self._calls.take_header())
        self._routed = True
        sink = self._t.sinks[nxt]
        if sink is Sink.REASONING and self._reasoning.started:
            self._reasoning.pending.append("\n")  # released only if more text follows
        elif sink is Sink.CONTENT and self._content.started:
            self._content.pending.append("\n")
        if call is not None:
            self._calls.open_named(call)
        return nxt

    def _unrouted_output(self) -> None:
        """A routing format's output ended before any message header was complete: text that
        holds no marker is the model answering without the format (SGLang's harmony detector
        returns it as normal text), so it is content; a cut-off header stays dropped."""
        text = self._calls.take_header()
        if text and self._t.marker_re.search(text) is None:
            piece = self._content.push(text)
            if piece:
                self._out_c.append(piece)

    # -- output -----------------------------------------------------------------------------

    def _collect(self) -> Delta:
        r = self._out_r
        c = self._out_c
        calls = self._calls.out
        if not (r or c or calls):
            return Delta()
        reasoning = content = ""
        if r:
            reasoning = r[0] if len(r) == 1 else "".join(r)
            self._all_reasoning.append(reasoning)
            self._out_r = []
        if c:
            content = c[0] if len(c) == 1 else "".join(c)
            self._all_content.append(content)
            self._out_c = []
        tool_calls: list[ToolCallDelta] = self._calls.take() if calls else []
        return Delta(reasoning, content, tool_calls)


def _joined(parts: list[str]) -> str:
    """``"".join(parts)``, leaving ``parts`` as that one string (a second join is O(1))."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""
