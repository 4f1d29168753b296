"""The declarative description of one output format: ``EngineConfig`` and its vocabulary.

A model format is a frozen ``EngineConfig``: terminals (marker strings, also matched by token
id when a vocab is given), ``transitions[(state, terminal)] = Transition(next_state,
actions)``, where each state's plain text goes (its ``Sink``), and an initial state. The
lexer (``_lexer.py``) turns a stream into marker and text events, the session
(``_session.py``) walks the transitions, and the call assembler (``_calls.py``) writes the
calls. The shape follows vLLM's ``vllm/parser/engine`` (config over machine); the code is our
own.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from inferplane.parsers._syntax import CallSyntax

__all__ = [
    "GENERATED_ID_PREFIX",
    "Action",
    "ArgumentsFormat",
    "EngineConfig",
    "HeaderSplitter",
    "MessageRouter",
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
