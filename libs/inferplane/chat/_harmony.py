"""gpt-oss prompts rendered by the openai-harmony library (issue 19 §3), not a Jinja template.

gpt-oss was trained on OpenAI's harmony format, and vLLM renders its chat requests through
``openai_harmony`` (``vllm/entrypoints/openai/parser/harmony_utils.py``) rather than the
model's ``chat_template``; so do we, with vLLM's mapping of OpenAI messages:

* one ``system`` message: the library's ``SystemContent`` (model identity, knowledge cutoff,
  valid channels) with the request's ``reasoning_effort`` (``low`` / ``medium`` / ``high``;
  default the library's, medium). gpt-oss cannot switch reasoning off, so ``none`` and
  ``minimal`` are refused (as vLLM refuses them). No conversation date is written: vLLM writes
  today's, which changes the prompt (and empties the prefix cache) every day.
* a ``developer`` message: the text of the leading ``system`` / ``developer`` messages as its
  instructions, and the request's tools as the harmony ``functions`` namespace (the library
  writes the TypeScript-like declarations from each JSON schema). A later ``system`` /
  ``developer`` message becomes a developer message of its own.
* history: an assistant message's ``reasoning_content`` → ``analysis``; its text → ``final``,
  or a ``commentary`` preamble when it also calls tools; each call → ``commentary`` to
  ``functions.{name}`` with ``<|constrain|>json`` (the form the model writes); a ``tool``
  message → from ``functions.{name}`` (the name of the call its ``tool_call_id`` answers) to
  ``assistant``. The library drops the ``analysis`` messages that precede a ``final`` one.
* the prompt ends with ``<|start|>assistant``; token ids are the library's ``o200k_harmony``
  ids, whose vocabulary is embedded in the ``openai_harmony`` extension (the ``oss-harmony``
  wheel that vLLM depends on), so nothing is downloaded.

The model's tokenizer must be ``o200k_harmony`` (gpt-oss's own): the renderer checks that the
harmony markers have the same ids in its vocabulary, and refuses a model where they do not.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inferplane.chat._errors import ChatRenderError
from inferplane.chat._family import GPT_OSS
from inferplane.chat._normalize import prepare_chat

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message

__all__ = ["HARMONY_EFFORTS", "harmony_messages", "render_harmony"]

HARMONY_EFFORTS = ("low", "medium", "high")
"""``reasoning_effort`` values gpt-oss understands (its system message's ``Reasoning:``)."""

_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")


@functools.cache
def _encoding() -> HarmonyEncoding:
    """The ``o200k_harmony`` encoding (loaded once; the library embeds its vocabulary)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_messages(request: Mapping[str, Any]) -> list[Message]:
    """An OpenAI chat request (plain JSON-like values) → harmony messages, by the module's
    rules; ``messages``, ``tools``, ``tool_choice``, ``reasoning_effort`` and
    ``chat_template_kwargs`` are read, other fields are ignored.

    Raises:
        ChatRenderError: the request is malformed (the shared normalisation's errors), its
            ``reasoning_effort`` is not one of ``HARMONY_EFFORTS``, or it sets
            ``chat_template_kwargs`` (harmony has no template to pass them to).
    """
    from openai_harmony import (
        Author,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    inputs = prepare_chat(request, GPT_OSS)
    if inputs.template_kwargs:
        key = sorted(inputs.template_kwargs)[0]
        raise ChatRenderError(
            "gpt-oss prompts are rendered by openai-harmony, which takes no "
            f"chat_template_kwargs (got {key!r})",
            param=f"chat_template_kwargs.{key}",
        )
    system = SystemContent.new()
    effort = request.get("reasoning_effort")
    if effort is not None:
        if effort not in HARMONY_EFFORTS:
            raise ChatRenderError(
                f"reasoning_effort {effort!r} is not supported by gpt-oss; "
                f"use one of {', '.join(HARMONY_EFFORTS)}",
                param="reasoning_effort",
            )
        system = system.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    out: list[Message] = [Message.from_role_and_content(Role.SYSTEM, system)]

    messages = list(inputs.messages)
    instructions: list[str] = []
    while messages and messages[0]["role"] == "system":
        if messages[0]["content"]:
            instructions.append(messages[0]["content"])
        messages.pop(0)
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if inputs.tools:
        developer = developer.with_function_tools(
            [
                ToolDescription.new(
                    fn["name"], fn.get("description") or "", parameters=fn.get("parameters")
                )
                for fn in (t["function"] for t in inputs.tools)
            ]
        )
    if instructions or inputs.tools:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))

    call_names: dict[str, str] = {}
    for msg in messages:
        role = msg["role"]
        if role == "system":
            later = DeveloperContent.new().with_instructions(msg["content"])
            out.append(Message.from_role_and_content(Role.DEVELOPER, later))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, msg["content"]))
        elif role == "tool":
            name = call_names.get(msg["tool_call_id"], "")
            author = Author.new(Role.TOOL, f"functions.{name}")
            out.append(
                Message.from_author_and_content(author, msg["content"])
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        else:
            calls = msg.get("tool_calls") or ()
            reasoning = msg.get("reasoning_content")
            if reasoning:
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel(
                        "analysis"
                    )
                )
            if msg["content"]:
                channel = "commentary" if calls else "final"
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, msg["content"]).with_channel(
                        channel
                    )
                )
            for call in calls:
                fn = call["function"]
                if call.get("id"):
                    call_names[call["id"]] = fn["name"]
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, fn["arguments"])
                    .with_channel("commentary")
                    .with_recipient(f"functions.{fn['name']}")
                    .with_content_type("<|constrain|>json")
                )
    return out


def render_harmony(request: Mapping[str, Any], tokenizer: Any) -> tuple[str, list[int]]:
    """The prompt text and token ids of a gpt-oss chat request (``harmony_messages``, rendered
    for the assistant's next turn).

    Args:
        request: the OpenAI chat request body (plain JSON-like values).
        tokenizer: the model's tokenizer; its vocabulary must give the harmony markers the
            ``o200k_harmony`` ids (``get_vocab()``), or it is not gpt-oss's.

    Raises:
        ChatRenderError: the request is invalid (``harmony_messages``).
        RuntimeError: the tokenizer's vocabulary is not ``o200k_harmony`` (a deployment
            error, not the client's).
    """
    from openai_harmony import Conversation, Role

    enc = _encoding()
    _check_tokenizer(tokenizer, enc)
    conversation = Conversation.from_messages(harmony_messages(request))
    ids = [int(i) for i in enc.render_conversation_for_completion(conversation, Role.ASSISTANT)]
    return enc.decode_utf8(ids), ids


def _check_tokenizer(tokenizer: Any, enc: HarmonyEncoding) -> None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    if not isinstance(vocab, Mapping):
        raise RuntimeError("the gpt_oss family needs a tokenizer with get_vocab()")
    for marker in _MARKERS:
        want = enc.encode(marker, allowed_special="all")
        got = vocab.get(marker)
        if [got] != want:
            raise RuntimeError(
                f"the model's tokenizer is not o200k_harmony: {marker} is {got!r}, "
                f"harmony's is {want[0] if len(want) == 1 else want!r}"
            )
