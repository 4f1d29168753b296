"""The gpt-oss output format (OpenAI's harmony) as a declarative ``EngineConfig``.

Format (openai-harmony's renderer; vLLM serves it with its ``openai`` tool parser and
``HarmonyParser``, SGLang with ``GptOssDetector``). The prompt ends with
``<|start|>assistant``, so output starts with the first message's header::

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Tokyo"}<|call|>

or, answering::

    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>
    content<|return|>

A message is a header (``<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to=
{recipient}][ <|constrain|>{type}| {type}]``) and a body (``<|message|>...`` up to ``<|end|>``,
``<|call|>`` or ``<|return|>``). What a message is for is written in words in its header, not
in markers, so the machine buffers the header (``Action.BEGIN_MESSAGE``) and routes it whole at
``<|message|>`` (``Action.ROUTE``, ``route_harmony_message``), with vLLM's rules
(``vllm/parser/harmony.py`` ``_SegmentType``, ``harmony_utils.is_function_recipient``):

* a recipient naming a function (``functions.{name}``; or a bare name that is neither
  ``assistant`` nor a built-in tool ``python`` / ``browser`` / ``container``, the Chat
  Completions fallback) makes the body a tool call's JSON arguments, whatever the channel
  (gpt-oss also calls from ``analysis``);
* otherwise ``analysis`` is reasoning, ``final`` content, and ``commentary`` without a
  recipient (a preamble the user sees) content;
* anything else (a built-in tool's call, an unknown or missing channel, a message whose role is
  not ``assistant``) is dropped, never shown.

Rules beyond the happy path, and where they come from:

* Several messages of one kind join with a newline (vLLM's one-shot parse joins them with
  ``"\\n"``; its streaming path concatenates them, so one-piece and streamed output differ
  there; ours are equal).
* A header may come without ``<|start|>assistant`` (vLLM ``test_gptoss_reasoning_parser``:
  "the model omits the assistant tag entirely", ``...<|end|><|channel|>final``), and a body may
  end without ``<|end|>``: a new ``<|start|>`` or ``<|channel|>`` ends it.
* Text before the first header and between messages is dropped (SGLang's
  ``test_gpt_oss_complete_parsing`` keeps only the call of ``Let me search...<|channel|>
  commentary to=functions.search...``).
* ``<|call|>`` and ``<|return|>`` are stop tokens: the engine usually ends before writing them,
  so a body cut by the end of the stream is complete (a call keeps its arguments).
* Ids: the format has none; calls get ``call_{n}`` (``split_name_header``; vLLM makes random
  ones). An empty body gives ``{}`` (vLLM keeps ``""``, which no client can parse); a body that
  is not JSON stays as written for the validator (vLLM keeps it too).
* The markers are special tokens of ``o200k_harmony`` (``<|channel|>`` 200005, ``<|message|>``
  200008, ...); with the tokenizer's vocab they match by token id only, so text spelling them
  is text.
"""

from __future__ import annotations

import functools
import re

from inferplane.parsers._config import (
    Action,
    ArgumentsFormat,
    EngineConfig,
    Sink,
    Transition,
    split_name_header,
)
from inferplane.parsers._syntax import CallSyntax

__all__ = ["GPT_OSS_MARKERS", "gpt_oss_config", "route_harmony_message"]

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
CONSTRAIN = "<|constrain|>"

GPT_OSS_MARKERS: tuple[str, ...] = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)

# States.
HEADER = "header"  # a message header, buffered until <|message|>
REASONING = "reasoning"  # an analysis message's body
CONTENT = "content"  # a final message's (or a preamble's) body
ARGS = "args"  # a tool call's body: its JSON arguments
IGNORED = "ignored"  # the body of a message that is none of those (a built-in tool's call)
BETWEEN = "between"  # after a message: text here is dropped

GPT_OSS_CALLS = CallSyntax(
    call_begin=CHANNEL + "commentary to=functions.{name} " + CONSTRAIN + "json" + MESSAGE,
    call_end="",  # <|call|> is a stop token: xgrammar cannot require it under a constraint
    trigger=CHANNEL + "commentary to=",
    separator=START + "assistant",  # never reached: <|call|> ends the response
    reasoning_begin=CHANNEL + "analysis" + MESSAGE,
    reasoning_end=END,
    after_reasoning=START + "assistant",
    optional_reasoning=True,
    reasoning_excludes=(START, CHANNEL, MESSAGE, CALL, RETURN),
    # A call in another form (from ``analysis``, or the recipient in the role) would escape
    # the trigger, so only the commentary form is left open.
    text_excludes=(CHANNEL + "analysis to=", CHANNEL + "final to=", "assistant to="),
    # vLLM's _FINAL_BEGIN variants for a structured answer.
    answer_begins=tuple(
        CHANNEL + "final" + c + MESSAGE for c in (" " + CONSTRAIN + "json", " json", "")
    ),
)
"""gpt-oss's calls for the decoding constraint (xgrammar's ``harmony`` tag: one optional
``analysis`` message, then ``<|channel|>commentary to=functions.{name} <|constrain|>json
<|message|>`` and the JSON arguments)."""

FUNCTIONS_PREFIX = "functions."
ASSISTANT = "assistant"
BUILTIN_TOOLS = frozenset({"python", "browser", "container"})

_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")


def _function_name(recipient: str) -> str | None:
    """The function a recipient names, or None (vLLM ``is_function_recipient``, Chat
    Completions form: no allow-list, so a bare name is a function)."""
    if recipient.startswith(FUNCTIONS_PREFIX):
        return recipient[len(FUNCTIONS_PREFIX) :] or None
    if recipient == ASSISTANT or recipient.split(".", 1)[0] in BUILTIN_TOOLS:
        return None
    return recipient


def route_harmony_message(header: str) -> tuple[str, str | None]:
    """Where a harmony message's body goes (the config's ``MessageRouter``).

    Args:
        header: the raw header, from ``<|start|>`` or ``<|channel|>`` (or the start of the
            output) up to ``<|message|>``, markers included:
            ``"<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"``.

    Returns:
        ``(state, function name or None)`` by the module docstring's rules.
    """
    role_part, sep, channel_part = header.partition(CHANNEL)
    if role_part.startswith(START):
        role = _WORD.match(role_part, len(START))
        if role is not None and role.group(1) != ASSISTANT and not role.group(1).startswith("to="):
            return IGNORED, None  # the model wrote another role's turn
    found = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
    if found is not None:
        name = _function_name(found.group(1))
        return (ARGS, name) if name is not None else (IGNORED, None)
    channel = _WORD.match(channel_part) if sep else None
    word = channel.group(1) if channel is not None else None
    if word == "analysis":
        return REASONING, None
    if word in ("final", "commentary"):
        return CONTENT, None
    return IGNORED, None


@functools.cache
def gpt_oss_config() -> EngineConfig:
    """The gpt-oss harmony format (cached: one immutable config per process)."""
    t = Transition
    begin = Action.BEGIN_MESSAGE
    transitions: dict[tuple[str, str], Transition] = {
        # <|channel|> and <|constrain|> have no transition in HEADER: it keeps them as text
        # (``verbatim_states``), so the router sees the whole header.
        (HEADER, "MESSAGE"): t(HEADER, (Action.ROUTE,)),
        (HEADER, "START"): t(HEADER, (begin,)),
        (BETWEEN, "START"): t(HEADER, (begin,)),
        (BETWEEN, "CHANNEL"): t(HEADER, (begin,)),
    }
    closing = {
        REASONING: (Action.END_REASONING,),
        CONTENT: (),
        ARGS: (Action.END_CALL,),
        IGNORED: (),
    }
    for state, close in closing.items():
        for term in ("END", "CALL", "RETURN"):
            transitions[(state, term)] = t(BETWEEN, close)
        for term in ("START", "CHANNEL"):
            transitions[(state, term)] = t(HEADER, (*close, begin))
    for term in ("END", "CALL", "RETURN"):
        transitions[(HEADER, term)] = t(BETWEEN)  # a header without a body says nothing
    return EngineConfig(
        name="gpt_oss",
        call_syntax=GPT_OSS_CALLS,
        terminals={
            "START": START,
            "CHANNEL": CHANNEL,
            "MESSAGE": MESSAGE,
            "END": END,
            "CALL": CALL,
            "RETURN": RETURN,
            "CONSTRAIN": CONSTRAIN,
        },
        transitions=transitions,
        sinks={
            HEADER: Sink.HEADER,
            REASONING: Sink.REASONING,
            CONTENT: Sink.CONTENT,
            ARGS: Sink.ARGS,
            IGNORED: Sink.DROP,
            BETWEEN: Sink.DROP,
        },
        initial_state=HEADER,
        thinking_state=HEADER,
        split_header=split_name_header,
        empty_arguments="{}",
        verbatim_states=frozenset({HEADER, ARGS}),
        arguments_format=ArgumentsFormat.JSON,
        route=route_harmony_message,
    )
