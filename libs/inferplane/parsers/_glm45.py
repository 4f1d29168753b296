"""The GLM-4.5 / GLM-4.6 output format (also GLM-4.7's) as a declarative ``EngineConfig``.

Format (vLLM's ``glm45`` reasoning parser and ``glm4_moe`` tool parser, SGLang's
``Glm4MoeDetector``)::

    <think>reasoning</think>content<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Rules beyond the happy path, and where they come from:

* GLM-4.5 / 4.6 write ``<think>`` themselves (their template adds ``<think></think>`` to the
  prompt when thinking is off): ``start(thinking=False)``, and a leading ``<think>`` opens
  reasoning (vLLM ``tests/reasoning/test_glm4_moe_reasoning_parser.py``: no ``<think>``, all
  content). GLM-4.7 and later templates open ``<think>`` in the prompt: ``thinking=True``. A
  ``<think>`` never closed stays reasoning (vLLM's streaming result; its one-shot parse
  returns it as content, marker included).
* ``<tool_call>`` ends reasoning when the model skipped ``</think>`` (vLLM's GLM-4.7 engine
  config: ``(REASONING, TOOL_START)``); reasoning never resumes.
* The header is the function name: the first line of the text before the first
  ``<arg_key>`` (GLM-4.7 omits the newline; SGLang also accepts a literal ``\\n``), trimmed.
  GLM writes no call id: calls get ``call_{n}`` (``split_name_header``). With the request's
  tools an undeclared name is passed through for its ``unknown_tool`` verdict (vLLM); SGLang
  drops it.
* Arguments (``ArgumentsFormat.KEY_VALUE``): each ``<arg_key>k</arg_key><arg_value>v
  </arg_value>`` pair becomes ``"k": value`` of a JSON object. A value is a string, verbatim
  (whitespace kept: vLLM and SGLang ``test_whitespace_preserved_in_arg_values``), streamed
  as it comes, unless the request's tools declare the parameter with types that exclude
  string: then it is JSON, decoded when it ends (``decode_json_value``: JSON, unescaped JSON,
  Python literal, else the string). vLLM and SGLang also decode values of parameters they
  cannot find in the tools; we keep those strings (no schema says otherwise). A call with no
  pairs has ``{}``; a key without a value is dropped; a call cut off by the end of the
  stream keeps what streamed, without its closing ``}``.
* Text between and after calls is content: vLLM's streaming parser emits it
  (``test_stream_interval_content_between_tool_calls``), as does SGLang's; their one-shot
  parses drop it, which a split-invariant parser cannot do for one and not the other.
* Markers with no meaning in a state are dropped; inside a value every marker except
  ``</arg_value>`` and ``</tool_call>`` is data.
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

__all__ = ["GLM45_MARKERS", "glm45_config", "split_glm_header"]

THINK_BEGIN = "<think>"
THINK_END = "</think>"
CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
KEY_BEGIN = "<arg_key>"
KEY_END = "</arg_key>"
VALUE_BEGIN = "<arg_value>"
VALUE_END = "</arg_value>"

GLM45_MARKERS: tuple[str, ...] = (
    THINK_BEGIN,
    THINK_END,
    CALL_BEGIN,
    CALL_END,
    KEY_BEGIN,
    KEY_END,
    VALUE_BEGIN,
    VALUE_END,
)

# States.
_ARG_MARKERS = (KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END)
GLM45_CALLS = CallSyntax(
    call_begin=CALL_BEGIN + "{name}",
    call_end=CALL_END,
    trigger=CALL_BEGIN,
    arguments_style="glm_xml",
    optional_reasoning=True,
    reasoning_excludes=(CALL_BEGIN, CALL_END, *_ARG_MARKERS),
    text_excludes=(CALL_END, *_ARG_MARKERS),
)
"""GLM's calls for the decoding constraint (xgrammar's ``glm_4_7`` tag: ``<arg_key>`` /
``<arg_value>`` pairs in its ``glm_xml`` style). The model opens ``<think>`` itself, so a
forced call may follow one reasoning block."""

START = "start"  # prompt did not open reasoning; nothing visible yet
REASONING = "reasoning"
CONTENT = "content"
HEADER = "header"  # after <tool_call>: the function name
KEY = "key"  # after <arg_key>
PAIR = "pair"  # after </arg_key>, before <arg_value>
VALUE = "value"  # after <arg_value>
PAIRS = "pairs"  # after </arg_value>: between parameters


def split_glm_header(header: str, call_number: int) -> tuple[str, str] | None:
    """``get_weather\\n`` -> ``("call_{call_number}", "get_weather")``: the header's first
    line (a literal backslash-n also ends it, SGLang's ``Glm4MoeDetector``), trimmed; None
    when blank."""
    h = header.strip()
    name = h.split("\n", 1)[0].split("\\n", 1)[0]
    return split_name_header(name, call_number)


@functools.cache
def glm45_config() -> EngineConfig:
    """The GLM-4.5 format (cached: one immutable config per process)."""
    end_r = Action.END_REASONING
    tools = Action.BEGIN_TOOLS
    call = Action.BEGIN_CALL
    args = Action.BEGIN_ARGS
    end = Action.END_CALL
    key = Action.BEGIN_KEY
    value = Action.BEGIN_VALUE
    end_value = Action.END_VALUE
    t = Transition
    transitions: dict[tuple[str, str], Transition] = {
        (START, "THINK_BEGIN"): t(REASONING),
        (START, "THINK_END"): t(CONTENT),
        (START, "CALL_BEGIN"): t(HEADER, (tools, call)),
        (REASONING, "THINK_END"): t(CONTENT, (end_r,)),
        (REASONING, "CALL_BEGIN"): t(HEADER, (end_r, tools, call)),
        (CONTENT, "CALL_BEGIN"): t(HEADER, (tools, call)),
        (HEADER, "KEY_BEGIN"): t(KEY, (args, key)),
        (HEADER, "CALL_END"): t(CONTENT, (end,)),
        (HEADER, "CALL_BEGIN"): t(HEADER, (end, call)),
        (KEY, "KEY_END"): t(PAIR),
        (KEY, "VALUE_BEGIN"): t(VALUE, (value,)),  # </arg_key> skipped
        (KEY, "KEY_BEGIN"): t(KEY, (key,)),
        (KEY, "CALL_END"): t(CONTENT, (end,)),
        (PAIR, "VALUE_BEGIN"): t(VALUE, (value,)),
        (PAIR, "KEY_BEGIN"): t(KEY, (key,)),
        (PAIR, "CALL_END"): t(CONTENT, (end,)),
        (VALUE, "VALUE_END"): t(PAIRS, (end_value,)),
        (VALUE, "CALL_END"): t(CONTENT, (end_value, end)),  # </arg_value> skipped
        (PAIRS, "KEY_BEGIN"): t(KEY, (key,)),
        (PAIRS, "CALL_END"): t(CONTENT, (end,)),
        (PAIRS, "CALL_BEGIN"): t(HEADER, (end, call)),
    }
    return EngineConfig(
        name="glm45",
        call_syntax=GLM45_CALLS,
        terminals={
            "THINK_BEGIN": THINK_BEGIN,
            "THINK_END": THINK_END,
            "CALL_BEGIN": CALL_BEGIN,
            "CALL_END": CALL_END,
            "KEY_BEGIN": KEY_BEGIN,
            "KEY_END": KEY_END,
            "VALUE_BEGIN": VALUE_BEGIN,
            "VALUE_END": VALUE_END,
        },
        transitions=transitions,
        sinks={
            START: Sink.CONTENT,
            REASONING: Sink.REASONING,
            CONTENT: Sink.CONTENT,
            HEADER: Sink.HEADER,
            KEY: Sink.ARG_KEY,
            PAIR: Sink.DROP,
            VALUE: Sink.ARG_VALUE,
            PAIRS: Sink.DROP,
        },
        initial_state=START,
        thinking_state=REASONING,
        text_transitions={START: CONTENT},
        split_header=split_glm_header,
        empty_arguments="{}",
        verbatim_states=frozenset({VALUE}),
        arguments_format=ArgumentsFormat.KEY_VALUE,
    )
