"""The router's view of one request: `RequestTrace` while it moves, `ConcludedRequest` once it
ended — the one value its usage report (auth's `RequestUsage`) and its telemetry
`RequestRecord` are both derived from (`usage()`, `record()`: the only conversions).

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

from inferplane.api.auth.v1 import usage_pb2
from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.wire import ResponseSummary, headers

SOURCE = "router"
STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_CANCELLED = "cancelled"

# The usage ledger's words for how a request ended (auth's `ledger.STATUSES`).
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
LEDGER_STATUS = {STATUS_OK: COMPLETED, STATUS_ERROR: FAILED, STATUS_CANCELLED: CANCELLED}


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
    adapter: str = ""  # the route's LoRA adapter (catalogue name), "" for the base model
    replica: str = ""
    node: str = ""
    revision: str = ""  # the profile revision of the endpoint that served it (issue 30)
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

    def conclude(
        self, now: float, wall: float, *, model: str, provisional: bool = False
    ) -> ConcludedRequest:
        """The request's facts, it having ended at monotonic `now` (Unix `wall`); `model`: what
        usage groups it by (its served name, or `headers.UNKNOWN_MODEL`); `provisional`: how
        it ended was not heard (`ConcludedRequest.provisional`)."""
        ttft, e2e = self.timings(now)
        usage = self.usage
        finish = self.finish_reason
        if self.status == STATUS_CANCELLED:
            finish = "abort"
        elif self.status == STATUS_ERROR:
            finish = "error"
        return ConcludedRequest(
            request_id=self.request_id,
            key_id=self.key_id,
            tenant=self.tenant,
            model=model or headers.UNKNOWN_MODEL,
            requested_model=self.model,
            api=self.api,
            stream=self.stream,
            deployment=self.deployment,
            adapter=self.adapter,
            replica=self.replica,
            node=self.node,
            revision=self.revision,
            start_time=self.start_wall,
            end_time=wall,
            queue_seconds=self.queue_seconds,
            ttft_seconds=ttft,
            duration_seconds=e2e,
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            cached_tokens=usage.prompt_tokens_details.cached_tokens if usage is not None else 0,
            reasoning_tokens=(
                usage.completion_tokens_details.reasoning_tokens if usage is not None else 0
            ),
            gpu_seconds=self.gpu_seconds,
            finish_reason=finish,
            status=LEDGER_STATUS.get(self.status, FAILED),
            error_code=self.error_code,
            provisional=provisional,
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConcludedRequest:
    """One request the router concluded: every fact its usage report and its telemetry record
    say, once. Times in seconds; `start_time` / `end_time` are Unix seconds (0 = unknown).

    Attributes:
        request_id: the edge's `x-request-id` (the usage ledger's row id).
        key_id / tenant: the API key and its tenant ("" = no key: no usage report).
        model: what usage groups by: the model the client asked for when it names a served
            model, else `inferplane.wire.headers.UNKNOWN_MODEL`.
        requested_model: the client's text, data only (the telemetry record's `model`).
        api: the public API it came through (`inferplane.wire.apis`).
        stream: a streaming request.
        deployment / replica / node: what served it ("" when nothing was picked).
        adapter: the LoRA adapter its route named (a catalogue name from the routing table,
            never the client's text; "" for the base model).
        revision: the profile revision of the endpoint that served it, from the routing
            table (the primary's when no served endpoint was reported; "" when nothing was
            picked or the table names none; issue 30).
        queue_seconds / ttft_seconds / duration_seconds: from the arrival at the router.
        prompt_tokens / completion_tokens / cached_tokens / reasoning_tokens: the replica's.
        gpu_seconds: attributed by the replica (`inferplane.wire.ResponseSummary`).
        finish_reason: "stop", "length", ...; "error" for a failure, "abort" for a cancel.
        status: `COMPLETED`, `FAILED` or `CANCELLED` (the client went away).
        error_code: the OpenAI error code of a failure ("" when none).
        provisional: concluded without hearing how it ended (the response had started; no
            trailers, no replica report in time): `CANCELLED` until the replica's late report
            replaces it (auth's ledger, `RequestUsage.provisional`).
    """

    request_id: str
    key_id: str = ""
    tenant: str = ""
    model: str = headers.UNKNOWN_MODEL
    requested_model: str = ""
    api: str = ""
    stream: bool = False
    deployment: str = ""
    adapter: str = ""
    replica: str = ""
    node: str = ""
    revision: str = ""
    start_time: float = 0.0
    end_time: float = 0.0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    duration_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    gpu_seconds: float = 0.0
    finish_reason: str = ""
    status: str = COMPLETED
    error_code: str = ""
    provisional: bool = False

    @classmethod
    def reported(
        cls, request_id: str, summary: ResponseSummary, end_time: float
    ) -> ConcludedRequest:
        """A request this process never saw, from its replica's out-of-band report (picked by
        this address before a restart): the summary's key, model and API, ended at Unix
        `end_time`."""
        if summary.finish_reason == "abort":
            status, finish = CANCELLED, "abort"
        elif summary.error_code or summary.finish_reason == "error":
            status, finish = FAILED, "error"
        else:
            status, finish = COMPLETED, summary.finish_reason
        return cls(
            request_id=request_id,
            key_id=summary.key_id,
            model=summary.model or headers.UNKNOWN_MODEL,
            requested_model=summary.model,
            api=summary.api,
            replica=summary.replica_id,
            end_time=end_time,
            prompt_tokens=summary.prompt_tokens,
            completion_tokens=summary.completion_tokens,
            cached_tokens=summary.cached_tokens,
            reasoning_tokens=summary.reasoning_tokens,
            gpu_seconds=summary.gpu_seconds,
            finish_reason=finish,
            status=status,
            error_code=summary.error_code,
        )

    @property
    def ok(self) -> bool:
        """Completed without error."""
        return self.status == COMPLETED

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def usage(self) -> usage_pb2.RequestUsage:
        """The usage report (auth's `UsageService.ReportUsage`)."""
        msg = usage_pb2.RequestUsage(
            key_id=self.key_id,
            request_id=self.request_id,
            model=self.model,
            prompt_tokens=max(0, self.prompt_tokens),
            completion_tokens=max(0, self.completion_tokens),
            deployment=self.deployment,
            replica=self.replica,
            cached_tokens=max(0, self.cached_tokens),
            reasoning_tokens=max(0, self.reasoning_tokens),
            ttft_seconds=max(0.0, self.ttft_seconds),
            duration_seconds=max(0.0, self.duration_seconds),
            gpu_seconds=max(0.0, self.gpu_seconds),
            status=self.status,
            api=self.api,
            adapter=self.adapter,
            revision=self.revision,
            provisional=self.provisional,
        )
        if self.end_time > 0:
            msg.end_time.FromNanoseconds(int(self.end_time * 1e9))
        if self.start_time > 0:
            msg.start_time.FromNanoseconds(int(self.start_time * 1e9))
        return msg

    def record(self) -> telemetry_pb2.RequestRecord:
        """The telemetry record (source "router")."""
        start = timestamp_pb2.Timestamp()
        start.FromNanoseconds(int(self.start_time * 1e9))
        return telemetry_pb2.RequestRecord(
            request_id=self.request_id,
            source=SOURCE,
            record_source=telemetry_pb2.RECORD_SOURCE_ROUTER,
            tenant=self.tenant,
            key_id=self.key_id,
            model=self.requested_model,
            deployment=self.deployment,
            replica=self.replica,
            node=self.node,
            start_time=start,
            queue_time_seconds=self.queue_seconds,
            time_to_first_token_seconds=self.ttft_seconds,
            e2e_latency_seconds=self.duration_seconds,
            finish_reason=self.finish_reason,
            error_code=self.error_code,
            stream=self.stream,
            api=self.api,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            reasoning_tokens=self.reasoning_tokens,
            revision=self.revision,
            adapter=self.adapter,
        )
