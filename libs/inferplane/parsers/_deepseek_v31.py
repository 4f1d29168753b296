"""The DeepSeek-V3.1 output format as a declarative ``EngineConfig``.

Format (marker strings as in vLLM's ``deepseekv31_tool_parser.py`` and SGLang's
``deepseekv31_detector.py``: full-width bars U+FF5C and U+2581 "▁" between words)::

    reasoning</think>content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
    {"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Rules beyond the happy path, and where they come from:

* Thinking mode: the chat template ends the prompt with ``<think>``, so output starts inside
  reasoning (``start(thinking=True)``); non-thinking mode puts ``</think>`` in the prompt
  (``thinking=False``: all content). vLLM's ``deepseek_v3`` reasoning parser picks its R1
  parser or the identity parser the same way. An explicit ``<think>`` is accepted in reasoning
  or before any content; a stray ``</think>`` in content is dropped.
* Reasoning ends on ``</think>`` or on the tool section (or a call marker without a section)
  and never resumes, as for Kimi. vLLM's R1 reasoning parser keeps a section written before
  ``</think>`` in the reasoning text, markers and all; we end reasoning there instead.
* The header between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁sep｜>`` is the function name
  (trimmed); DeepSeek writes no call id, so calls get ``call_{n}`` (``split_name_header``).
  With the request's tools an undeclared name is passed through for its ``unknown_tool``
  verdict (vLLM); SGLang's ``parse_base_json`` drops it.
* The arguments are JSON, streamed as written (``ArgumentsStream``: trailing-comma repair,
  schema coercion); invalid JSON stays as written for the validator (vLLM keeps it; SGLang's
  one-shot parse turns the whole output back into text).
* Text after ``<｜tool▁calls▁end｜>`` is dropped (vLLM's ``extract_tool_calls`` returns only the
  text before the section); a second section adds more calls. Markers with no meaning in a
  state are dropped, except inside arguments, where ``<think>`` / ``</think>`` are data.
"""

from __future__ import annotations

import functools

from inferplane.parsers._config import (
    Action,
    EngineConfig,
    Sink,
    Transition,
    split_name_header,
)
from inferplane.parsers._syntax import CallSyntax

__all__ = [
    "DEEPSEEK_V31_MARKERS",
    "deepseek_v31_config",
]

THINK_BEGIN = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<｜tool▁calls▁begin｜>"
SECTION_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"

DEEPSEEK_V31_MARKERS: tuple[str, ...] = (
    THINK_BEGIN,
    THINK_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    SEP,
    CALL_END,
)

# States (the same machine as Kimi's: a section of calls, each a header then arguments).
DEEPSEEK_V31_CALLS = CallSyntax(
    section_begin=SECTION_BEGIN,
    section_end=SECTION_END,
    call_begin=CALL_BEGIN + "{name}" + SEP,
    call_end=CALL_END,
    trigger=SECTION_BEGIN,
    reasoning_excludes=(SECTION_BEGIN, SECTION_END, CALL_BEGIN, SEP, CALL_END),
    text_excludes=(CALL_BEGIN,),
)
"""DeepSeek-V3.1's calls for the decoding constraint (xgrammar's ``deepseek_v3_1`` tag)."""

START = "start"  # prompt did not open reasoning; nothing visible yet
REASONING = "reasoning"
CONTENT = "content"
SECTION = "section"  # inside the tool section, between calls
HEADER = "header"  # after <｜tool▁call▁begin｜>: the function name
ARGS = "args"  # after <｜tool▁sep｜>
AFTER = "after"  # after <｜tool▁calls▁end｜>


@functools.cache
def deepseek_v31_config() -> EngineConfig:
    """The DeepSeek-V3.1 format (cached: one immutable config per process)."""
    end_r = Action.END_REASONING
    tools = Action.BEGIN_TOOLS
    call = Action.BEGIN_CALL
    args = Action.BEGIN_ARGS
    end = Action.END_CALL
    t = Transition
    transitions: dict[tuple[str, str], Transition] = {
        (START, "THINK_BEGIN"): t(REASONING),
        (START, "THINK_END"): t(CONTENT),
        (START, "SECTION_BEGIN"): t(SECTION, (tools,)),
        (START, "CALL_BEGIN"): t(HEADER, (tools, call)),
        (REASONING, "THINK_END"): t(CONTENT, (end_r,)),
        (REASONING, "SECTION_BEGIN"): t(SECTION, (end_r, tools)),
        (REASONING, "CALL_BEGIN"): t(HEADER, (end_r, tools, call)),
        (CONTENT, "SECTION_BEGIN"): t(SECTION, (tools,)),
        (CONTENT, "CALL_BEGIN"): t(HEADER, (tools, call)),
        (SECTION, "CALL_BEGIN"): t(HEADER, (call,)),
        (SECTION, "SECTION_END"): t(AFTER),
        (HEADER, "SEP"): t(ARGS, (args,)),
        (HEADER, "CALL_END"): t(SECTION, (end,)),
        (HEADER, "CALL_BEGIN"): t(HEADER, (end, call)),
        (HEADER, "SECTION_END"): t(AFTER, (end,)),
        (ARGS, "CALL_END"): t(SECTION, (end,)),
        (ARGS, "CALL_BEGIN"): t(HEADER, (end, call)),
        (ARGS, "SECTION_END"): t(AFTER, (end,)),
        (AFTER, "SECTION_BEGIN"): t(SECTION),
        (AFTER, "CALL_BEGIN"): t(HEADER, (call,)),
    }
    return EngineConfig(
        name="deepseek_v31",
        call_syntax=DEEPSEEK_V31_CALLS,
        terminals={
            "THINK_BEGIN": THINK_BEGIN,
            "THINK_END": THINK_END,
            "SECTION_BEGIN": SECTION_BEGIN,
            "SECTION_END": SECTION_END,
            "CALL_BEGIN": CALL_BEGIN,
            "SEP": SEP,
            "CALL_END": CALL_END,
        },
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
        split_header=split_name_header,
        empty_arguments="{}",
        verbatim_states=frozenset({ARGS}),
    )
