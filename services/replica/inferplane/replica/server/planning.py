"""Planning a large request (validation, chat template, tokenization) off the event loop, within
a time bound (issue 31 part 5).

`plan_chat` / `plan_completion` run synchronously; on a large prompt the template and the
tokenizer take seconds (measured with the qwen3-tiny tokenizer: 13-23 s for an 8 MiB chat
prompt), and on the event loop that would stall every stream the replica serves. A prompt
whose size alone exceeds the context is refused before any of it (`inferplane.promptsize`,
inside the planners); one that might fit and is larger than `INLINE_PLAN_BYTES` is planned in
a worker thread, and one that takes longer than `PLAN_TIMEOUT_S` is refused with a clear 400
(`prompt_too_large`) instead of holding the client. Python cannot stop the worker: it runs to
its end, bounded by the edge's body limit (8 MiB), while the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from inferplane.runtime import InvalidArgumentError

#: Requests up to this many serialized bytes are planned inline (microseconds to a few ms).
INLINE_PLAN_BYTES = 64 * 1024
#: The longest a large request's planning may take before it is refused, seconds.
PLAN_TIMEOUT_S = 10.0
#: OpenAI-style code of that refusal.
PROMPT_TOO_LARGE = "prompt_too_large"

T = TypeVar("T")


async def planned(
    size: int, plan: Callable[[], T], *, param: str = "messages", timeout_s: float = PLAN_TIMEOUT_S
) -> T:
    """`plan()`'s result: inline when the request is `size` <= `INLINE_PLAN_BYTES` bytes,
    else in a worker thread within `timeout_s`.

    Raises:
        InvalidArgumentError: 400 `prompt_too_large` (`param`) when the planning ran past
            `timeout_s`; and whatever `plan` raises.
    """
    if size <= INLINE_PLAN_BYTES:
        return plan()
    try:
        return await asyncio.wait_for(asyncio.to_thread(plan), timeout_s)
    except TimeoutError as exc:
        raise InvalidArgumentError(
            f"The prompt could not be prepared within {timeout_s:g} seconds; please shorten it.",
            param=param,
            code=PROMPT_TOO_LARGE,
        ) from exc
