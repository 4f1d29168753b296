"""One generic streaming state machine for reasoning + tool-call output formats.

A model format is a frozen, declarative ``EngineConfig``: terminals (marker strings, also
matched by token id when a vocab is given), ``transitions[(state, terminal)] = Transition(
next_state, actions)``, where each state's plain text goes (its ``Sink``), and an initial
state. ``Parser`` compiles the config once; ``Session`` holds one response's state. The
shape follows vLLM's ``vllm/parser/engine`` (config over machine); the code is our own.

Rules that hold for every config (they are what makes the output safe to stream):

* A marker never reaches reasoning, content or a name. A marker with no transition from the
  current state is dropped, never emitted as text, except in a ``verbatim_states`` state
  (arguments), where it is data (``{"text": "</think>"}``) and stays.
* Text that could be the start of a marker at the end of a delta is held back until the
  next delta resolves it (at most ``max(len(marker)) - 1`` characters); ``finish`` flushes it.
* Reasoning and content are trimmed at both ends; trailing whitespace is held back until
  more text proves it is inner whitespace. Arguments are trimmed the same way.
* Feeding costs amortised O(len(delta)): the buffer is never rescanned.
* Feeding never raises on model output: whatever the split, it yields the same
  concatenated result as parsing the whole output at once.

With the request's tools (``Parser.start(tools=...)``), calls are checked against them as they
stream: a header naming a function (``functions.{name}:{n}``, or a declared name) streams at
once, its arguments coerced to the declared schema (``ArgumentsStream``); any other header (a
bare counter, a client-style id) is held until its arguments end and resolved from the tools
(``ToolSet.resolve``), or dropped, never invented. Ids are the model's own, verbatim; a format
without ids gets ``call_{n}`` (``split_name_header``).

How a call's arguments are written is the config's ``arguments_format`` (the one per-family
strategy the machine does not express with markers):

* ``JSON`` (Kimi, DeepSeek): ``ARGS`` text is the JSON arguments, streamed through
  ``ArgumentsStream``.
* ``KEY_VALUE`` (GLM): parameter names (``ARG_KEY`` text) and raw values (``ARG_VALUE`` text)
  between markers; the engine writes the JSON object, streaming string values as they come
  and decoding a value whose declared type is not string when it ends
  (``ToolSchema.json_valued``).
* ``ENVELOPE`` (Qwen / hermes): the whole ``BODY`` is one JSON object ``{"name": ...,
  "arguments": ...}``; the call opens when its name is read (``JsonEnvelope``) and the
  ``arguments`` value streams like ``JSON`` arguments.

A format whose markers do not say what a message is (gpt-oss's harmony: the channel and the
recipient are words in a header, ``<|channel|>commentary to=functions.f<|message|>``) routes
instead: ``BEGIN_MESSAGE`` starts buffering a header, ``ROUTE`` hands the whole header to
``EngineConfig.route``, which names the next state and, for a call, its name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from json.encoder import encode_basestring
from typing import Any

from inferplane.parsers._arguments import ArgumentsStream, ToolSet, decode_json_value
from inferplane.parsers._envelope import JsonEnvelope
from inferplane.parsers._syntax import CallSyntax
from inferplane.parsers._types import Delta, ParseResult, ToolCall, ToolCallDelta

__all__ = [
    "GENERATED_ID_PREFIX",
    "Action",
    "ArgumentsFormat",
    "EngineConfig",
    "HeaderSplitter",
    "MessageRouter",
    "Parser",
    "Session",
    "Sink",
    "Transition",
    "split_name_header",
]

GENERATED_ID_PREFIX = "call_"


class Sink(Enum):
    """Where the plain text (not a marker) seen in a state goes."""

    REASONING = "reasoning"
    CONTENT = "content"
    HEADER = "header"  # a tool call's header (id / name), buffered until complete
    ARGS = "args"  # a tool call's arguments, streamed
    DROP = "drop"  # e.g. whitespace between calls, text after the tool section
    ARG_KEY = "arg_key"  # a parameter name (``KEY_VALUE`` arguments), buffered
    ARG_VALUE = "arg_value"  # a parameter's raw value (``KEY_VALUE`` arguments)
    BODY = "body"  # a whole call as one JSON object (``ENVELOPE`` arguments)


class Action(Enum):
    """Side effects a transition runs, in order, before entering its next state."""

    END_REASONING = "end_reasoning"  # trailing reasoning whitespace is dropped
    BEGIN_TOOLS = "begin_tools"  # trailing content whitespace before the calls is dropped
    BEGIN_CALL = "begin_call"  # start buffering a new call's header
    BEGIN_ARGS = "begin_args"  # header complete: emit the call's id and name
    END_CALL = "end_call"  # close the call; arguments default to ``empty_arguments``
    BEGIN_KEY = "begin_key"  # start buffering a parameter name (``KEY_VALUE``)
    BEGIN_VALUE = "begin_value"  # the name is complete: write it, open its value
    END_VALUE = "end_value"  # close the value (decoded when its declared type is not string)
    BEGIN_MESSAGE = "begin_message"  # start buffering a message header; the marker is kept in it
    ROUTE = "route"  # the header is complete: ``EngineConfig.route`` picks the next state


class ArgumentsFormat(Enum):
    """How a call's arguments are written (module docstring)."""

    JSON = "json"  # ``ARGS`` text is the JSON arguments (Kimi, DeepSeek)
    KEY_VALUE = "key_value"  # ``ARG_KEY`` / ``ARG_VALUE`` pairs (GLM)
    ENVELOPE = "envelope"  # ``BODY``: ``{"name": ..., "arguments": ...}`` (Qwen, hermes)


@dataclass(frozen=True, slots=True)
class Transition:
    """What a terminal does in a state: move to ``next_state`` after running ``actions``."""

    next_state: str
    actions: tuple[Action, ...] = ()


MessageRouter = Callable[[str], "tuple[str, str | None]"]
"""``raw_message_header -> (next_state, call_header)`` for ``Action.ROUTE``: the state the
message's body goes to and, when the message is a tool call, the header handed to
``split_header`` (None otherwise). The header holds the text and the markers seen since the
``BEGIN_MESSAGE`` marker, that marker included."""

HeaderSplitter = Callable[[str, int], "tuple[str, str] | None"]
"""``(raw_header, call_number) -> (id, name)``, or None when the header names no function.

``call_number`` is the conversation-wide number to use when the model gave no id."""


def split_name_header(header: str, call_number: int) -> tuple[str, str] | None:
    """The `HeaderSplitter` of formats whose header is the function name alone and whose calls
    carry no id (DeepSeek, GLM, Qwen): ``(f"call_{call_number}", name)``, or None when the
    header is blank.

    The id is deterministic, unlike vLLM's random ``chatcmpl-tool-{uuid}`` (``make_tool_call_id``)
    and SGLang's ``call_{uuid}``: a parse must equal its streaming in any split and
    ``Session.result()`` what the client assembles, so an id cannot depend on when it was
    made. ``call_number`` counts calls across the conversation (``history_tool_calls`` plus
    the call's index), so ids stay unique within one conversation, which is what clients key
    tool results by.
    """
    name = header.strip()
    if not name:
        return None
    return f"{GENERATED_ID_PREFIX}{call_number}", name


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Declarative description of one model's output format.

    Attributes:
        name: the format's name (``"kimi_k2"``).
        terminals: terminal name -> marker string. Every marker is also matched by token id
            when the parser is given a vocab holding all of them.
        transitions: ``(state, terminal) -> Transition``; a missing entry drops the marker.
        sinks: state -> where that state's text goes. Every state must have one.
        initial_state: the state a response starts in when the prompt did not open reasoning.
        thinking_state: the state a response starts in when the prompt opened reasoning
            (``start(thinking=True)``).
        text_transitions: state -> next state, taken when non-whitespace text arrives in it
            (e.g. "an explicit ``<think>`` only counts before any content").
        split_header: hook turning a call header into ``(id, name)``.
        empty_arguments: arguments of a call whose model output had none.
        aliases: more marker strings for a terminal (variants seen from the same model
            family: ``◁think▷`` for ``<think>``). Unlike ``terminals``, an alias missing from
            the vocab does not turn token-id matching off: with ids, it is plain text.
        verbatim_states: states whose sink keeps a marker without a transition as text
            (arguments: a JSON string may hold ``</think>``).
        names_function: whether a call header names its function by its form alone (Kimi:
            ``functions.{name}:{n}``), declared or not; with the request's tools, any other
            header (a bare counter, a client-style id) that is not a declared name is an id,
            and the call's function is resolved from its arguments. None: every header names
            its function.
        arguments_format: how a call's arguments are written (``ArgumentsFormat``); it
            decides which argument sinks the states may use.
        call_syntax: how the format writes calls for the decoding constraint
            (``build_tool_constraint``), or None when it has no grammar.
        route: the ``MessageRouter`` that ``Action.ROUTE`` calls (formats that route only).
            A message routed to a reasoning or content state while that channel already has
            text starts on a new line (vLLM's harmony parse joins messages with ``\n``).
    """

    name: str
    terminals: Mapping[str, str]
    transitions: Mapping[tuple[str, str], Transition]
    sinks: Mapping[str, Sink]
    initial_state: str
    thinking_state: str
    split_header: HeaderSplitter
    text_transitions: Mapping[str, str] = field(default_factory=dict)
    empty_arguments: str = "{}"
    aliases: Mapping[str, str] = field(default_factory=dict)
    verbatim_states: frozenset[str] = frozenset()
    names_function: Callable[[str], bool] | None = None
    arguments_format: ArgumentsFormat = ArgumentsFormat.JSON
    route: MessageRouter | None = None
    call_syntax: CallSyntax | None = None

    def check(self) -> None:
        """Raise ``ValueError`` if the config refers to undeclared states or terminals."""
        states = set(self.sinks)
        for (state, term), tr in self.transitions.items():
            if state not in states or tr.next_state not in states:
                raise ValueError(f"{self.name}: transition {state}/{term} uses an unknown state")
            if term not in self.terminals:
                raise ValueError(f"{self.name}: transition uses unknown terminal {term!r}")
        for a, b in self.text_transitions.items():
            if a not in states or b not in states:
                raise ValueError(f"{self.name}: text transition {a}->{b} uses an unknown state")
        if self.initial_state not in states or self.thinking_state not in states:
            raise ValueError(f"{self.name}: unknown initial state")
        if any(not lit for lit in [*self.terminals.values(), *self.aliases]):
            raise ValueError(f"{self.name}: empty marker")
        for lit, term in self.aliases.items():
            if term not in self.terminals:
                raise ValueError(f"{self.name}: alias {lit!r} of unknown terminal {term!r}")
        if not self.verbatim_states <= states:
            raise ValueError(f"{self.name}: unknown verbatim state")
        used = set(self.sinks.values())
        fmt = self.arguments_format
        if Sink.BODY in used and fmt is not ArgumentsFormat.ENVELOPE:
            raise ValueError(f"{self.name}: the BODY sink needs ENVELOPE arguments")
        if used & {Sink.ARG_KEY, Sink.ARG_VALUE} and fmt is not ArgumentsFormat.KEY_VALUE:
            raise ValueError(f"{self.name}: ARG_KEY / ARG_VALUE sinks need KEY_VALUE arguments")
        routes = any(Action.ROUTE in tr.actions for tr in self.transitions.values())
        if routes and self.route is None:
            raise ValueError(f"{self.name}: a ROUTE transition needs a route")


class _Tables:
    """Everything derived from a config once, shared read-only by all sessions."""

    __slots__ = (
        "args_marker_re",
        "config",
        "envelope",
        "first_chars",
        "first_pair",
        "first_re",
        "id_to_term",
        "key_value",
        "literal_to_term",
        "marker_re",
        "max_len",
        "prefixes",
        "sinks",
        "term_index",
        "text_transitions",
        "transitions",
        "verbatim",
    )

    def __init__(self, config: EngineConfig, vocab: Mapping[str, int] | None) -> None:
        config.check()
        self.config = config
        self.key_value = config.arguments_format is ArgumentsFormat.KEY_VALUE
        self.envelope = config.arguments_format is ArgumentsFormat.ENVELOPE
        self.literal_to_term = {lit: term for term, lit in config.terminals.items()}
        self.literal_to_term.update(config.aliases)
        literals = sorted(self.literal_to_term, key=len, reverse=True)
        self.marker_re = re.compile("|".join(re.escape(lit) for lit in literals))
        self.first_chars = "".join(sorted({lit[0] for lit in literals}))
        # One or two first characters ("<", "◁"): two `in` tests beat a regex search.
        pair = self.first_chars * 2 if len(self.first_chars) == 1 else self.first_chars
        self.first_pair = (pair[0], pair[1]) if len(pair) == 2 else None
        self.first_re = re.compile("[" + re.escape(self.first_chars) + "]")
        self.prefixes = frozenset(lit[:i] for lit in literals for i in range(1, len(lit)))
        self.max_len = max(len(lit) for lit in literals)
        terms = list(config.terminals)
        self.term_index = {term: i for i, term in enumerate(terms)}
        # Token-id matching only when every marker resolves: a marker missing from the vocab
        # would otherwise never be matched and would leak as text.
        ids: dict[int, int] = {}
        if vocab:
            for term, lit in config.terminals.items():
                tid = vocab.get(lit)
                if tid is None:
                    ids = {}
                    break
                ids[tid] = self.term_index[term]
        if ids and vocab:
            for lit, term in config.aliases.items():
                tid = vocab.get(lit)
                if tid is not None:
                    ids[tid] = self.term_index[term]
        self.id_to_term = ids
        self.transitions = {
            (state, self.term_index[term]): tr for (state, term), tr in config.transitions.items()
        }
        self.sinks = dict(config.sinks)
        self.text_transitions = dict(config.text_transitions)
        self.verbatim = config.verbatim_states
        # In arguments only the markers that mean something there can never be data.
        in_args = {
            term
            for (state, term), _ in config.transitions.items()
            if state in config.verbatim_states
        }
        args_literals = [lit for lit in literals if self.literal_to_term[lit] in in_args]
        self.args_marker_re = (
            re.compile("|".join(re.escape(lit) for lit in args_literals) or "(?!)")
            if config.verbatim_states
            else self.marker_re
        )

    def leaks(self, reasoning: str, content: str, calls: Sequence[ToolCall]) -> bool:
        """True if a marker string appears in the given output parts (in arguments: one that
        cannot be data there, see ``EngineConfig.verbatim_states``)."""
        search = self.marker_re.search
        if search(reasoning) or search(content):
            return True
        in_args = self.args_marker_re.search
        return any(search(c.id) or search(c.name) or in_args(c.arguments) for c in calls)


class _Trim:
    """Trims a text channel at both ends while streaming: leading whitespace is dropped,
    trailing whitespace is held until non-whitespace follows (then released) or the
    channel ends (then dropped). ``push`` returns what may be emitted now."""

    __slots__ = ("pending", "started")

    def __init__(self) -> None:
        self.started = False
        self.pending: list[str] = []

    def push(self, s: str) -> str:
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


class _CallOut:
    """The fragments of one call produced during one ``feed``."""

    __slots__ = ("id", "index", "name", "parts")

    def __init__(self, index: int, id_: str | None, name: str | None) -> None:
        self.index = index
        self.id = id_
        self.name = name
        self.parts: list[str] = []


class Session:
    """Incremental parsing state of one response, and the response assembled so far. Not
    thread-safe; one per request.

    Create with ``Parser.start``. Call ``feed`` for every detokenized delta and ``finish``
    once at the end of the stream. Neither raises on any model output. ``result()``,
    ``reasoning_tokens`` and ``dropped_tool_calls`` describe the whole response: the caller
    keeps no copy of its own.
    """

    __slots__ = (
        "_all_calls",
        "_all_content",
        "_all_reasoning",
        "_all_repairs",
        "_allow_calls",
        "_args",
        "_arguments",
        "_call_open",
        "_calls_out",
        "_constrained",
        "_content",
        "_credit_total",
        "_credits",
        "_cur_out",
        "_dropped",
        "_envelope",
        "_finished",
        "_header",
        "_held",
        "_held_call",
        "_history",
        "_in_header",
        "_in_value",
        "_json_valued",
        "_key",
        "_kv_open",
        "_max_calls",
        "_next_index",
        "_out_c",
        "_out_r",
        "_pairs",
        "_reasoning",
        "_reasoning_tokens",
        "_result",
        "_routed",
        "_sink",
        "_state",
        "_t",
        "_token_mode",
        "_tools",
        "_value",
    )

    def __init__(
        self,
        tables: _Tables,
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
        self._held = ""
        self._credits = [0] * len(tables.term_index)
        self._credit_total = 0
        self._token_mode = False
        self._reasoning = _Trim()
        self._content = _Trim()
        self._args = _Trim()
        self._header: list[str] = []
        self._in_header = False
        self._call_open = False
        self._next_index = 0
        self._history = history_tool_calls
        self._finished = False
        self._out_r: list[str] = []
        self._out_c: list[str] = []
        self._calls_out: list[_CallOut] = []
        self._cur_out: _CallOut | None = None
        # The whole response (appended once per delta; joined by ``result``).
        self._allow_calls = tool_calls
        self._dropped = 0
        self._reasoning_tokens = 0
        self._all_reasoning: list[str] = []
        self._all_content: list[str] = []
        self._all_calls: dict[int, list[str]] = {}  # index -> [id, name, *argument fragments]
        self._all_repairs: dict[int, tuple[str, ...]] = {}
        self._result: ParseResult | None = None
        self._tools = tools
        self._max_calls = max_tool_calls
        self._constrained = constrained
        self._arguments: ArgumentsStream | None = None  # the open call's, when it streams
        self._held_call: tuple[str, list[str]] | None = None  # (id, raw arguments) unresolved
        # ENVELOPE arguments: the open call's body reader.
        self._envelope: JsonEnvelope | None = None
        # KEY_VALUE arguments: the open call's JSON object, written by the engine.
        self._kv_open = False  # "{" written, "}" not yet
        self._pairs = 0  # parameters written
        self._key: list[str] = []  # the parameter name being read
        self._in_value = False
        self._value: list[str] | None = None  # a JSON-typed value, held until it ends
        self._json_valued: frozenset[str] = frozenset()  # the open call's (ToolSchema)
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
        with one token per feed (the node-agent's case) the count is exact. Feeds without
        ids count nothing."""
        return self._reasoning_tokens

    @property
    def dropped_tool_calls(self) -> int:
        """Calls the model made that the response does not carry: all of them when the session
        was started with ``tool_calls=False``, those beyond ``max_tool_calls``, and, with
        tools, those whose header named no declared function that their arguments resolve."""
        return self._dropped

    def result(self) -> ParseResult:
        """The response so far, assembled: what ``Parser.collect`` makes of every delta this
        session returned (calls dropped by ``tool_calls=False`` excluded), with the leak check.
        Costs O(output) the first time after new output, O(1) when nothing changed."""
        if self._result is not None:
            return self._result
        reasoning = _joined(self._all_reasoning)
        content = _joined(self._all_content)
        calls = []
        for index, parts in sorted(self._all_calls.items()):
            if len(parts) > 3:
                parts[2:] = ["".join(parts[2:])]
            repairs = self._all_repairs.get(index, ())
            calls.append(ToolCall(parts[0], parts[1], parts[2], repairs))
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
                (deltas of one token, the node-agent's case, are exact).

        Returns:
            What became visible: reasoning / content text and tool-call fragments.
        """
        if self._finished:
            return Delta()
        if token_ids is not None:
            if self._sink is Sink.REASONING:
                self._reasoning_tokens += len(token_ids)
            id_to_term = self._t.id_to_term
            # Under a grammar (``constrained``) markers are matched as text: xgrammar's
            # structural tags work on strings, so a marker the model spells in byte tokens is
            # as structural to the grammar as the marker token, and the parser must agree.
            if id_to_term and not self._constrained:
                self._token_mode = True
                for tid in token_ids:
                    term = id_to_term.get(tid)
                    if term is not None:
                        self._credits[term] += 1
                        self._credit_total += 1
        if text:
            self._scan(text)
        return self._collect()

    def finish(self) -> Delta:
        """End of stream: flush held-back text, close an open call, drop trailing whitespace.

        A call whose header never completed (no arguments marker, no end marker) is dropped:
        its name may be truncated. A call cut inside its arguments keeps what was streamed.
        """
        if self._finished:
            return Delta()
        if self._held:
            held, self._held = self._held, ""
            self._plain(held)
        if not self._routed and self._t.config.route is not None and self._sink is Sink.HEADER:
            self._unrouted_output()
        if self._envelope is not None:
            self._end_envelope()
        if self._call_open:
            self._end_call(closed=False)
        self._in_header = False
        self._reasoning.pending.clear()
        self._content.pending.clear()
        self._finished = True
        return self._collect()

    # -- scanning ---------------------------------------------------------------------------

    def _scan(self, text: str) -> None:
        t = self._t
        if self._held:
            buf = self._held + text
            self._held = ""
        else:
            buf = text
            # Fast paths: markers are single tokens, and none is pending; or no marker can
            # start in this delta.
            if self._token_mode and not self._credit_total:
                self._plain(buf)
                return
            if t.first_pair:
                a, b = t.first_pair
                if a not in buf and b not in buf:
                    self._plain(buf)
                    return
            elif t.first_re.search(buf) is None:
                self._plain(buf)
                return
        if self._token_mode and not self._credit_total:
            # Markers are single tokens: with no marker id pending, nothing here is a marker.
            self._plain(buf)
            return
        start = pos = 0
        marker_re = t.marker_re
        while True:
            m = marker_re.search(buf, pos)
            if m is None:
                break
            term = t.term_index[t.literal_to_term[m.group()]]
            if self._token_mode:
                if not self._credits[term]:
                    pos = m.start() + 1  # spelled, not the marker token: plain text
                    continue
                self._credits[term] -= 1
                self._credit_total -= 1
            if m.start() > start:
                self._plain(buf[start : m.start()])
            self._terminal(term, m.group())
            start = pos = m.end()
        end = len(buf)
        if not self._token_mode or self._credit_total:
            # Hold back the earliest suffix that is a proper prefix of some marker.
            j_from = max(start, end - t.max_len + 1)
            prefixes = t.prefixes
            first_re = t.first_re
            m2 = first_re.search(buf, j_from)
            while m2 is not None:
                j = m2.start()
                if buf[j:] in prefixes:
                    self._held = buf[j:]
                    end = j
                    break
                m2 = first_re.search(buf, j + 1)
        if end > start:
            self._plain(buf[start:end] if (start or end != len(buf)) else buf)

    def _terminal(self, term: int, literal: str) -> None:
        tr = self._t.transitions.get((self._state, term))
        if self._constrained and self._state in self._t.verbatim and self._in_json_string():
            tr = None  # a constrained call's JSON string holds the marker as data
        if tr is None:
            if self._state in self._t.verbatim:
                self._plain(literal)  # data here (a JSON string holding "</think>")
            return  # a marker with no meaning here is dropped, never shown
        nxt = tr.next_state
        for action in tr.actions:
            if action is Action.END_REASONING:
                self._reasoning.pending.clear()
            elif action is Action.BEGIN_TOOLS:
                self._content.pending.clear()
            elif action is Action.BEGIN_CALL:
                self._header = []
                self._in_header = True
                if self._t.envelope:
                    self._envelope = JsonEnvelope()
            elif action is Action.BEGIN_ARGS:
                self._open_call()
                if self._t.key_value and self._call_open:
                    self._call_parts().append("{")
                    self._kv_open = True
                    self._pairs = 0
            elif action is Action.END_CALL:
                if self._envelope is not None:
                    self._end_envelope()
                if self._in_header:
                    self._open_call()
                if self._call_open:
                    self._end_call()
            elif action is Action.BEGIN_KEY:
                self._key = []
            elif action is Action.BEGIN_VALUE:
                self._begin_value()
            elif action is Action.END_VALUE:
                self._end_value()
            elif action is Action.BEGIN_MESSAGE:
                self._header = [literal]
            elif action is Action.ROUTE:
                nxt = self._route()
        self._state = nxt
        self._sink = self._t.sinks[nxt]

    def _route(self) -> str:
        """``ROUTE``: the message header is complete; the config's router picks the state its
        body goes to (and opens the call it names)."""
        route = self._t.config.route
        assert route is not None  # EngineConfig.check
        header = "".join(self._header)
        self._header = []
        nxt, call = route(header)
        self._routed = True
        sink = self._t.sinks[nxt]
        if sink is Sink.REASONING and self._reasoning.started:
            self._reasoning.pending.append("\n")  # released only if more text follows
        elif sink is Sink.CONTENT and self._content.started:
            self._content.pending.append("\n")
        if call is not None:
            self._header = [call]
            self._open_call()
        return nxt

    def _unrouted_output(self) -> None:
        """A routing format's output ended before any message header was complete: text that
        holds no marker is the model answering without the format (SGLang's harmony detector
        returns it as normal text), so it is content; a cut-off header stays dropped."""
        text = "".join(self._header)
        self._header = []
        if text and self._t.marker_re.search(text) is None:
            piece = self._content.push(text)
            if piece:
                self._out_c.append(piece)

    def _open_call(self) -> None:
        """The header is complete: emit the call's first fragment (id, name) if it names a
        declared function (any, without tools); hold the call when it names none."""
        header = "".join(self._header)
        self._header = []
        self._in_header = False
        index = self._next_index
        split = self._t.config.split_header(header, self._history + index)
        self._call_open = False
        if split is None:
            return  # no function named: its arguments are dropped
        if self._max_calls is not None and index >= self._max_calls:
            self._dropped += 1  # parallel_tool_calls: false (the first call only)
            return
        self._call_open = True
        self._args = _Trim()
        tools = self._tools
        coercions = None
        json_valued: frozenset[str] = frozenset()
        if tools is not None and self._allow_calls:
            schema = tools.by_name.get(split[1])
            names = self._t.config.names_function
            if schema is not None:
                coercions = schema.coercions
                json_valued = schema.json_valued
            elif names is not None and not names(header):
                self._arguments = None  # an id, not a name: resolved when its arguments end
                self._held_call = (header.strip(), [])
                return
        self._arguments = ArgumentsStream(coercions)
        self._json_valued = json_valued
        out = _CallOut(index, split[0], split[1])
        self._calls_out.append(out)
        self._cur_out = out

    def _end_call(self, closed: bool = True) -> None:
        """Close the open call; ``closed`` is False when the stream ended inside it."""
        self._args.pending.clear()
        self._call_open = False
        if self._held_call is not None:
            self._end_held_call()
            return
        arguments = self._arguments
        self._arguments = None
        if self._kv_open:
            self._end_pairs(closed)
        elif not self._args.started:
            self._call_parts().append(self._t.config.empty_arguments)
        elif arguments is not None:
            rest = arguments.finish()
            if rest:
                self._call_parts().append(rest)
            if arguments.repairs and self._allow_calls:
                self._all_repairs[self._next_index] = tuple(arguments.repairs)
        self._cur_out = None
        self._next_index += 1

    def _end_pairs(self, closed: bool) -> None:
        """Finish a ``KEY_VALUE`` call's object. Cut off by the end of the stream, it stays as
        written (an open value and no ``}``: invalid JSON, so the truncation shows, as for a
        ``JSON`` call cut inside its arguments)."""
        if self._in_value:
            if closed:
                self._end_value()
            else:
                self._in_value = False
                if self._value is not None:
                    self._call_parts().append("".join(self._value))
        if closed:
            self._call_parts().append("}")
        self._kv_open = False
        self._value = None
        self._key = []

    def _begin_value(self) -> None:
        """``KEY_VALUE``: the parameter name is complete; write it and open its value."""
        key = "".join(self._key).strip()
        self._key = []
        self._in_value = True
        if not self._kv_open:
            return  # the call is dropped
        head = (", " if self._pairs else "") + encode_basestring(key) + ": "
        self._pairs += 1
        if key in self._json_valued:
            self._value = []  # decoded when it ends
            self._call_parts().append(head)
        else:
            self._value = None  # a string: streamed as it comes
            self._call_parts().append(head + '"')

    def _end_value(self) -> None:
        if not self._in_value:
            return
        self._in_value = False
        if not self._kv_open:
            return
        value, self._value = self._value, None
        if value is not None:
            self._call_parts().append(decode_json_value("".join(value)))
        else:
            self._call_parts().append('"')

    def _end_envelope(self) -> None:
        """``ENVELOPE``: the body ended; flush what its reader still holds."""
        env = self._envelope
        assert env is not None
        self._envelope = None
        env.finish()
        self._drain(env)

    def _drain(self, env: JsonEnvelope) -> None:
        """``ENVELOPE``: open the call once its name is read, then stream its arguments."""
        if self._in_header:
            if env.name is None:
                return  # arguments written before the name wait in the reader
            self._header = [env.name]
            self._open_call()
        piece = env.take()
        if piece and self._call_open:
            self._args_text(piece)

    def _args_text(self, s: str) -> None:
        """Argument text of the open call (the ``ARGS`` sink's path, for other sinks)."""
        piece = self._args.push(s)
        if not piece:
            return
        held = self._held_call
        if held is not None:
            held[1].append(piece)
            return
        arguments = self._arguments
        if arguments is not None:
            piece = arguments.feed(piece)
            if not piece:
                return
        self._call_parts().append(piece)

    def _in_json_string(self) -> bool:
        """Whether the open call's arguments (or ``ENVELOPE`` body) end inside a JSON string."""
        env = self._envelope
        if env is not None:
            return env.in_string
        arguments = self._arguments
        return arguments is not None and arguments.in_string

    def _end_held_call(self) -> None:
        """Resolves a call whose header named no declared function from its arguments
        (`ToolSet.resolve`), then emits it whole; an unresolved one is dropped."""
        assert self._held_call is not None and self._tools is not None
        id_, raw = self._held_call
        self._held_call = None
        resolved = self._tools.resolve("".join(raw) or self._t.config.empty_arguments)
        if resolved is None:
            self._dropped += 1
            return
        schema, arguments, repairs = resolved
        out = _CallOut(self._next_index, id_, schema.name)
        out.parts.append(arguments)
        if repairs:
            self._all_repairs[self._next_index] = repairs
        self._calls_out.append(out)
        self._next_index += 1

    def _call_parts(self) -> list[str]:
        out = self._cur_out
        if out is None:
            out = _CallOut(self._next_index, None, None)
            self._calls_out.append(out)
            self._cur_out = out
        return out.parts

    def _plain(self, s: str) -> None:
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
            if self._call_open:
                piece = self._args.push(s)
                if piece:
                    held = self._held_call
                    if held is not None:
                        held[1].append(piece)
                        return
                    arguments = self._arguments
                    if arguments is not None:
                        piece = arguments.feed(piece)
                        if not piece:
                            return
                    self._call_parts().append(piece)
        elif sink is Sink.HEADER:
            self._header.append(s)
        elif sink is Sink.ARG_VALUE:
            if self._kv_open and self._in_value:
                if self._value is not None:
                    self._value.append(s)
                else:
                    self._call_parts().append(encode_basestring(s)[1:-1])
        elif sink is Sink.BODY:
            env = self._envelope
            if env is not None:
                env.feed(s)
                self._drain(env)
        elif sink is Sink.ARG_KEY:
            self._key.append(s)
        else:
            nxt = self._t.text_transitions.get(self._state)
            if nxt is not None and s.strip():
                self._state = nxt
                self._sink = self._t.sinks[nxt]

    def _collect(self) -> Delta:
        r = self._out_r
        c = self._out_c
        calls = self._calls_out
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
        tool_calls: list[ToolCallDelta] = []
        if calls:
            if self._allow_calls:
                whole = self._all_calls
                for o in calls:
                    args = "".join(o.parts)
                    tool_calls.append(ToolCallDelta(o.index, o.id, o.name, args))
                    parts = whole.get(o.index)
                    if parts is None:
                        whole[o.index] = [o.id or "", o.name or "", args]
                    else:
                        parts.append(args)
            else:
                self._dropped += sum(1 for o in calls if o.id is not None)
            self._calls_out = []
            self._cur_out = None
        return Delta(reasoning, content, tool_calls)


class Parser:
    """A compiled output format. Immutable and shared; ``start`` one ``Session`` per response.

    Args:
        config: the format.
        vocab: the tokenizer's vocab (``tokenizer.get_vocab()``) or None. When it holds every
            marker, ``feed(..., token_ids=...)`` matches markers by id (ids are looked up
            here, never hard-coded).

    Raises:
        ValueError: the config is inconsistent (a programming error, not model output).
    """

    __slots__ = ("_t",)

    def __init__(self, config: EngineConfig, vocab: Mapping[str, int] | None = None) -> None:
        self._t = _Tables(config, vocab)

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
        return {terms[i][1]: tid for tid, i in self._t.id_to_term.items()}

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
                arguments coerced against them (module docstring); an empty list means the
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


def _joined(parts: list[str]) -> str:
    """``"".join(parts)``, leaving ``parts`` as that one string (a second join is O(1))."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""
