"""Chat families: how one model family's chat template wants its inputs, as a frozen config.

The template itself comes with the model (its tokenizer); what differs between families is what
the renderer must do before the template sees a request, and which keyword switches thinking::

    family (parser)   thinking kwarg, default   parse from reasoning  history ids  arguments
    kimi_k2           thinking, on              yes                   Kimi's       JSON text
    qwen3             enable_thinking, on       yes                   verbatim     JSON text
    deepseek_v31      thinking, off             yes                   verbatim     JSON text
    glm45             enable_thinking, on       no                    verbatim     object
    gpt_oss           none (reasoning_effort)   no                    verbatim     JSON text
    (no parser)       none                      no                    verbatim     object

gpt_oss is not rendered by a template at all: its prompt is built by the openai-harmony library
(``Renderer.HARMONY``, ``inferplane.chat._harmony``), as vLLM builds it.

Sources, per family:

- Kimi K2 / K2.5 (the model repo's ``chat_template.jinja``; facts and sources in
  ``docs/kimi.md``): the generation prompt opens ``<think>`` (``thinking``,
  default on); history ids must read ``functions.{name}:{n}`` (the template renders them
  verbatim, and a client id shows the model a format it never wrote); arguments render as the
  JSON text the model wrote.
- Qwen3 (Qwen/Qwen3-8B ``tokenizer_config.json``): ``enable_thinking`` (default on; off adds an
  empty ``<think>`` block to the generation prompt); the template never shows an id; arguments
  go through ``tojson`` unless they are a string, which it prints verbatim: so they stay the
  text the model wrote (``tojson`` of the parsed object would rewrite ``{"city":"Oslo"}`` as
  ``{"city": "Oslo"}``, and the next turn's prompt would no longer begin with the previous
  prompt and output, which the prefix cache needs). The parser starts inside reasoning when
  thinking is on (``inferplane.parsers._qwen3``: Qwen3 writes ``<think>`` itself, which is
  dropped there, and Qwen3-2507 templates open it in the prompt).
- DeepSeek-V3.1 (deepseek-ai/DeepSeek-V3.1 ``tokenizer_config.json``): ``thinking`` (default
  off); the generation prompt ends with ``<think>`` or ``</think>``; arguments are concatenated
  as a string (``+ tool['function']['arguments'] +``), so they must stay text.
- GLM-4.5 / 4.6 (zai-org/GLM-4.5 ``chat_template.jinja``): ``enable_thinking`` (default on;
  off adds ``<think></think>``); the model writes ``<think>`` itself, so the parser starts
  outside reasoning (``inferplane.parsers._glm45``); arguments are iterated with
  ``.items()``, so they must be an object.
- gpt-oss (openai/gpt-oss-20b; vLLM ``harmony_utils.py``): harmony messages from the
  openai-harmony library; reasoning cannot be switched off, only its effort set; history calls
  carry their arguments as the JSON text the model wrote; ids are not rendered.
- No parser: transformers' convention, which vLLM applies to every template
  (vllm/entrypoints/chat_utils.py ``_postprocess_messages``: "tool call arguments ... need to be
  dicts"); no thinking switch is known, so ``chat_template_kwargs`` pass through untouched.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from inferplane.chat._errors import UnknownChatFamilyError


class HistoryIds(enum.Enum):
    """How the ids of history tool calls (and the ``tool_call_id`` of their results) render."""

    KIMI = "kimi"
    """``functions.{name}:{n}``, ``n`` counting calls across the conversation."""
    VERBATIM = "verbatim"
    """As the client sent them (a missing id stays missing)."""


class Renderer(enum.Enum):
    """What turns a prepared request into the prompt."""

    TEMPLATE = "template"
    """The model's own chat template (``tokenizer.apply_chat_template``)."""
    HARMONY = "harmony"
    """The openai-harmony library (gpt-oss): no template is used."""


class ArgumentsForm(enum.Enum):
    """What a history tool call's ``function.arguments`` is when the template sees it."""

    JSON_TEXT = "json_text"
    """A string: the client's string verbatim, an object as compact-spaced JSON text."""
    OBJECT = "object"
    """A JSON object: an object as is, a string parsed when it holds a JSON object (else kept
    verbatim, for templates with a string branch)."""


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """How to prepare a request for one family's chat template.

    Attributes:
        name: the family's name (the parser name that selects it; ``"generic"`` for none).
        thinking_kwarg: the template keyword that switches thinking (``chat_template_kwargs``
            key the client may set, a boolean), or None when the family has none.
        thinking_default: its value when the client does not set it (the template's default).
        parse_from_reasoning: with thinking on, the model's output is parsed from inside
            reasoning (``RenderedPrompt.thinking``): the prompt opened ``<think>``, or the
            model writes it first and the parser drops it there.
        history_ids: how history tool-call ids render.
        arguments: what history tool-call arguments are for the template.
        renderer: what renders the prompt (the model's template, or openai-harmony).
    """

    name: str
    thinking_kwarg: str | None
    thinking_default: bool
    parse_from_reasoning: bool
    history_ids: HistoryIds
    arguments: ArgumentsForm
    renderer: Renderer = Renderer.TEMPLATE


KIMI_K2 = ChatFamily(
    name="kimi_k2",
    thinking_kwarg="thinking",
    thinking_default=True,
    parse_from_reasoning=True,
    history_ids=HistoryIds.KIMI,
    arguments=ArgumentsForm.JSON_TEXT,
)
QWEN3 = ChatFamily(
    name="qwen3",
    thinking_kwarg="enable_thinking",
    thinking_default=True,
    parse_from_reasoning=True,
    history_ids=HistoryIds.VERBATIM,
    arguments=ArgumentsForm.JSON_TEXT,
)
DEEPSEEK_V31 = ChatFamily(
    name="deepseek_v31",
    thinking_kwarg="thinking",
    thinking_default=False,
    parse_from_reasoning=True,
    history_ids=HistoryIds.VERBATIM,
    arguments=ArgumentsForm.JSON_TEXT,
)
GLM45 = ChatFamily(
    name="glm45",
    thinking_kwarg="enable_thinking",
    thinking_default=True,
    parse_from_reasoning=False,
    history_ids=HistoryIds.VERBATIM,
    arguments=ArgumentsForm.OBJECT,
)
GPT_OSS = ChatFamily(
    name="gpt_oss",
    thinking_kwarg=None,
    thinking_default=True,
    parse_from_reasoning=False,
    history_ids=HistoryIds.VERBATIM,
    arguments=ArgumentsForm.JSON_TEXT,
    renderer=Renderer.HARMONY,
)
GENERIC = ChatFamily(
    name="generic",
    thinking_kwarg=None,
    thinking_default=False,
    parse_from_reasoning=False,
    history_ids=HistoryIds.VERBATIM,
    arguments=ArgumentsForm.OBJECT,
)

CHAT_FAMILIES: Mapping[str, ChatFamily] = MappingProxyType(
    {f.name: f for f in (DEEPSEEK_V31, GLM45, GPT_OSS, KIMI_K2, QWEN3)}
)
"""Parser name (``inferplane.parsers`` registry) -> chat family, read-only."""


def chat_family(parser: str | None) -> ChatFamily:
    """The chat family of a deployment whose reasoning / tool parser is `parser`.

    The parser name is the key because a deployment profile names its output format there
    (``reasoning_parser`` / ``tool_parser``), and the template's input conventions belong to the
    same family as its output format. None or ``""`` (no parser) gives :data:`GENERIC`.

    Raises:
        UnknownChatFamilyError: no family is known for `parser` (the message lists the known
            names).
    """
    if not parser:
        return GENERIC
    family = CHAT_FAMILIES.get(parser)
    if family is None:
        raise UnknownChatFamilyError(parser, tuple(sorted(CHAT_FAMILIES)))
    return family
