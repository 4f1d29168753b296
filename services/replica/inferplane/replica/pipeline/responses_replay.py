"""A stored response replayed into the next turn's prompt token for token.

A turn that continues a stored response (`previous_response_id`) is rendered whole through the
model's chat template, but the template renders history its own way (Kimi K2.5 drops the
reasoning of earlier turns, ids are renumbered, arguments re-serialised), so the prompt would no
longer begin with what the engine saw and produced last turn, and the prefix cache would miss
from the first changed token on. Instead, the history part of the new rendering is replaced by
the stored turn's prompt ids followed by its output ids, exactly as generated:

    new prompt = stored prompt ids + stored output ids + rendered ids of the new messages

Where the new messages begin in the rendering is found without knowing the template: the
conversation is rendered twice, the second time with the first new message's text changed
(`probe_messages`); the renderings agree up to inside that message, and the new messages start
right after the last end-of-turn token before the first difference (the token the stored
output ended with, e.g. Kimi's and Qwen3's `<|im_end|>`).

No splice (None: the rendering is used as it is, which is still a correct prompt, only not
prefix-identical) when the stored output did not end with an end-of-turn token (it was cut by
`max_output_tokens`), or when the two renderings differ before any end-of-turn token.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

_PROBE = "\u2063inferplane-replay-probe\u2063"


def probe_messages(messages: Sequence[Mapping[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """`messages` with the text of message `first_new` (the first of the new turn) replaced,
    so a rendering of them differs from the real one first inside that message."""
    out = [dict(m) for m in messages]
    original = out[first_new].get("content")
    out[first_new]["content"] = _PROBE if original != _PROBE else _PROBE + _PROBE
    return out


def splice(
    rendered: Sequence[int],
    probed: Sequence[int],
    stored_prompt: Sequence[int],
    stored_output: Sequence[int],
    end_tokens: Collection[int],
) -> list[int] | None:
    """The new turn's prompt: the stored turn's ids, then `rendered`'s new messages.

    Args:
        rendered: the whole conversation's rendered ids (history + new messages + the
            generation prompt).
        probed: the same conversation rendered with `probe_messages`.
        stored_prompt: the stored turn's prompt ids, as the engine received them.
        stored_output: the stored turn's generated ids (its final end-of-turn token included).
        end_tokens: the model's end-of-turn ids (its eos ids).

    Returns:
        The spliced ids, or None when they cannot be spliced (see the module doc).
    """
    if not stored_output or stored_output[-1] not in end_tokens:
        return None
    end = stored_output[-1]
    common = 0
    limit = min(len(rendered), len(probed))
    while common < limit and rendered[common] == probed[common]:
        common += 1
    if common == limit:
        return None  # the probe changed nothing: no place to cut
    cut = -1
    for i in range(common - 1, -1, -1):
        if rendered[i] == end:
            cut = i + 1
            break
    if cut < 0:
        return None
    return [*stored_prompt, *stored_output, *rendered[cut:]]
