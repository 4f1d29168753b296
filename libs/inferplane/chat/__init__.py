"""Chat rendering (issue 3 §1, issue 19): an OpenAI chat request → the prompt of the model's
own chat template, prepared as the model's family wants it (Kimi K2, Qwen3, DeepSeek-V3.1,
GLM-4.5, or none), or, for gpt-oss, built by the openai-harmony library.

Pure Python (no grpc); transformers and jinja2 are only touched through the tokenizer given.

    from inferplane.chat import chat_family, render_chat
    family = chat_family(spec.tool_parser)          # "kimi_k2", "qwen3", ... or "" (none)
    prompt = render_chat(request_json, tokenizer, family=family)
    # RenderedPrompt(text, token_ids, thinking)
"""

from inferplane.chat._errors import ChatRenderError, UnknownChatFamilyError
from inferplane.chat._family import (
    CHAT_FAMILIES,
    DEEPSEEK_V31,
    GENERIC,
    GLM45,
    GPT_OSS,
    KIMI_K2,
    QWEN3,
    ArgumentsForm,
    ChatFamily,
    HistoryIds,
    Renderer,
    chat_family,
)
from inferplane.chat._harmony import HARMONY_EFFORTS, harmony_messages
from inferplane.chat._normalize import (
    ChatInputs,
    content_text,
    integral_floats_to_int,
    normalize_messages,
    normalize_tools,
    prepare_chat,
)
from inferplane.chat._render import ChatTokenizer, RenderedPrompt, render_chat

__all__ = [
    "CHAT_FAMILIES",
    "DEEPSEEK_V31",
    "GENERIC",
    "GLM45",
    "GPT_OSS",
    "HARMONY_EFFORTS",
    "KIMI_K2",
    "QWEN3",
    "ArgumentsForm",
    "ChatFamily",
    "ChatInputs",
    "ChatRenderError",
    "ChatTokenizer",
    "HistoryIds",
    "RenderedPrompt",
    "Renderer",
    "UnknownChatFamilyError",
    "chat_family",
    "content_text",
    "harmony_messages",
    "integral_floats_to_int",
    "normalize_messages",
    "normalize_tools",
    "prepare_chat",
    "render_chat",
]
