"""The router's view of one request (`RequestTrace`) → telemetry's `RequestRecord`.

Telemetry counts requests, status, latency and tokens from the router's records
(`request_source = "router"`, services/telemetry/README.md) and tool-call facts and
inter-token gaps from the replica processes', so the router sends exactly one record per
request it received: success, error (429s and unknown models included) or cancel.

As the endpoint picker (`picker/`) the router sees no chunk of the response, only the
replica's `ResponseSummary` trailers (`on_summary`), or the replica's report of them. From the
request's arrival at the router:
- queue time: time spent waiting for a slot in admission (every attempt summed);
- TTFT: the time until the pick plus the replica's own TTFT (Envoy's hop to the replica is not
  in it); 0 (unset) when the replica reported none;
- ITL: none (the replica's own records carry the gaps, measured per token);
- e2e: until the trailers (or the replica's report) arrive or the side stream closes;
- usage, finish reason, GPU-seconds: from the summary.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from google.protobuf import timestamp_pb2

from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.wire import ResponseSummary, headers

SOURCE = "router"
STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_CANCELLED = "cancelled"


@dataclasses.dataclass(slots=True)
class RequestTrace:
    """What the router saw of one request; times are monotonic seconds except `start_wall`
    (Unix seconds). Filled by the endpoint picker as the request moves; see `to_record`."""

    model: str
    stream: bool
    start: float
    start_wall: float
    request_id: str = ""
    tenant: str = ""
    key_id: str = ""
    deployment: str = ""
    replica: str = ""
    node: str = ""
    queue_seconds: float = 0.0
    first_token: float | None = None
    usage: Any = None  # inferplane.inference.v1.Usage, once the replica said
    gpu_seconds: float = 0.0  # attributed by the replica (`ResponseSummary.gpu_seconds`)
    finish_reason: str = ""
    status: str = STATUS_OK
    error_code: str = ""
    api: str = ""  # `inferplane.wire.apis`, once the path named the method

    @classmethod
    def begin(
        cls, model: str, stream: bool, metadata: Mapping[str, str], now: float, wall: float
    ) -> RequestTrace:
        return cls(
            model=model,
            stream=stream,
            start=now,
            start_wall=wall,
            request_id=metadata.get(headers.REQUEST_ID) or f"router-{uuid.uuid4().hex}",
            tenant=metadata.get(headers.TENANT, ""),
            key_id=metadata.get(headers.KEY_ID, ""),
        )

    def on_summary(self, summary: ResponseSummary, picked: float) -> None:
        """The replica's summary reached the endpoint picker; `picked` (monotonic seconds) is
        when the picker answered Envoy with the endpoint list."""
        if summary.prompt_tokens or summary.completion_tokens:
            self.usage = inference_pb2.Usage(
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                total_tokens=summary.prompt_tokens + summary.completion_tokens,
                prompt_tokens_details=inference_pb2.PromptTokensDetails(
                    cached_tokens=summary.cached_tokens
                ),
                completion_tokens_details=inference_pb2.CompletionTokensDetails(
                    reasoning_tokens=summary.reasoning_tokens
                ),
            )
        if summary.ttft_seconds > 0:
            self.first_token = picked + summary.ttft_seconds
        self.finish_reason = summary.finish_reason or self.finish_reason
        self.replica = summary.replica_id or self.replica
        self.gpu_seconds = summary.gpu_seconds or self.gpu_seconds

    def fail(self, code: str) -> None:
        self.status = STATUS_ERROR
        self.error_code = code or "internal_error"

    def cancel(self) -> None:
        """The client went away: finish_reason "abort" and no error code, as the node-agent
        reports it, so a client's cancel never counts against the error-rate SLO."""
        self.status = STATUS_CANCELLED
        self.error_code = ""

    def timings(self, now: float) -> tuple[float, float]:
        """(TTFT, end-to-end) seconds from arrival at the router, the request having ended at
        monotonic `now`; TTFT is 0 when no output came."""
        ttft = self.first_token - self.start if self.first_token is not None else 0.0
        return max(0.0, ttft), max(0.0, now - self.start)

    def to_record(self, now: float) -> telemetry_pb2.RequestRecord:
        """The record of this request, ended at monotonic `now`."""
        ttft, e2e = self.timings(now)
        start = timestamp_pb2.Timestamp()
        start.FromNanoseconds(int(self.start_wall * 1e9))
        usage = self.usage
        finish = self.finish_reason
        if self.status == STATUS_CANCELLED:
            finish = "abort"
        elif self.status == STATUS_ERROR:
            finish = "error"
        record = telemetry_pb2.RequestRecord(
            request_id=self.request_id,
            source=SOURCE,
            record_source=telemetry_pb2.RECORD_SOURCE_ROUTER,
            tenant=self.tenant,
            key_id=self.key_id,
            model=self.model,
            deployment=self.deployment,
            replica=self.replica,
            node=self.node,
            start_time=start,
            queue_time_seconds=self.queue_seconds,
            time_to_first_token_seconds=ttft,
            e2e_latency_seconds=e2e,
            finish_reason=finish,
            error_code=self.error_code,
            stream=self.stream,
            api=self.api,
        )
        if usage is not None:
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            record.cached_tokens = usage.prompt_tokens_details.cached_tokens
            record.reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
        return record
