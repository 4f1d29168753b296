"""The lexer: a config compiled into marker tables (``Tables``), and ``Lexer``, which turns one
response's detokenized deltas (and their token ids) into text and marker events.

Rules the lexer enforces for every config (they are what makes the output safe to stream):

* Text that could be the start of a marker at the end of a delta is held back until the
  next delta resolves it (at most ``max(len(marker)) - 1`` characters); ``flush`` returns it
  at the end of the stream.
* With a vocab holding every marker, a marker string counts only if its token id was seen
  (text merely spelling a marker stays text); ids are credits consumed in text order.
  Under a grammar (``constrained``) markers are matched as text instead.
* Scanning costs amortised O(len(delta)): the buffer is never rescanned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from inferplane.parsers._config import ArgumentsFormat, EngineConfig
from inferplane.parsers._types import ToolCall

__all__ = ["Lexer", "LexerEvents", "Tables"]


class Tables:
    """Everything derived from a config once, shared read-only by all sessions.

    Args:
        config: the format.
        vocab: ``tokenizer.get_vocab()`` or None. Token-id matching (``id_to_term``) is on only
            when it holds every terminal's marker (a missing one would leak as text).
        drop: texts of tokens that are never output (the tokenizer's special tokens and chat
            markers: ``<|im_assistant|>``): each is one more terminal with no transition, so
            it is dropped from reasoning, content and headers and is data in arguments. As
            for every marker, with token-id matching it counts only when its token was seen
            (spelled in other tokens it is text). Texts that are already markers are skipped.

    Raises:
        ValueError: the config is inconsistent (``EngineConfig.check``).

    Attributes:
        term_index: terminal name -> its index (what marker events carry).
        literal_to_term: marker string (terminals and aliases) -> terminal name.
        marker_re: any marker, longest first; ``args_marker_re``: the markers that cannot be
            data inside arguments (every marker when the config has no verbatim state).
        prefixes: every proper prefix of a marker (held back at the end of a delta);
            ``max_len``: the longest marker; ``first_chars`` / ``first_pair`` / ``first_re``:
            the characters a marker can start with (fast "no marker here" tests).
        id_to_term: marker token id -> terminal index (empty: match by text).
        transitions: ``(state, terminal index) -> Transition``; ``sinks``,
            ``text_transitions``, ``verbatim``: the config's, as plain containers.
        key_value / envelope: the config's ``arguments_format`` is ``KEY_VALUE`` /
            ``ENVELOPE``.
    """

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

    def __init__(
        self, config: EngineConfig, vocab: Mapping[str, int] | None, drop: Sequence[str] = ()
    ) -> None:
        config.check()
        self.config = config
        self.key_value = config.arguments_format is ArgumentsFormat.KEY_VALUE
        self.envelope = config.arguments_format is ArgumentsFormat.ENVELOPE
        self.literal_to_term = {lit: term for term, lit in config.terminals.items()}
        self.literal_to_term.update(config.aliases)
        # Never-output tokens: terminals of their own ("drop:<text>"), with no transition.
        known = set(self.literal_to_term)
        dropped = sorted({t for t in drop if t and not t.isspace() and t not in known})
        terminals = dict(config.terminals)
        for text in dropped:
            terminals["drop:" + text] = text
            self.literal_to_term[text] = "drop:" + text
        literals = sorted(self.literal_to_term, key=len, reverse=True)
        self.marker_re = re.compile("|".join(re.escape(lit) for lit in literals))
        self.first_chars = "".join(sorted({lit[0] for lit in literals}))
        # One or two first characters ("<", "◁"): two `in` tests beat a regex search.
        pair = self.first_chars * 2 if len(self.first_chars) == 1 else self.first_chars
        self.first_pair = (pair[0], pair[1]) if len(pair) == 2 else None
        self.first_re = re.compile("[" + re.escape(self.first_chars) + "]")
        self.prefixes = frozenset(lit[:i] for lit in literals for i in range(1, len(lit)))
        self.max_len = max(len(lit) for lit in literals)
        terms = list(terminals)
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
            for lit, term in [*config.aliases.items(), *((t, "drop:" + t) for t in dropped)]:
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


class LexerEvents(Protocol):
    """What ``Lexer.feed`` reports to, in text order (the session).

    The handlers are underscored because they are not the session's public API: the lexer is
    their one caller. The receiver is passed to each ``feed`` rather than stored as callbacks,
    so a session and its lexer hold no reference cycle (a finished session is freed at once).
    """

    def _on_text(self, text: str) -> None:
        """Plain text (no marker in it; never empty)."""

    def _on_marker(self, term: int, literal: str) -> None:
        """A marker: its terminal's index (``Tables.term_index``) and the string matched."""


class Lexer:
    """One response's marker matching: held-back text and token-id credits. Not thread-safe.

    Args:
        tables: the compiled config.
        constrained: markers are matched by text even when the vocab holds them
            (``Parser.start(constrained=True)``: xgrammar's structural tags work on strings,
            so a marker the model spells in byte tokens is as structural to the grammar as
            the marker token, and the parser must agree).
    """

    __slots__ = ("_credit_total", "_credits", "_held", "_ids", "_t", "_token_mode")

    def __init__(self, tables: Tables, constrained: bool) -> None:
        self._t = tables
        self._ids = {} if constrained else tables.id_to_term
        self._held = ""
        self._credits = [0] * len(tables.term_index)
        self._credit_total = 0
        self._token_mode = False

    def flush(self) -> str:
        """The text held back as a possible marker start (end of stream: it is plain text)."""
        held, self._held = self._held, ""
        return held

    def feed(self, text: str, token_ids: Sequence[int] | None, out: LexerEvents) -> None:
        """One delta: credit the marker ids among ``token_ids``, then report ``text`` to
        ``out`` as text and marker events, in text order, holding back a suffix that may
        start a marker.

        Args:
            text: the delta's text (may be empty).
            token_ids: the ids it came from, or None. With token-id matching (a vocab holding
                every marker, not ``constrained``), the first ids turn it on: from then on a
                marker string is a marker only while an id of its terminal is credited.
            out: the receiver of the events (the session).
        """
        if token_ids is not None:
            id_to_term = self._ids
            if id_to_term:
                self._token_mode = True
                for tid in token_ids:
                    term = id_to_term.get(tid)
                    if term is not None:
                        self._credits[term] += 1
                        self._credit_total += 1
        if not text:
            return
        t = self._t
        if self._held:
            buf = self._held + text
            self._held = ""
        else:
            buf = text
            # Fast paths: markers are single tokens, and none is pending; or no marker can
            # start in this delta.
            if self._token_mode and not self._credit_total:
                out._on_text(buf)
                return
            if t.first_pair:
                a, b = t.first_pair
                if a not in buf and b not in buf:
                    out._on_text(buf)
                    return
            elif t.first_re.search(buf) is None:
                out._on_text(buf)
                return
        if self._token_mode and not self._credit_total:
            # Markers are single tokens: with no marker id pending, nothing here is a marker.
            out._on_text(buf)
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
                out._on_text(buf[start : m.start()])
            out._on_marker(term, m.group())
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
            out._on_text(buf[start:end] if (start or end != len(buf)) else buf)
