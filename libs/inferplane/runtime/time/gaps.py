"""Gap thinning: the one rule that bounds a request's inter-token gaps (ITL samples).

A streamed request of n output tokens has n - 1 inter-token gaps. Its telemetry
`RequestRecord` carries them (`inter_token_latencies_seconds`) so that telemetry can compute
ITL percentiles over all the requests of a window; a long generation would make that list,
the record and telemetry's memory unbounded, so the replica process that measures the gaps and
telemetry that keeps them both thin them with `thin` to at most `MAX_GAPS` (telemetry's own
bound is its `max_itl_gaps` setting, 128 by default).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

MAX_GAPS: Final = 128
"""The most inter-token gaps one `RequestRecord` carries (and telemetry keeps by default)."""


def thin(values: Iterable[float], limit: int = MAX_GAPS) -> tuple[float, ...]:
    """At most `limit` of `values`, evenly spaced over them, in their order.

    Args:
        values: the gaps in the order they were measured (seconds; any iterable of numbers,
            read once).
        limit: how many to keep at most (a count; ≤ 0 keeps none).

    Returns:
        The values themselves (as floats) when there are at most `limit`; otherwise `limit`
        of them, the one at position `round(i * (n - 1) / (limit - 1))` for i = 0 … limit-1,
        so the first and the last are always kept (with `limit` 1: the last alone).

    Why evenly spaced positions: a generation's gaps change over its length (the first ones
    after the prefill, a slower tail as the context grows, stalls when the engine preempts),
    so keeping every k-th gap keeps that shape and the percentiles computed from it, where
    keeping the first `limit` would drop the tail and random sampling would make two runs
    of the same request disagree. Never raises for a finite `limit`.
    """
    items = tuple(float(v) for v in values)
    if len(items) <= limit:
        return items
    if limit <= 1:
        return items[-1:] if limit == 1 else ()
    step = (len(items) - 1) / (limit - 1)
    return tuple(items[round(i * step)] for i in range(limit))
