"""The bounded in-memory time-window store of request samples.

Chosen over a database on purpose: percentiles are exact over the samples of the last hour
(the drift window), the store is rebuilt within an hour of a restart, and long-term history is
Prometheus's job (it scrapes the histograms this service exposes). Memory is bounded by
`max_records` samples (each holding at most `max_itl_gaps` floats).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Iterator

Key = tuple[str, str, str]
"""(model, deployment, tenant)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One request as the telemetry service keeps it (seconds, token counts).

    `time` is when the request finished (its start time + e2e latency, as the sender stamped
    it, never later than when the service received it), in seconds since the epoch. `itl` holds
    the inter-token gaps the sender kept (at most the store's `max_itl_gaps`, evenly thinned)
    or, when it kept none, the request's mean gap as the single value. `revision` is the
    profile revision of the replica that served it and `adapter` its LoRA adapter ("" when the
    sender named none; issue 30: a canary's figures are its revision's samples).
    """

    time: float
    request_id: str
    source: str
    model: str
    deployment: str
    tenant: str
    replica: str = ""
    error_code: str = ""
    finish_reason: str = ""
    queue_time: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    tool_calls: int = 0
    tool_calls_valid: int = 0
    tool_call_invalid_reasons: tuple[str, ...] = ()
    markers_leaked: int = 0
    revision: str = ""
    adapter: str = ""

    @property
    def key(self) -> Key:
        return (self.model, self.deployment, self.tenant)

    @property
    def failed(self) -> bool:
        """A request failed when it carries an error code or finished with "error"."""
        return bool(self.error_code) or self.finish_reason == "error"


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """Which samples: finished in (since, until], matching every non-empty filter."""

    since: float
    until: float
    model: str = ""
    deployment: str = ""
    tenant: str = ""
    source: str = ""
    revision: str = ""


class SampleStore:
    """Samples per (model, deployment, tenant), bounded in count and age.

    - at most `max_records` samples in all: beyond that, the oldest sample of the key that was
      least recently written is evicted first (one noisy tenant cannot evict a quiet one's
      last hour unless it is the only writer);
    - `prune(now)` drops samples older than `retention_seconds`;
    - `(source, request_id)` pairs seen recently are remembered (up to `2 × max_records`) so a
      batch re-sent after a lost response is not stored twice.
    Not thread-safe: used from the service's event loop only.
    """

    def __init__(self, *, max_records: int, retention_seconds: float) -> None:
        self._max_records = max_records
        self._retention = retention_seconds
        self._by_key: OrderedDict[Key, deque[Sample]] = OrderedDict()
        self._count = 0
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __len__(self) -> int:
        return self._count

    def add(self, sample: Sample) -> bool:
        """Stores `sample`; False (and nothing stored) when its (source, request_id) was seen."""
        if sample.request_id:
            ident = (sample.source, sample.request_id)
            if ident in self._seen:
                return False
            self._seen[ident] = None
            if len(self._seen) > 2 * self._max_records:
                self._seen.popitem(last=False)
        bucket = self._by_key.get(sample.key)
        if bucket is None:
            bucket = self._by_key[sample.key] = deque()
        else:
            self._by_key.move_to_end(sample.key)
        bucket.append(sample)
        self._count += 1
        while self._count > self._max_records:
            self._evict_one()
        return True

    def _evict_one(self) -> None:
        key, bucket = next(iter(self._by_key.items()))
        bucket.popleft()
        self._count -= 1
        if not bucket:
            del self._by_key[key]

    def prune(self, now: float) -> None:
        """Drops samples that finished before `now - retention_seconds`."""
        horizon = now - self._retention
        for key in list(self._by_key):
            bucket = self._by_key[key]
            while bucket and bucket[0].time < horizon:
                bucket.popleft()
                self._count -= 1
            # Late arrivals may sit behind newer samples; sweep them when the bucket is small.
            if bucket and len(bucket) < 1024 and any(s.time < horizon for s in bucket):
                kept = [s for s in bucket if s.time >= horizon]
                self._count -= len(bucket) - len(kept)
                bucket.clear()
                bucket.extend(kept)
            if not bucket:
                del self._by_key[key]

    def select(self, query: Query) -> Iterator[Sample]:
        """Samples matching `query`, in no particular order."""
        for (model, deployment, tenant), bucket in self._by_key.items():
            if query.model and model != query.model:
                continue
            if query.deployment and deployment != query.deployment:
                continue
            if query.tenant and tenant != query.tenant:
                continue
            for sample in bucket:
                if (
                    query.since < sample.time <= query.until
                    and (not query.source or sample.source == query.source)
                    and (not query.revision or sample.revision == query.revision)
                ):
                    yield sample

    def deployments(self) -> set[tuple[str, str]]:
        """(model, deployment) pairs with samples in the store."""
        return {(model, deployment) for model, deployment, _ in self._by_key}
