"""Per-request facts the pipeline hands to telemetry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from inferplane.parsers import ToolCallVerdict


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one inference request (one record per request, success or not).

    Attributes:
        request_id: the completion id (`chatcmpl-…` / `cmpl-…`) or the embeddings request's
            (`embd-…`), also the engine request id.
        model: the served model name.
        replica_id: the replica that ran it ("" when none was picked).
        api: "chat", "completion" or "embedding".
        stream: True for the streaming methods.
        status: "ok", "error" (an InferplaneError was returned) or "cancelled" (client gone or
            deadline).
        error_code: the OpenAI error code when status is "error", else "".
        finish_reason: "stop", "length", "tool_calls", or "" when it did not finish.
        prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens: token counts
            (`reasoning_tokens`: output tokens fed to the parser while it was in reasoning).
        ttft_seconds: request arrival → first engine output (an embedding's: its result),
            None when there was none.
        itl_seconds: inter-token latency samples, one per token after the first engine output:
            an increment of n tokens after a gap g gives n samples of g / n (vLLM's stream
            interval and merged reads deliver several tokens per increment).
        e2e_seconds: request arrival → end.
        tool_call_verdicts: the verdict on every tool call of the response.
        marker_leaked: a format marker survived into the visible output (a parser bug signal).
        dropped_tool_calls: calls the model made although `tool_choice` was "none".
        request_header_id: the caller's `x-request-id`, "" when absent.
    """

    request_id: str
    model: str
    replica_id: str
    api: str
    stream: bool
    status: str
    error_code: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    ttft_seconds: float | None = None
    itl_seconds: tuple[float, ...] = ()
    e2e_seconds: float = 0.0
    tool_call_verdicts: tuple[ToolCallVerdict, ...] = ()
    marker_leaked: bool = False
    dropped_tool_calls: int = 0
    request_header_id: str = ""

    @property
    def valid_tool_calls(self) -> int:
        """Calls whose verdict is valid (K2-Vendor-Verifier's schema accuracy numerator)."""
        return sum(1 for v in self.tool_call_verdicts if v.valid)


OutcomeSink = Callable[[RequestOutcome], None]
"""Receives every `RequestOutcome`. Called from the event loop after the response is sent
(`loop.call_soon`), so it must be cheap (e.g. enqueue); exceptions are logged, never raised."""


def discard_outcome(_: RequestOutcome) -> None:
    """The default sink: telemetry is not wired yet."""
