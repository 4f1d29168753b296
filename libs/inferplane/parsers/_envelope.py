"""A tool call's body written as one JSON object naming its function, read incrementally.

Hermes-style formats (Qwen2.5 / Qwen3, vLLM's ``hermes`` tool parser, SGLang's
``Qwen25Detector``) put each call between ``<tool_call>`` and ``</tool_call>`` as::

    {"name": "get_weather", "arguments": {"city": "Tokyo"}}

`JsonEnvelope` is fed the body's text in any split and exposes what the engine needs to
stream the call: ``name`` as soon as its string closes, then the raw text of the
``arguments`` value as it arrives (`take`), so the arguments stream before the call ends.

Rules (each decided on the characters alone, so any split gives the same result):

* Text before the first ``{`` is skipped (a code fence, a stray word); after the object's
  closing ``}`` everything is ignored.
* Only top-level keys count. The first ``"name"`` whose value is a non-empty string names the
  function; the first ``"arguments"`` (or ``"parameters"``, SGLang's
  ``BaseFormatDetector.parse_base_json``) is the arguments, whatever its JSON type. Arguments
  written before the name are held until the name arrives.
* An arguments value that is a JSON string holding a serialized JSON object
  (``"arguments": "{\\"a\\": 1}"``) is unwrapped to that object's text; any other string stays
  the string literal as written. vLLM's hermes parser applies this rule in both paths (tests
  ``test_hermes_parser_non_streaming_serialized_arguments`` and
  ``..._string_arguments_match_non_streaming``); the literal is held until it closes, since a
  prefix cannot tell.
* Malformed JSON never raises: a missing ``:`` is tolerated, stray characters between members
  are skipped, a mismatched bracket closes the current value.
"""

from __future__ import annotations

import json
import re

__all__ = ["ARGUMENTS_KEYS", "NAME_KEYS", "JsonEnvelope"]

NAME_KEYS = frozenset({"name"})
ARGUMENTS_KEYS = frozenset({"arguments", "parameters"})

# States.
_PRE = 0  # before the object's "{"
_KEY = 1  # expecting a key, "," or "}"
_KEY_STR = 2  # inside a key string
_COLON = 3  # after a key, expecting ":"
_VALUE = 4  # expecting a value
_NAME = 5  # inside the name's string
_IN_VALUE = 6  # inside a value (the arguments, streamed; any other, skipped)
_AFTER = 7  # after a value, expecting "," or "}"
_DONE = 8  # after the object

_WS = " \t\r\n"
_STR_STOP = re.compile(r'["\\]')
_VALUE_STOP = re.compile(r'["{}\[\]]')
_SCALAR_STOP = re.compile(r"[,}\]]")


def _decoded(raw: str) -> str:
    """A JSON string's raw contents, unescaped (as written when the escapes are invalid)."""
    try:
        value = json.loads('"' + raw + '"')
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


class JsonEnvelope:
    """Incremental reader of one call body (module docstring). Not thread-safe.

    Attributes:
        name: the function's name (stripped) once its string has closed, else None.
    """

    __slots__ = (
        "_args_done",
        "_buf",
        "_depth",
        "_escape",
        "_held",
        "_in_string",
        "_is_args",
        "_naming",
        "_out",
        "_scalar",
        "_state",
        "name",
    )

    def __init__(self) -> None:
        self.name: str | None = None
        self._state = _PRE
        self._buf: list[str] = []  # the key or name string being read, raw
        self._escape = False
        self._is_args = False  # the value being read is the arguments
        self._naming = False  # the value being read is the name
        self._args_done = False  # an arguments key was already read
        self._depth = 0  # brackets open inside the current value
        self._in_string = False  # inside a string inside the current value
        self._scalar = False  # the current value is a bare literal (number, true, ...)
        self._held: list[str] | None = None  # a string-valued arguments literal, raw
        self._out: list[str] = []  # argument text not yet taken

    @property
    def in_string(self) -> bool:
        """Whether the text so far ends inside a JSON string (a key, the name, a value)."""
        return self._state in (_KEY_STR, _NAME) or (self._state == _IN_VALUE and self._in_string)

    def take(self) -> str:
        """The arguments' raw text read since the last call ("" when none)."""
        out = self._out
        if not out:
            return ""
        self._out = []
        return out[0] if len(out) == 1 else "".join(out)

    def finish(self) -> None:
        """End of the body: a string-valued arguments literal still open is kept as written."""
        if self._held is not None:
            self._out.append("".join(self._held))
            self._held = None

    def feed(self, text: str) -> None:
        """Consume the next piece of the body."""
        pos, end = 0, len(text)
        while pos < end:
            state = self._state
            if state == _IN_VALUE:
                pos = self._value(text, pos, pos)
            elif state == _DONE:
                return
            elif state == _PRE:
                i = text.find("{", pos)
                if i < 0:
                    return
                self._state = _KEY
                pos = i + 1
            elif state in (_KEY_STR, _NAME):
                pos = self._string(text, pos)
            else:
                c = text[pos]
                pos += 1
                if c in _WS:
                    continue
                if state == _KEY:
                    if c == '"':
                        self._state = _KEY_STR
                        self._buf = []
                    elif c == "}":
                        self._state = _DONE
                elif state == _COLON:
                    self._state = _VALUE
                    if c != ":":
                        pos -= 1  # a missing ':': the character starts the value
                elif state == _VALUE:
                    pos = self._begin_value(text, pos - 1)
                elif c == ",":  # _AFTER
                    self._state = _KEY
                elif c == "}":
                    self._state = _DONE

    def _string(self, text: str, pos: int) -> int:
        """Reads a key or the name up to its closing quote."""
        end = len(text)
        while pos < end:
            if self._escape:
                self._escape = False
                self._buf.append(text[pos])
                pos += 1
                continue
            m = _STR_STOP.search(text, pos)
            stop = m.start() if m is not None else end
            if stop > pos:
                self._buf.append(text[pos:stop])
            if m is None:
                return end
            if text[stop] == "\\":
                self._escape = True
                self._buf.append("\\")
                pos = stop + 1
                continue
            value = _decoded("".join(self._buf))
            self._buf = []
            if self._state == _NAME:
                name = value.strip()
                if name and self.name is None:
                    self.name = name
                self._state = _AFTER
            else:
                self._key(value)
            return stop + 1
        return pos

    def _key(self, key: str) -> None:
        self._state = _COLON
        self._is_args = False
        self._naming = key in NAME_KEYS and self.name is None
        if not self._naming and key in ARGUMENTS_KEYS and not self._args_done:
            self._args_done = True
            self._is_args = True

    def _begin_value(self, text: str, pos: int) -> int:
        """`pos` is the value's first character."""
        c = text[pos]
        naming, self._naming = self._naming, False
        if naming and c == '"':
            self._state = _NAME
            return pos + 1
        if c in ",}":  # no value at all
            self._state = _AFTER
            return pos
        self._state = _IN_VALUE
        self._depth = 1 if c in "{[" else 0
        self._in_string = c == '"'
        self._scalar = c not in '{["'
        self._escape = False
        if self._is_args and self._in_string:
            self._held = []
        return self._value(text, pos + 1, pos)

    def _value(self, text: str, pos: int, start: int) -> int:
        """Consumes the current value from `pos` (its text from `start` is emitted)."""
        end = len(text)
        while pos < end:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    pos += 1
                    continue
                m = _STR_STOP.search(text, pos)
                if m is None:
                    pos = end
                    break
                pos = m.start() + 1
                if text[pos - 1] == "\\":
                    self._escape = True
                    continue
                self._in_string = False
                if self._depth == 0:
                    return self._end_value(text, start, pos)
                continue
            if self._scalar:
                m = _SCALAR_STOP.search(text, pos)
                if m is None:
                    pos = end
                    break
                return self._end_value(text, start, m.start())  # ',' / '}' is not the value's
            m = _VALUE_STOP.search(text, pos)
            if m is None:
                pos = end
                break
            pos = m.start() + 1
            c = text[pos - 1]
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return self._end_value(text, start, pos)
        if self._is_args and pos > start:
            self._emit(text[start:pos])
        return pos

    def _emit(self, piece: str) -> None:
        if self._held is not None:
            self._held.append(piece)
        else:
            self._out.append(piece)

    def _end_value(self, text: str, start: int, stop: int) -> int:
        self._state = _AFTER
        if not self._is_args:
            return stop
        if stop > start:
            self._emit(text[start:stop])
        held, self._held = self._held, None
        if held is not None:
            self._out.append(_unwrapped("".join(held)))
        self._is_args = False
        return stop


def _unwrapped(literal: str) -> str:
    """A string-valued arguments literal: the object it serializes, else itself."""
    try:
        inner = json.loads(literal)
        if isinstance(inner, str) and isinstance(json.loads(inner), dict):
            return inner.strip()
    except (ValueError, RecursionError):
        pass
    return literal
