"""Call assembly: one response's tool calls, from their headers and argument text to streamed
``ToolCallDelta`` fragments (name, id, argument JSON) and the complete ``ToolCall`` list.

The session (``_session.py``) walks the config's transitions and hands the assembler what
concerns calls: the header text, the call actions (``BEGIN_CALL``, ``BEGIN_ARGS``,
``END_CALL``, ``BEGIN_KEY`` / ``BEGIN_VALUE`` / ``END_VALUE``) and the text of the argument
sinks. The assembler writes the arguments in the config's ``ArgumentsFormat``:

* ``JSON``: the text is the JSON arguments, trimmed and streamed through ``ArgumentsStream``
  (trailing-comma repair, coercion to the declared schema).
* ``KEY_VALUE``: ``{`` when the header completes, ``"key": `` per pair, string values escaped
  and streamed as they come, values whose declared type excludes string
  (``ToolSchema.json_valued``) held and decoded when they end, ``}`` on the call's end.
* ``ENVELOPE``: the body goes to a ``JsonEnvelope``; the call opens when the ``name`` string
  closes, and the ``arguments`` value's raw text then flows down the ``JSON`` path.

With the request's tools, a header naming a function (``functions.{name}:{n}``, or a declared
name) streams at once, its arguments coerced to the declared schema; any other header (a bare
counter, a client-style id) is held until its arguments end and resolved from the tools
(``ToolSet.resolve``), or dropped, never invented. Ids are the model's own, verbatim, unless a
call of the same response already carries that id (then the format's generated id, see
``_unique_id``); a format without ids gets ``call_{n}`` (``split_name_header``).
"""

from __future__ import annotations

from json.encoder import encode_basestring

from inferplane.parsers._arguments import ArgumentsStream, ToolSet, decode_json_value
from inferplane.parsers._envelope import JsonEnvelope
from inferplane.parsers._lexer import Tables
from inferplane.parsers._trim import Trim
from inferplane.parsers._types import ToolCall, ToolCallDelta

__all__ = ["CallAssembler"]


class _CallOut:
    """The fragments of one call produced during one ``feed``."""

    __slots__ = ("id", "index", "name", "parts")

    def __init__(self, index: int, id_: str | None, name: str | None) -> None:
        self.index = index
        self.id = id_
        self.name = name
        self.parts: list[str] = []


class CallAssembler:
    """One response's tool calls: the open call, the fragments of the current feed, and every
    call emitted so far. Not thread-safe; owned by one ``Session``.

    Args:
        tables: the compiled config (``split_header``, ``names_function``,
            ``empty_arguments``, ``arguments_format``).
        history_tool_calls: calls earlier in the conversation (numbers generated ids).
        allow: False when the response may carry no calls (``tool_choice: "none"``, or an
            empty ``tools``): calls are still parsed, then counted in ``dropped``.
        tools: the request's tools, or None when unknown (names are taken as written).
        max_tool_calls: calls after this many are dropped; None = no limit.

    Attributes:
        header: the header text buffered so far (a call's, or a routed message's).
        key: the ``KEY_VALUE`` parameter name being read.
        out: the fragments produced since the last ``take`` (empty: nothing new).
        dropped: calls the response does not carry (``Session.dropped_tool_calls``).
    """

    __slots__ = (
        "_all_calls",
        "_all_repairs",
        "_allow",
        "_args",
        "_arguments",
        "_call_open",
        "_cur",
        "_envelope",
        "_held_call",
        "_history",
        "_ids",
        "_in_header",
        "_in_value",
        "_json_valued",
        "_kv_open",
        "_max_calls",
        "_next_index",
        "_pairs",
        "_t",
        "_tools",
        "_value",
        "dropped",
        "header",
        "key",
        "out",
    )

    def __init__(
        self,
        tables: Tables,
        history_tool_calls: int,
        allow: bool,
        tools: ToolSet | None,
        max_tool_calls: int | None,
    ) -> None:
        self._t = tables
        self._history = history_tool_calls
        self._allow = allow
        self._tools = tools
        self._max_calls = max_tool_calls
        self._ids: set[str] = set()  # the ids this response's calls carry so far
        self._args = Trim()
        self.header: list[str] = []
        self._in_header = False
        self._call_open = False
        self._next_index = 0
        self.out: list[_CallOut] = []
        self._cur: _CallOut | None = None
        self.dropped = 0
        # The whole response (appended once per feed; joined by ``calls``).
        self._all_calls: dict[int, list[str]] = {}  # index -> [id, name, *argument fragments]
        self._all_repairs: dict[int, tuple[str, ...]] = {}
        self._arguments: ArgumentsStream | None = None  # the open call's, when it streams
        self._held_call: tuple[str, list[str]] | None = None  # (id, raw arguments) unresolved
        # ENVELOPE arguments: the open call's body reader.
        self._envelope: JsonEnvelope | None = None
        # KEY_VALUE arguments: the open call's JSON object, written here.
        self._kv_open = False  # "{" written, "}" not yet
        self._pairs = 0  # parameters written
        self.key: list[str] = []  # the parameter name being read
        self._in_value = False
        self._value: list[str] | None = None  # a JSON-typed value, held until it ends
        self._json_valued: frozenset[str] = frozenset()  # the open call's (ToolSchema)

    # -- actions ------------------------------------------------------------------------------

    def begin_call(self) -> None:
        """``BEGIN_CALL``: start buffering a new call's header."""
        self.header = []
        self._in_header = True
        if self._t.envelope:
            self._envelope = JsonEnvelope()

    def begin_args(self) -> None:
        """``BEGIN_ARGS``: the header is complete; open the call (``KEY_VALUE``: its ``{``)."""
        self._open_call()
        if self._t.key_value and self._call_open:
            self._call_parts().append("{")
            self._kv_open = True
            self._pairs = 0

    def end_call(self) -> None:
        """``END_CALL``: close the call, opening it first if its header was still being read;
        its arguments default to the config's ``empty_arguments``."""
        if self._envelope is not None:
            self._end_envelope()
        if self._in_header:
            self._open_call()
        if self._call_open:
            self._close_call()

    def begin_key(self) -> None:
        """``BEGIN_KEY``: start buffering a parameter name (``KEY_VALUE``)."""
        self.key = []

    def begin_message(self, literal: str) -> None:
        """``BEGIN_MESSAGE``: start buffering a message header, its opening marker kept."""
        self.header = [literal]

    def take_header(self) -> str:
        """The buffered header text, emptied (a routed message's header, whole)."""
        header = "".join(self.header)
        self.header = []
        return header

    def open_named(self, call_header: str) -> None:
        """Open a call from a complete header (a routed message that names a function)."""
        self.header = [call_header]
        self._open_call()

    def finish(self) -> None:
        """End of stream: flush an envelope, close an open call as cut off (a call whose
        header never completed is dropped: its name may be truncated)."""
        if self._envelope is not None:
            self._end_envelope()
        if self._call_open:
            self._close_call(closed=False)
        self._in_header = False

    # -- sink text -------------------------------------------------------------------------------

    def args(self, s: str) -> None:
        """``ARGS`` text: the open call's JSON arguments (dropped when no call is open). The
        hot path of a call: ``_args_text`` inlined."""
        if not self._call_open:
            return
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

    def arg_value(self, s: str) -> None:
        """``ARG_VALUE`` text: a ``KEY_VALUE`` parameter's raw value."""
        if self._kv_open and self._in_value:
            if self._value is not None:
                self._value.append(s)
            else:
                self._call_parts().append(encode_basestring(s)[1:-1])

    def body(self, s: str) -> None:
        """``BODY`` text: an ``ENVELOPE`` call's JSON object."""
        env = self._envelope
        if env is not None:
            env.feed(s)
            self._drain(env)

    def in_json_string(self) -> bool:
        """Whether the open call's arguments (or ``ENVELOPE`` body) end inside a JSON string."""
        env = self._envelope
        if env is not None:
            return env.in_string
        arguments = self._arguments
        return arguments is not None and arguments.in_string

    # -- output --------------------------------------------------------------------------------

    def take(self) -> list[ToolCallDelta]:
        """The fragments produced since the last ``take``, at most one per call index, in
        index order; recorded for ``calls``. Empty when calls are not allowed (those that
        were made are counted in ``dropped``)."""
        calls = self.out
        tool_calls: list[ToolCallDelta] = []
        if self._allow:
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
            self.dropped += sum(1 for o in calls if o.id is not None)
        self.out = []
        self._cur = None
        return tool_calls

    def calls(self) -> list[ToolCall]:
        """Every call taken so far, assembled (with its argument repairs), in index order."""
        calls = []
        for index, parts in sorted(self._all_calls.items()):
            if len(parts) > 3:
                parts[2:] = ["".join(parts[2:])]
            repairs = self._all_repairs.get(index, ())
            calls.append(ToolCall(parts[0], parts[1], parts[2], repairs))
        return calls

    # -- internals -----------------------------------------------------------------------------

    def _open_call(self) -> None:
        """The header is complete: emit the call's first fragment (id, name) if it names a
        declared function (any, without tools); hold the call when it names none."""
        header = "".join(self.header)
        self.header = []
        self._in_header = False
        index = self._next_index
        split = self._t.config.split_header(header, self._history + index)
        self._call_open = False
        if split is None:
            return  # no function named: its arguments are dropped
        if self._max_calls is not None and index >= self._max_calls:
            self.dropped += 1  # parallel_tool_calls: false (the first call only)
            return
        self._call_open = True
        self._args = Trim()
        tools = self._tools
        coercions = None
        json_valued: frozenset[str] = frozenset()
        if tools is not None and self._allow:
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
        out = _CallOut(index, self._unique_id(split[0], split[1], index), split[1])
        self.out.append(out)
        self._cur = out

    def _close_call(self, closed: bool = True) -> None:
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
            if arguments.repairs and self._allow:
                self._all_repairs[self._next_index] = tuple(arguments.repairs)
        self._cur = None
        self._next_index += 1

    def _end_pairs(self, closed: bool) -> None:
        """Finish a ``KEY_VALUE`` call's object. Cut off by the end of the stream, it stays as
        written (an open value and no ``}``: invalid JSON, so the truncation shows, as for a
        ``JSON`` call cut inside its arguments)."""
        if self._in_value:
            if closed:
                self.end_value()
            else:
                self._in_value = False
                if self._value is not None:
                    self._call_parts().append("".join(self._value))
        if closed:
            self._call_parts().append("}")
        self._kv_open = False
        self._value = None
        self.key = []

    def begin_value(self) -> None:
        """``BEGIN_VALUE`` (``KEY_VALUE``): the parameter name is complete; write it and open
        its value."""
        key = "".join(self.key).strip()
        self.key = []
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

    def end_value(self) -> None:
        """``END_VALUE`` (``KEY_VALUE``): close the value (decoded when its declared type is
        not string)."""
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
            self.header = [env.name]
            self._open_call()
        piece = env.take()
        if piece and self._call_open:
            self._args_text(piece)

    def _args_text(self, s: str) -> None:
        """Argument text of the open call."""
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

    def _end_held_call(self) -> None:
        """Resolves a call whose header named no declared function from its arguments
        (`ToolSet.resolve`), then emits it whole; an unresolved one is dropped."""
        assert self._held_call is not None and self._tools is not None
        id_, raw = self._held_call
        self._held_call = None
        resolved = self._tools.resolve("".join(raw) or self._t.config.empty_arguments)
        if resolved is None:
            self.dropped += 1
            return
        schema, arguments, repairs = resolved
        out = _CallOut(
            self._next_index, self._unique_id(id_, schema.name, self._next_index), schema.name
        )
        out.parts.append(arguments)
        if repairs:
            self._all_repairs[self._next_index] = repairs
        self.out.append(out)
        self._next_index += 1

    def _unique_id(self, id_: str, name: str, index: int) -> str:
        """`id_`, or, when a call of this response already carries it, the id the format
        generates for a call without one (``functions.{name}:{n}``, ``call_{n}``), numbered
        from this call's place in the conversation up to the first free one. A model may write
        one id twice in a turn (kimi-tiny does, deep into a session); a client answers each
        call by its id and sends the calls back, so two calls with one id could be neither
        answered apart nor rendered again (the renderer refuses an id used twice in a
        message)."""
        number, written = self._history + index, id_
        while id_ in self._ids:
            split = self._t.config.split_header(name, number)
            generated = split[0] if split is not None else None
            id_ = generated if generated not in (None, id_) else f"{written}-{number}"
            number += 1
        self._ids.add(id_)
        return id_

    def _call_parts(self) -> list[str]:
        out = self._cur
        if out is None:
            out = _CallOut(self._next_index, None, None)
            self.out.append(out)
            self._cur = out
        return out.parts
