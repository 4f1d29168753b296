"""The Kimi K2 / K2.5 output format as a declarative ``EngineConfig``.

Format (Moonshot's tool-call guide, ``docs/tool_call_guidance.md`` of the Kimi-K2 repository;
the facts and their sources: ``docs/kimi.md``)::

    reasoning</think>content<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>

Rules beyond the happy path, and where they come from:

* K2.5's generation prompt ends with ``<think>``: output starts inside reasoning
  (``start(thinking=True)``). An explicit ``<think>`` is also accepted, in reasoning or
  before any content.
* Reasoning ends on ``</think>`` OR on ``<|tool_calls_section_begin|>`` (the model skips
  ``</think>``: vLLM's reasoning parser then never ended, vLLM PR #32216) and never resumes:
  no transition leads back to ``REASONING``. A ``<|tool_call_begin|>`` without a section
  also ends reasoning and opens a call.
* Text after the tool section is dropped (vLLM keeps its Kimi parser in a tool state after
  the section for the same reason); a second section adds more calls.
* Markers with no meaning in a state are dropped (streaming Kimi parsers have crashed on them
  with ``IndexError``: vLLM issue #54701, SGLang issue #8269), except inside arguments, where
  ``<think>`` / ``</think>`` are data (a JSON string may hold them) and stay verbatim.
* Variants seen from Kimi models in the wild: the singular ``<|tool_call_section_begin|>`` /
  ``<|tool_call_section_end|>`` and older Kimi models' ``◁think▷`` / ``◁/think▷`` mean the same
  as the markers above (``KIMI_K2_MARKER_VARIANTS``).
* Ids are the model's, verbatim (clients echo them back; the renderer normalises history ids
  to ``functions.{name}:{n}``, since the chat template renders them verbatim and other ids
  broke Kimi tool calling on vLLM: vLLM blog "Chasing 100% Accuracy", 2025-10-28).
"""

from __future__ import annotations

import functools
import re

from inferplane.parsers._config import Action, EngineConfig, Sink, Transition
from inferplane.parsers._syntax import CallSyntax

__all__ = [
    "ARG_BEGIN",
    "CALL_BEGIN",
    "CALL_END",
    "KIMI_K2_MARKERS",
    "KIMI_K2_MARKER_VARIANTS",
    "SECTION_BEGIN",
    "SECTION_END",
    "THINK_BEGIN",
    "THINK_END",
    "kimi_k2_config",
    "split_kimi_header",
]

THINK_BEGIN = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

KIMI_K2_MARKERS: tuple[str, ...] = (
    THINK_BEGIN,
    THINK_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARG_BEGIN,
    CALL_END,
)

KIMI_K2_MARKER_VARIANTS: dict[str, str] = {
    "<|tool_call_section_begin|>": SECTION_BEGIN,
    "<|tool_call_section_end|>": SECTION_END,
    "◁think▷": THINK_BEGIN,
    "◁/think▷": THINK_END,
}
"""Variant marker -> the marker it stands for."""

# States.
KIMI_K2_CALLS = CallSyntax(
    section_begin=SECTION_BEGIN,
    section_end=SECTION_END,
    call_begin=CALL_BEGIN + "functions.{name}:",
    # The call's index in the conversation: at most 4 digits. Unbounded (``\d+``), a small
    # model forced into a call (tool_choice required or named) can write digits until
    # max_tokens: the release's conformance gate caught kimi-tiny returning 3-6 calls of 8.
    # A 256k-token context holds far fewer than 10,000 calls.
    call_id=r"\d{1,4}",
    args_begin=ARG_BEGIN,
    call_end=CALL_END,
    trigger=SECTION_BEGIN,
    reasoning_excludes=(SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END),
    text_excludes=(CALL_BEGIN,),
)
"""Kimi's calls for the decoding constraint (xgrammar's ``kimi`` tag)."""

START = "start"  # prompt did not open reasoning; nothing visible yet
REASONING = "reasoning"
CONTENT = "content"
SECTION = "section"  # inside the tool section, between calls
HEADER = "header"  # after <|tool_call_begin|>: ``functions.name:N``
ARGS = "args"  # after <|tool_call_argument_begin|>
AFTER = "after"  # after <|tool_calls_section_end|>

_PREFIX = "functions."
_COUNTER_RE = re.compile(r"(.*?)\s*:\s*(\d+)", re.DOTALL)
_NAMED_RE = re.compile(r"(?:functions\.)?[\w.\-]+:\d+")


def kimi_header_names_function(header: str) -> bool:
    """Whether a call header names its function by its form: ``functions.{name}:{n}`` or
    ``{name}:{n}`` (SGLang's rule, ``kimik2_detector.py``). A bare counter (``0``), a
    client-style id (``call_3``, ``toolu_01…``) or a name without counter does not: with the
    request's tools, such a call's function is resolved from its arguments."""
    return _NAMED_RE.fullmatch(header.strip()) is not None


def split_kimi_header(header: str, call_number: int) -> tuple[str, str] | None:
    """Split a Kimi call header into ``(id, name)``.

    ``functions.get_weather:0`` -> ``("functions.get_weather:0", "get_weather")``. The id is
    the header as written, surrounding whitespace trimmed (``get_weather:3`` stays
    ``get_weather:3``: clients echo ids back). A header without ``:N`` holds no id: it gets
    ``functions.{name}:{call_number}``, the form the chat template expects (``docs/kimi.md``).
    Returns None when no name is left.
    """
    h = header.strip()
    m = _COUNTER_RE.fullmatch(h)
    base = m.group(1).strip() if m is not None else h
    name = base.removeprefix(_PREFIX).strip()
    if not name:
        return None
    return (h if m is not None else f"{_PREFIX}{name}:{call_number}"), name


@functools.cache
def kimi_k2_config() -> EngineConfig:
    """The Kimi K2 / K2.5 format (cached: one immutable config per process)."""
    end_r = Action.END_REASONING
    tools = Action.BEGIN_TOOLS
    call = Action.BEGIN_CALL
    args = Action.BEGIN_ARGS
    end = Action.END_CALL
    t = Transition
    transitions: dict[tuple[str, str], Transition] = {
        # An explicit <think> before any content opens reasoning.
        (START, "THINK_BEGIN"): t(REASONING),
        (START, "THINK_END"): t(CONTENT),
        (START, "SECTION_BEGIN"): t(SECTION, (tools,)),
        (START, "CALL_BEGIN"): t(HEADER, (tools, call)),
        # Reasoning ends on </think> or on the tool section (the model skipped </think>).
        (REASONING, "THINK_END"): t(CONTENT, (end_r,)),
        (REASONING, "SECTION_BEGIN"): t(SECTION, (end_r, tools)),
        (REASONING, "CALL_BEGIN"): t(HEADER, (end_r, tools, call)),
        (CONTENT, "SECTION_BEGIN"): t(SECTION, (tools,)),
        (CONTENT, "CALL_BEGIN"): t(HEADER, (tools, call)),
        (SECTION, "CALL_BEGIN"): t(HEADER, (call,)),
        (SECTION, "SECTION_END"): t(AFTER),
        (HEADER, "ARG_BEGIN"): t(ARGS, (args,)),
        (HEADER, "CALL_END"): t(SECTION, (end,)),
        (HEADER, "CALL_BEGIN"): t(HEADER, (end, call)),
        (HEADER, "SECTION_END"): t(AFTER, (end,)),
        (ARGS, "CALL_END"): t(SECTION, (end,)),
        (ARGS, "CALL_BEGIN"): t(HEADER, (end, call)),
        (ARGS, "SECTION_END"): t(AFTER, (end,)),
        (AFTER, "SECTION_BEGIN"): t(SECTION),
        (AFTER, "CALL_BEGIN"): t(HEADER, (call,)),
    }
    terminals = {
        "THINK_BEGIN": THINK_BEGIN,
        "THINK_END": THINK_END,
        "SECTION_BEGIN": SECTION_BEGIN,
        "SECTION_END": SECTION_END,
        "CALL_BEGIN": CALL_BEGIN,
        "ARG_BEGIN": ARG_BEGIN,
        "CALL_END": CALL_END,
    }
    return EngineConfig(
        name="kimi_k2",
        call_syntax=KIMI_K2_CALLS,
        terminals=terminals,
        transitions=transitions,
        sinks={
            START: Sink.CONTENT,
            REASONING: Sink.REASONING,
            CONTENT: Sink.CONTENT,
            SECTION: Sink.DROP,
            HEADER: Sink.HEADER,
            ARGS: Sink.ARGS,
            AFTER: Sink.DROP,
        },
        initial_state=START,
        thinking_state=REASONING,
        text_transitions={START: CONTENT},
        split_header=split_kimi_header,
        empty_arguments="{}",
        aliases={
            variant: next(t for t, lit in terminals.items() if lit == marker)
            for variant, marker in KIMI_K2_MARKER_VARIANTS.items()
        },
        verbatim_states=frozenset({ARGS}),
        names_function=kimi_header_names_function,
    )
