"""`ResponseSummary`: what a replica tells the endpoint picker about a finished request.

On the data path (docs/architecture.md) Envoy relays the tokens and the router (the endpoint picker)
never sees a response body. A replica therefore ends every InferenceService response with
trailing metadata that summarises it: usage, finish reason, TTFT and which replica served.
Envoy hands those trailers to the picker over ext_proc (`response_trailers`), which releases
the admission slot, feeds the replica's breaker, reports usage to auth and sends the request
record to telemetry, then removes them so no client sees internal topology.

A replica also sends `headers.SERVED_BY` in its initial metadata (the response headers), so the
picker knows which endpoint of its list answered as soon as the response starts: Envoy's
override_host cannot report it back.

Every key starts with `x-inferplane-` (the edge strips that prefix from client requests).
Numbers are decimal text; a missing or unreadable key reads as its default, so a summary from
an older replica never fails a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from inferplane.wire import headers

PROMPT_TOKENS_KEY = "x-inferplane-prompt-tokens"
COMPLETION_TOKENS_KEY = "x-inferplane-completion-tokens"
CACHED_TOKENS_KEY = "x-inferplane-cached-tokens"
REASONING_TOKENS_KEY = "x-inferplane-reasoning-tokens"
FINISH_REASON_KEY = "x-inferplane-finish-reason"
TTFT_KEY = "x-inferplane-ttft-seconds"
GPU_SECONDS_KEY = "x-inferplane-gpu-seconds"
ERROR_CODE_KEY = "x-inferplane-error-code"
KEY_ID_KEY = "x-inferplane-summary-key-id"
MODEL_KEY = "x-inferplane-summary-model"
API_KEY = "x-inferplane-summary-api"
DURATION_KEY = "x-inferplane-summary-duration-seconds"

SUMMARY_KEYS: tuple[str, ...] = (
    headers.SERVED_BY,
    PROMPT_TOKENS_KEY,
    COMPLETION_TOKENS_KEY,
    CACHED_TOKENS_KEY,
    REASONING_TOKENS_KEY,
    FINISH_REASON_KEY,
    TTFT_KEY,
    GPU_SECONDS_KEY,
    ERROR_CODE_KEY,
    KEY_ID_KEY,
    MODEL_KEY,
    API_KEY,
    DURATION_KEY,
)
"""Every trailer key a summary may write (the picker removes them all before the client)."""

_INT_FIELDS = (
    ("prompt_tokens", PROMPT_TOKENS_KEY),
    ("completion_tokens", COMPLETION_TOKENS_KEY),
    ("cached_tokens", CACHED_TOKENS_KEY),
    ("reasoning_tokens", REASONING_TOKENS_KEY),
)


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseSummary:
    """One request's outcome as its replica saw it.

    Attributes:
        replica_id: the replica that served it (`replicas/{replica_id}` without the prefix).
        prompt_tokens / completion_tokens / cached_tokens / reasoning_tokens: usage, tokens.
        finish_reason: "stop", "length", "tool_calls"; "error" for a stream that ended with an
            error event; "abort" for a client gone; "" when not known.
        ttft_seconds: time from the request's arrival at the replica to its first output,
            seconds; 0 when no output was produced.
        gpu_seconds: GPU-seconds attributed to the request: while `n` requests are in flight
            on the replica, each is charged the replica's GPU share (`gpu_indices` count ×
            `gpu_memory_fraction`, or the count alone when the fraction is unset) divided by
            `n` per second of its life at the replica; 0 when not measured.
        error_code: the OpenAI error `code` of a failure ("" when none).
        key_id / model / api: the API key, the model the client asked for and the public API
            it came through (`inferplane.wire.apis`); set only in the replica's out-of-band
            report to its picker (a restarted router that never saw the request accounts its
            usage from them), never in the response's trailers.
        duration_seconds: time from the request's arrival at the replica to its end, seconds
            (0: unknown); set only in the out-of-band report: a picker that concluded the
            request before the report came compares it with when the client's stream ended
            (`inferplane.router.picker.conclusion`).
    """

    replica_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str = ""
    ttft_seconds: float = 0.0
    gpu_seconds: float = 0.0
    error_code: str = ""
    key_id: str = ""
    model: str = ""
    api: str = ""
    duration_seconds: float = 0.0

    def to_metadata(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata pairs (empty strings and zeros are left out)."""
        out: list[tuple[str, str]] = []
        if self.replica_id:
            out.append((headers.SERVED_BY, self.replica_id))
        for field, key in _INT_FIELDS:
            value = getattr(self, field)
            if value:
                out.append((key, str(int(value))))
        if self.finish_reason:
            out.append((FINISH_REASON_KEY, self.finish_reason))
        if self.ttft_seconds > 0:
            out.append((TTFT_KEY, f"{self.ttft_seconds:.6f}"))
        if self.gpu_seconds > 0:
            out.append((GPU_SECONDS_KEY, f"{self.gpu_seconds:.6f}"))
        if self.error_code:
            out.append((ERROR_CODE_KEY, self.error_code))
        if self.key_id:
            out.append((KEY_ID_KEY, self.key_id))
        if self.model:
            out.append((MODEL_KEY, self.model))
        if self.api:
            out.append((API_KEY, self.api))
        if self.duration_seconds > 0:
            out.append((DURATION_KEY, f"{self.duration_seconds:.6f}"))
        return tuple(out)

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, str | bytes] | Iterable[tuple[str, str | bytes]]
    ) -> ResponseSummary:
        """Reads a summary from trailing metadata or headers (keys compared in lower case;
        other keys ignored; unreadable numbers read as 0)."""
        pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
        seen: dict[str, str] = {}
        for key, value in pairs:
            key = key.lower()
            if key in SUMMARY_KEYS:
                seen[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        ints = {field: _int(seen.get(key, "")) for field, key in _INT_FIELDS}
        return cls(
            replica_id=seen.get(headers.SERVED_BY, ""),
            finish_reason=seen.get(FINISH_REASON_KEY, ""),
            ttft_seconds=_float(seen.get(TTFT_KEY, "")),
            gpu_seconds=_float(seen.get(GPU_SECONDS_KEY, "")),
            error_code=seen.get(ERROR_CODE_KEY, ""),
            key_id=seen.get(KEY_ID_KEY, ""),
            model=seen.get(MODEL_KEY, ""),
            api=seen.get(API_KEY, ""),
            duration_seconds=_float(seen.get(DURATION_KEY, "")),
            **ints,
        )


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if value > 0 and value == value and value != float("inf") else 0.0
