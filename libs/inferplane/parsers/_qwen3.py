"""The Qwen3 output format (hermes-style JSON tool calls) as a declarative ``EngineConfig``.

Format (vLLM serves it with its ``qwen3`` reasoning parser and ``hermes`` tool parser, SGLang
with ``Qwen25Detector``)::

    <think>
    reasoning
    </think>

    content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Rules beyond the happy path, and where they come from:

* Both thinking modes (vLLM ``tests/reasoning/test_qwen3_reasoning_parser.py``): the original
  Qwen3 writes ``<think>`` itself, Qwen3-2507 Thinking / Qwen3.5 templates open it in the
  prompt so output carries only ``</think>``. ``start(thinking=True)``: output starts inside
  reasoning and an explicit ``<think>`` there is dropped; ``thinking=False`` (``enable_thinking:
  false``): output is content, unless it opens with ``<think>``. Reasoning with no
  ``</think>`` (cut off) stays reasoning.
* ``<tool_call>`` ends reasoning when the model skipped ``</think>`` (vLLM's Qwen3 parser:
  "``<tool_call>`` as implicit reasoning end"); reasoning never resumes.
* Each call body is one JSON object read by ``JsonEnvelope``: the call opens (id and name
  streamed) once the ``"name"`` string closes, then the ``"arguments"`` value streams as it
  comes, through ``ArgumentsStream`` (trailing-comma repair, schema coercion). A body naming
  no function (``<tool_call>not json</tool_call>``) is dropped and the calls around it kept
  (SGLang skips such a block; vLLM's one-shot parse returns the whole output as text, markers
  included). ``"arguments"`` holding a serialized object is unwrapped (vLLM hermes).
* Ids: the format has none; calls get ``call_{n}`` (``split_name_header``: deterministic, not
  vLLM's random ``chatcmpl-tool-{uuid}``, so one-piece and streamed parses agree).
* With the request's tools, an undeclared name is passed through for its ``unknown_tool``
  verdict (vLLM); SGLang drops it.
* Text after the first ``<tool_call>`` that is not inside a call is dropped: vLLM's hermes
  parser returns only the text before the first call, streaming or not, and so does SGLang's
  one-shot parse. A missing ``</tool_call>`` before the next ``<tool_call>`` ends the call.
* Markers with no meaning in a state are dropped; inside a call body ``<think>`` /
  ``</think>`` are data (a JSON string may hold them).
"""

from __future__ import annotations

import functools

from inferplane.parsers._config import (
    Action,
    ArgumentsFormat,
    EngineConfig,
    Sink,
    Transition,
    split_name_header,
)
from inferplane.parsers._syntax import CallSyntax

__all__ = ["QWEN3_MARKERS", "qwen3_config"]

THINK_BEGIN = "<think>"
THINK_END = "</think>"
CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"

QWEN3_MARKERS: tuple[str, ...] = (THINK_BEGIN, THINK_END, CALL_BEGIN, CALL_END)

# States.
QWEN3_CALLS = CallSyntax(
    call_begin=CALL_BEGIN + '\n{"name": "{name}", "arguments": ',
    call_end="}\n" + CALL_END,
    trigger=CALL_BEGIN,
    separator="\n",
    after_reasoning="\n\n",
    model_writes_think=True,
    reasoning_excludes=(CALL_BEGIN, CALL_END),
    text_excludes=(CALL_END,),
)
"""Qwen3's calls for the decoding constraint (xgrammar's ``qwen_3`` tag: the envelope written
around the arguments, ``</think>\n\n`` before a forced call). The original Qwen3 writes
``<think>`` itself even when the prompt opened reasoning, so reasoning may hold it."""

START = "start"  # prompt did not open reasoning; nothing visible yet
REASONING = "reasoning"
CONTENT = "content"
BODY = "body"  # after <tool_call>: the call's JSON object
BETWEEN = "between"  # after </tool_call>: text here is dropped


@functools.cache
def qwen3_config() -> EngineConfig:
    """The Qwen3 format (cached: one immutable config per process)."""
    end_r = Action.END_REASONING
    tools = Action.BEGIN_TOOLS
    call = Action.BEGIN_CALL
    end = Action.END_CALL
    t = Transition
    transitions: dict[tuple[str, str], Transition] = {
        (START, "THINK_BEGIN"): t(REASONING),
        (START, "THINK_END"): t(CONTENT),
        (START, "CALL_BEGIN"): t(BODY, (tools, call)),
        (REASONING, "THINK_END"): t(CONTENT, (end_r,)),
        (REASONING, "CALL_BEGIN"): t(BODY, (end_r, tools, call)),
        (CONTENT, "CALL_BEGIN"): t(BODY, (tools, call)),
        (BODY, "CALL_END"): t(BETWEEN, (end,)),
        (BODY, "CALL_BEGIN"): t(BODY, (end, call)),
        (BETWEEN, "CALL_BEGIN"): t(BODY, (call,)),
    }
    return EngineConfig(
        name="qwen3",
        call_syntax=QWEN3_CALLS,
        terminals={
            "THINK_BEGIN": THINK_BEGIN,
            "THINK_END": THINK_END,
            "CALL_BEGIN": CALL_BEGIN,
            "CALL_END": CALL_END,
        },
        transitions=transitions,
        sinks={
            START: Sink.CONTENT,
            REASONING: Sink.REASONING,
            CONTENT: Sink.CONTENT,
            BODY: Sink.BODY,
            BETWEEN: Sink.DROP,
        },
        initial_state=START,
        thinking_state=REASONING,
        text_transitions={START: CONTENT},
        split_header=split_name_header,
        empty_arguments="{}",
        verbatim_states=frozenset({BODY}),
        arguments_format=ArgumentsFormat.ENVELOPE,
    )
