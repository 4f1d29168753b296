"""The platform's public APIs by name: the one spelling of each, used wherever a request's API
is written down (the usage ledger's `api` column, request records, the replica's metrics label
`api`) and wherever the edge or the picker must answer in that API's own shape.

The names of the OpenAI APIs that predate this module are kept as they were ("chat",
"completion", ...): they are label values of existing metrics and records.
"""

from __future__ import annotations

from typing import Final

CHAT_COMPLETIONS: Final = "chat"
"""OpenAI Chat Completions, `POST /v1/chat/completions`."""
COMPLETIONS: Final = "completion"
"""OpenAI (legacy) Completions, `POST /v1/completions`."""
EMBEDDINGS: Final = "embedding"
"""OpenAI Embeddings, `POST /v1/embeddings`."""
TRANSCRIPTIONS: Final = "transcription"
"""OpenAI audio transcriptions, `POST /v1/audio/transcriptions`."""
TRANSLATIONS: Final = "translation"
"""OpenAI audio translations, `POST /v1/audio/translations`."""
MESSAGES: Final = "messages"
"""Anthropic Messages, `POST /v1/messages` (and `/v1/messages/count_tokens`)."""
RESPONSES: Final = "responses"
"""OpenAI Responses, `POST /v1/responses` (and the stored responses under it)."""

ALL: Final = (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    TRANSCRIPTIONS,
    TRANSLATIONS,
    MESSAGES,
    RESPONSES,
)
"""Every API name, in the order the docs list them."""

ANTHROPIC_PATH_PREFIX: Final = "/v1/messages"
"""REST paths under this prefix answer errors in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`); every other path in OpenAI's."""
