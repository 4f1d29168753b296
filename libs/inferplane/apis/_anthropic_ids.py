"""Anthropic Messages: the `toolu_…` ids of the model's tool calls, which carry the model's own
call id so the history renders it as the model wrote it (docs/api-messages.md, "Ids")."""

from __future__ import annotations

import base64
import secrets
from typing import Final

TOOL_USE_ID_PREFIX: Final = "toolu_"
CARRIED: Final = "ip"
"""Marks a `toolu_` id that carries the model's own call id (`tool_use_id`); Anthropic's own
ids go on with digits (`toolu_01…`)."""
MAX_CARRIED_ID: Final = 256


def tool_use_id(call_id: str) -> str:
    """The `toolu_…` id of a tool call the model made with id `call_id` (Kimi's
    `functions.NAME:IDX`): `TOOL_USE_ID_PREFIX`, `CARRIED`, 8 random hex digits (two calls the
    model gave one id stay two ids to the client), then `call_id` in unpadded base64url, so the
    id matches Anthropic's `^[a-zA-Z0-9_-]+$`. The client sends it back in `tool_use.id` and
    `tool_result.tool_use_id`, and `call_id_of` gives the model's id back: the history renders
    the id the model wrote, token for token."""
    carried = base64.urlsafe_b64encode(call_id.encode()).rstrip(b"=").decode("ascii")
    return TOOL_USE_ID_PREFIX + CARRIED + secrets.token_hex(4) + carried


def call_id_of(tool_use: str) -> str:
    """The model's own call id inside a `tool_use_id` id; any other id (a client's, Anthropic's
    `toolu_01…`) as it is (the renderer then numbers it in the family's form)."""
    head = TOOL_USE_ID_PREFIX + CARRIED
    if not tool_use.startswith(head) or len(tool_use) <= len(head) + 8:
        return tool_use
    carried = tool_use[len(head) + 8 :]
    try:
        call_id = base64.urlsafe_b64decode(carried + "=" * (-len(carried) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return tool_use
    if not call_id or not call_id.isprintable() or len(call_id) > MAX_CARRIED_ID:
        return tool_use
    return call_id
