"""render_chat: an OpenAI chat request → the prompt text and token ids of the model's template."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from inferplane.chat._errors import ChatRenderError
from inferplane.chat._family import KIMI_K2, ChatFamily, Renderer
from inferplane.chat._harmony import render_harmony
from inferplane.chat._normalize import prepare_chat


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the renderer uses."""

    chat_template: Any

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt.

    ``text`` is the template's output (it ends with the generation prompt); ``token_ids`` is
    ``text`` encoded without extra special tokens (the template writes them all); ``thinking``
    says the model's output is parsed from inside reasoning (``Parser.start(thinking=...)``):
    thinking is on and the family's output starts there (a K2.5 template has opened
    ``<think>``; Qwen3 writes it first). False when thinking is off, and always for a family
    whose model opens ``<think>`` itself after plain text (GLM-4.5) or has no thinking switch.
    """

    text: str
    token_ids: list[int]
    thinking: bool


def render_chat(
    request: Mapping[str, Any], tokenizer: ChatTokenizer, *, family: ChatFamily = KIMI_K2
) -> RenderedPrompt:
    """Render an OpenAI chat request through ``tokenizer``'s own chat template.

    ``request`` is the request body as plain JSON-like values (``messages``, ``tools``,
    ``tool_choice``, ``chat_template_kwargs``; other fields are ignored). The fixes of issue 3
    §1 are applied first, as `family` wants them (see ``inferplane.chat._normalize`` and
    ``_family``; a deployment's family is ``chat_family(parser name)``; the default, Kimi K2,
    is the ``kimi-tiny`` fixture's); the generation prompt is always added; the family's
    thinking keyword (``thinking`` for Kimi, ``enable_thinking`` for Qwen3) always reaches the
    template, the client's value or the family's default, and the client's other
    ``chat_template_kwargs`` are passed through. A ``Renderer.HARMONY`` family (gpt-oss) is
    rendered by openai-harmony instead (``inferplane.chat._harmony``; it reads
    ``reasoning_effort`` and refuses ``chat_template_kwargs``), and needs no template.

    Raises:
        ChatRenderError: the request is invalid (an OpenAI 400), including a template that
            rejects it (``raise_exception``).
        RuntimeError: the tokenizer has no chat template, or (harmony) its vocabulary is not
            ``o200k_harmony`` (a deployment error, not the client's).
    """
    if family.renderer is Renderer.HARMONY:
        text, ids = render_harmony(request, tokenizer)
        return RenderedPrompt(text=text, token_ids=ids, thinking=False)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RuntimeError("the model's tokenizer has no chat template")
    inputs = prepare_chat(request, family)
    import jinja2  # lazily: the normalisation above needs no template engine

    kwargs = dict(inputs.template_kwargs)
    if family.thinking_kwarg is not None:
        kwargs[family.thinking_kwarg] = inputs.thinking
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in inputs.messages],
            tools=[dict(t) for t in inputs.tools] or None,
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
    except jinja2.TemplateError as exc:
        raise ChatRenderError(f"the chat template rejected the request: {exc}") from exc
    if not isinstance(text, str):
        raise RuntimeError(f"apply_chat_template returned {type(text).__name__}, not str")
    token_ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    thinking = inputs.thinking and family.parse_from_reasoning
    return RenderedPrompt(text=text, token_ids=token_ids, thinking=thinking)
