"""The end of every request the picker decided on, exactly once: the breakers' verdict, the
slot released, and one usage report and one record (`Reporter`), from the response's
trailers, the replica's out-of-band report (`OutcomeService`), or neither (an abort); and the
accounting of a report for a request this process never saw (an orphan: picked before a
restart).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

import structlog

from inferplane.router.admission import Admission, Slot
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.codec import UNAVAILABLE, status_code
from inferplane.router.picker.state import Exchange, Phase
from inferplane.router.reporting import Reporter
from inferplane.router.usage import UsageRecord
from inferplane.wire import ResponseSummary

log = structlog.get_logger("inferplane.router.picker")

# How many concluded request ids the picker remembers (a replica's report lands within seconds
# of the request's end; a few minutes of traffic at 1,000 requests/s, ~10 MB).
_CONCLUDED_MEMORY = 200_000


class Concluder:
    """Ends requests exactly once and matches replicas' reports to them.

    `outcome_address` (the `OutcomeService` replicas report to; "" = none asked for),
    `outcome_wait_seconds` and `usage_wait_seconds` are `PickerSettings`'.
    """

    def __init__(
        self,
        admission: Admission,
        reporter: Reporter,
        *,
        metrics: RouterMetrics | None = None,
        outcome_address: str = "",
        outcome_wait_seconds: float = 5.0,
        usage_wait_seconds: float = 0.5,
    ) -> None:
        self._admission = admission
        self._reporter = reporter
        self._metrics = metrics
        self._outcome_address = outcome_address
        self._outcome_wait_seconds = outcome_wait_seconds
        self._usage_wait_seconds = usage_wait_seconds
        # Picked requests by request id, until concluded: what replicas' reports match.
        self._active: dict[str, Exchange] = {}
        # Request ids concluded lately (oldest forgotten first): a replica's report of one of
        # them is a copy of what the trailers said; an id in neither map is an orphan.
        self._concluded: collections.OrderedDict[str, None] = collections.OrderedDict()

    def picked(self, exchange: Exchange) -> None:
        """The request was picked: a replica's report of it matches it from now on."""
        if exchange.trace.request_id:
            self._active[exchange.trace.request_id] = exchange

    def judge(self, exchange: Exchange) -> None:
        """Feeds the breakers once a response (or Envoy's reply for the upstream) is known.

        Envoy moves down the list only when an endpoint failed before answering (connect
        failure, refused stream, reset, UNAVAILABLE), so every endpoint before the served one
        failed. The served one failed too when the answer is UNAVAILABLE, or a 5xx without
        any gRPC status (Envoy's own reply for an upstream it could not use); any other answer,
        client errors included, means it is healthy. Without the served endpoint (edge
        without `-served`) the verdict goes to the primary.
        """
        slot, response = exchange.pick.slot, exchange.response
        if slot is None or response.http_status is None:
            return
        failed = response.grpc_status == UNAVAILABLE or (
            response.grpc_status is None and response.http_status >= 500
        )
        addresses = [e.address for e in exchange.pick.endpoints]
        served = served_address(exchange) or slot.endpoint.address
        before = addresses[: addresses.index(served)] if served in addresses else addresses
        if before and self._metrics is not None:
            self._metrics.fallbacks_served.inc()
        for address in before:
            self._verdict(exchange, slot, address, ok=False)
        self._verdict(exchange, slot, served, ok=not failed)

    def _verdict(self, exchange: Exchange, slot: Slot, address: str, *, ok: bool) -> None:
        if address != slot.endpoint.address:
            self._admission.observe(exchange.trace.deployment, address, ok=ok)
        elif ok:
            slot.first_chunk()
        else:
            slot.failed()

    def end(self, exchange: Exchange) -> None:
        """Exactly once per stream (→ `Phase.ENDED`): release the slot at once, then classify
        the outcome into the trace and report it (usage + record) — at once, or, when the
        response started but neither its trailers nor the replica's report arrived yet, once
        the report comes (`report_outcomes`) or `outcome_wait_seconds` passed."""
        if exchange.phase in (Phase.RECEIVED, Phase.ENDED, Phase.CONCLUDED):
            return  # a stream that never carried a request, or already ended
        conclusion = exchange.conclusion
        conclusion.ended_in, exchange.phase = exchange.phase, Phase.ENDED
        try:
            _release(exchange)
        finally:
            if (
                conclusion.ended_in is Phase.RESPONSE_STARTED
                and conclusion.reported is None
                and self._outcome_address
                and exchange.trace.request_id in self._active
            ):
                conclusion.waiting = asyncio.get_running_loop().call_later(
                    self._outcome_wait_seconds, self._report, exchange
                )
            else:
                self._report(exchange)

    def report_outcomes(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """Replicas' reports of how requests they served ended (`OutcomeService`): each
        (request id, summary) concludes the request it names if its stream already ended
        without trailers, or is kept for when it ends. Ids this router concluded lately are
        ignored. Any other id is a request picked by this address before it restarted (its
        state died with the process): its usage is reported from the summary's key and model,
        so a router crash loses no tokens (auth drops a copy by request id if the previous
        process had reported it). Returns how many matched a request in flight."""
        return self._report_outcomes(outcomes)[0]

    async def report_outcomes_settled(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """`report_outcomes`, then waits (at most `usage_wait_seconds`) until auth has the
        usage reports they concluded, so that the replica's report is acknowledged only once
        nothing of it lives in this process's memory alone: a router killed in between is
        not acknowledged, the replica sends the report again, and the restarted router
        accounts it (auth keeps one row per request id)."""
        matched, positions = self._report_outcomes(outcomes)
        if positions and not await self._reporter.delivered(
            max(positions), self._usage_wait_seconds
        ):
            log.warning("outcome_usage_late", reports=len(positions))
        return matched

    def _report_outcomes(
        self, outcomes: Sequence[tuple[str, ResponseSummary]]
    ) -> tuple[int, list[int]]:
        matched, positions = 0, []
        for request_id, summary in outcomes:
            exchange = self._active.get(request_id)
            if exchange is None:
                if request_id not in self._concluded and summary.key_id:
                    positions.append(self._account_orphan(request_id, summary))
                continue
            matched += 1
            conclusion = exchange.conclusion
            conclusion.reported = summary
            if conclusion.waiting is not None:
                conclusion.waiting.cancel()
                self._report(exchange)
                positions.append(conclusion.usage_position)
        return matched, [p for p in positions if p]

    def _account_orphan(self, request_id: str, summary: ResponseSummary) -> int:
        self._concluded[request_id] = None
        position = self._reporter.usage.record(
            UsageRecord(
                key_id=summary.key_id,
                request_id=request_id,
                model=summary.model,
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                ok=not summary.error_code and summary.finish_reason not in ("error", "abort"),
            )
        )
        if self._metrics is not None:
            self._metrics.orphan_outcomes.inc()
        log.info("orphan_outcome_accounted", request_id=request_id, key_id=summary.key_id)
        return position

    def _report(self, exchange: Exchange) -> None:
        """Concludes the request and hands its trace over (usage + record), exactly once
        (→ `Phase.CONCLUDED`)."""
        trace, conclusion = exchange.trace, exchange.conclusion
        if self._active.get(trace.request_id) is exchange:
            del self._active[trace.request_id]
        if trace.request_id:
            self._concluded[trace.request_id] = None
            if len(self._concluded) > _CONCLUDED_MEMORY:
                self._concluded.popitem(last=False)
        conclusion.waiting = None
        exchange.phase = Phase.CONCLUDED
        try:
            if conclusion.ended_in is not Phase.REFUSED:
                _conclude(exchange)
        finally:
            log.debug(
                "request_finished",
                request_id=trace.request_id,
                http_status=exchange.response.http_status,
                grpc_status=exchange.response.grpc_status,
                trailers=conclusion.ended_in is Phase.RESPONSE_DONE,
                reported=conclusion.reported is not None,
                finish_reason=trace.finish_reason,
            )
            conclusion.usage_position = self._reporter.finish(trace, exchange.request.metadata)

    async def usage_delivered(self, exchange: Exchange) -> None:
        """Holds the response's end until auth has the request's usage report (bounded by
        `usage_wait_seconds`; see `PickerSettings`)."""
        conclusion = exchange.conclusion
        position, conclusion.usage_position = conclusion.usage_position, 0
        if position and not await self._reporter.delivered(position, self._usage_wait_seconds):
            log.warning("usage_report_late", request_id=exchange.trace.request_id)


def _release(exchange: Exchange) -> None:
    """Gives the slot back (a grant that raced the end included)."""
    pick = exchange.pick
    admitting = pick.admitting
    if pick.slot is None and admitting is not None:
        if not admitting.done():
            admitting.cancel()  # Admission.acquire gives back a slot granted meanwhile
        elif not admitting.cancelled() and admitting.exception() is None:
            pick.slot = admitting.result().slot
    if pick.slot is not None:
        pick.slot.release()


def _conclude(exchange: Exchange) -> None:
    """How the request ended, from what the response said (nothing = client gone)."""
    trace, response, conclusion = exchange.trace, exchange.response, exchange.conclusion
    address = served_address(exchange)
    served = next((e for e in exchange.pick.endpoints if e.address == address), None)
    if served is not None:
        trace.replica, trace.node = served.replica_id or served.address, served.node
    trailers = conclusion.ended_in is Phase.RESPONSE_DONE
    if not trailers and conclusion.reported is not None:
        # The trailers never came (the client closed right after its last event): the
        # replica's report says how the request ended.
        summary = conclusion.reported
        trace.on_summary(summary, exchange.pick.picked)
        if summary.finish_reason == "abort":
            trace.cancel()
        elif summary.error_code:
            trace.fail(summary.error_code)
        return
    summary = response.summary or ResponseSummary()
    trace.on_summary(summary, exchange.pick.picked)
    status = response.grpc_status
    if status is None:
        if response.http_status is not None and response.http_status >= 400:
            trace.fail(f"upstream_http_{response.http_status}")
        else:
            trace.cancel()  # no status at all: the client went away (or a reset)
    elif status != 0:
        trace.fail(response.error_code or summary.error_code or status_code(status))
    elif summary.error_code:
        trace.fail(summary.error_code)  # an SSE stream that ended with an error event


def served_address(exchange: Exchange) -> str:
    """The address of the endpoint that answered: Envoy's `-served` metadata when the edge
    writes it, else the endpoint whose replica id the replica's summary names (the edge's
    override_host cannot write it back, see inferplane.edge), else "" (unknown)."""
    if exchange.response.served:
        return exchange.response.served
    named = exchange.response.summary or exchange.conclusion.reported
    replica_id = named.replica_id if named is not None else ""
    if replica_id:
        for endpoint in exchange.pick.endpoints:
            if endpoint.replica_id == replica_id:
                return endpoint.address
    return ""
