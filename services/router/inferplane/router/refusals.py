"""Why admission refuses a request, and the errors it answers with (one place).

Reasons label `inferplane_router_queue_refusals_total{reason}` and the autoscaler's queue
rejections (`OVERLOAD_REASONS`: the 429s); `COLD_START` is the 503 of a request held for a
deployment at zero. KV-fit's 429 `kv_cache_full` is `kvfit.kv_cache_full`.
"""

from __future__ import annotations

from inferplane.router.fairqueue import Refusal
from inferplane.router.kvfit import KV_CACHE_FULL
from inferplane.runtime import ResourceExhaustedError, UnavailableError

# Why a request left the queue with a 429: the queue's own refusals, or its wait ran out.
TIMEOUT = "timeout"
OVERLOAD_REASONS = (Refusal.QUEUE_FULL.value, Refusal.FLOW_SHARE.value, TIMEOUT, KV_CACHE_FULL)
# A request held for a deployment at zero whose cold-start budget ran out: a 503.
COLD_START = "cold_start"
REFUSAL_REASONS = (*OVERLOAD_REASONS, COLD_START)
#: OpenAI's error `code` of that 503 (Retry-After set): the deployment is starting a replica.
COLD_START_CODE = "deployment_cold_start"


def overloaded(model: str, why: str, retry_after_seconds: float) -> ResourceExhaustedError:
    """429 `model_overloaded` with Retry-After: no replica of `model` could take the request."""
    return ResourceExhaustedError(
        f"The model '{model}' is overloaded ({why}). Please retry after a short wait.",
        retry_after_seconds=retry_after_seconds,
        code="model_overloaded",
        reason="MODEL_OVERLOADED",
    )


def cold_start(model: str, waited: float, retry_after_seconds: float) -> UnavailableError:
    """503 `deployment_cold_start` with Retry-After: a request held `waited` seconds for a
    deployment at zero saw no replica become ready."""
    return UnavailableError(
        f"The model '{model}' is starting (its deployment was scaled to zero) and no replica "
        f"was ready within {waited:g} s. Please retry shortly.",
        code=COLD_START_CODE,
        retry_after_seconds=retry_after_seconds,
    )
