"""The end of every request the picker decided on, exactly once: the breakers' verdict, the
slot released, and its conclusion (`Reporter.finish`: one `ConcludedRequest`, its usage into
the durable outbox, its record to telemetry), from the response's trailers, the replica's
out-of-band report (`OutcomeService`), or neither (an abort); and the accounting of a report
for a request this process never saw (an orphan: picked before a restart). Nothing here waits
for auth: the response's end is answered at once.

A request concluded without hearing how it ended (its response had started, its stream closed
before the trailers, and no report came within `outcome_wait_seconds`: a replica slow to
report on a loaded node) is *provisional*: recorded as cancelled, its usage marked so. The
replica's report, when it comes later, amends it: the usage report is sent again without the
mark, and auth's ledger replaces the provisional row with it once (tokens accounted then).
The amendment says the request completed only when the replica's end and the end of the
client's stream are within `END_MATCH_SECONDS` of each other (the replica's end: pick time + its
`duration_seconds`, on this router's clock): a client that read the last event closes at once,
while the stream of a replica cut off from the edge is reset by Envoy's keepalive (≥ 5 s after
the last byte it got) or ends before the replica does. Otherwise the request stays cancelled;
its tokens are still accounted, the engine produced them.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence

import structlog

from inferplane.router import records
from inferplane.router.admission import Admission, Slot
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.codec import UNAVAILABLE, status_code
from inferplane.router.picker.state import Exchange, Phase
from inferplane.router.reporting import Reporter
from inferplane.wire import ResponseSummary, headers

log = structlog.get_logger("inferplane.router.picker")

# How many concluded request ids the picker remembers (a replica's report lands within seconds
# of the request's end; a few minutes of traffic at 1,000 requests/s, ~10 MB).
_CONCLUDED_MEMORY = 200_000
# How many provisionally concluded requests it keeps for a late report (each holds its
# exchange, a few KB; they are rare: a stream without trailers whose report is late).
_PROVISIONAL_MEMORY = 10_000
# How far apart a replica's end of a request and the end of its client's stream may be for that
# end to have reached the client: the hop from the pick to the replica and the client's close
# after its last event (ms; seconds on a loaded node). A cut-off replica's stream is reset by
# Envoy's keepalive at least 5 s after the last byte (inferplane.edge REPLICA_KEEPALIVE), or
# ends before the replica does.
END_MATCH_SECONDS = 2.0


class Concluder:
    """Ends requests exactly once and matches replicas' reports to them.

    `outcome_address` (the `OutcomeService` replicas report to; "" = none asked for) and
    `outcome_wait_seconds` are `PickerSettings`'. `served_name(model)` is the name a model is
    served under, or `headers.UNKNOWN_MODEL` (`Director.served_name`): what usage groups a
    request by (None: the client's name as sent).
    """

    def __init__(
        self,
        admission: Admission,
        reporter: Reporter,
        *,
        metrics: RouterMetrics | None = None,
        outcome_address: str = "",
        outcome_wait_seconds: float = 5.0,
        served_name: Callable[[str], str] | None = None,
    ) -> None:
        self._admission = admission
        self._reporter = reporter
        self._metrics = metrics
        self._outcome_address = outcome_address
        self._outcome_wait_seconds = outcome_wait_seconds
        self._served_name = served_name
        # Picked requests by request id, until concluded: what replicas' reports match.
        self._active: dict[str, Exchange] = {}
        # Request ids concluded lately (oldest forgotten first) → their usage report's
        # position in the outbox: a replica's report of one of them is a copy of what the
        # trailers said, acknowledged once that position is durable; an id in neither map is
        # an orphan.
        self._concluded: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Requests concluded provisionally (no trailers, no report in time), oldest first: a
        # late report of one amends its usage (`_amend`).
        self._provisional: collections.OrderedDict[str, Exchange] = collections.OrderedDict()

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
        conclusion.ended_at = self._reporter.clock.monotonic()
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
        state died with the process): its usage is reported from the summary's key, model and
        API, so a router crash loses no tokens (auth drops a copy by request id if the previous
        process had reported it). Returns how many matched a request in flight."""
        return self._report_outcomes(outcomes)[0]

    async def report_outcomes_settled(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """`report_outcomes`, then waits until the conclusion of every request they name is
        in the durable outbox (`flush_interval_seconds` at most while the disk keeps up; a
        request still streaming is waited for until its stream ends), so that the replica's
        report is acknowledged only once nothing of it lives in this process's memory alone:
        a router killed in between does not acknowledge, the replica sends the report again,
        and the restarted router accounts it (auth keeps one row per request id)."""
        matched, positions, streaming = self._report_outcomes(outcomes)
        for exchange in streaming:
            positions.append(await _concluded(exchange))
        if positions:
            await self._reporter.durable(max(positions))
        return matched

    def _report_outcomes(
        self, outcomes: Sequence[tuple[str, ResponseSummary]]
    ) -> tuple[int, list[int], list[Exchange]]:
        matched, positions, streaming = 0, [], []
        for request_id, summary in outcomes:
            exchange = self._active.get(request_id)
            if exchange is None:
                if request_id in self._provisional:
                    positions.append(self._amend(request_id, summary))
                elif request_id in self._concluded:
                    positions.append(self._concluded[request_id])
                elif summary.key_id:
                    positions.append(self._account_orphan(request_id, summary))
                continue
            matched += 1
            conclusion = exchange.conclusion
            conclusion.reported = summary
            if conclusion.waiting is not None:
                conclusion.waiting.cancel()
                self._report(exchange)
                positions.append(conclusion.usage_position)
            elif exchange.phase is not Phase.CONCLUDED:
                streaming.append(exchange)
        return matched, [p for p in positions if p], streaming

    def _account_orphan(self, request_id: str, summary: ResponseSummary) -> int:
        position = self._reporter.finish_reported(request_id, summary)
        self._remember(request_id, position)
        if self._metrics is not None:
            self._metrics.orphan_outcomes.inc()
        log.info("orphan_outcome_accounted", request_id=request_id, key_id=summary.key_id)
        return position

    def _amend(self, request_id: str, summary: ResponseSummary) -> int:
        """The replica's late report of a request concluded provisionally: concludes it again
        from the report and sends its usage (not provisional: auth replaces the row); the
        key's tokens are accounted now. Returns the usage report's position."""
        exchange = self._provisional.pop(request_id)
        trace, conclusion = exchange.trace, exchange.conclusion
        conclusion.reported = summary
        trace.status, trace.error_code = records.STATUS_OK, ""
        _conclude(exchange)
        replica_end = exchange.pick.picked + summary.duration_seconds
        if summary.duration_seconds and abs(conclusion.ended_at - replica_end) > END_MATCH_SECONDS:
            trace.cancel()  # the client's stream did not end with it: never delivered
        if trace.usage is not None:
            exchange.request.key.account(trace.usage.total_tokens)
        position = self._reporter.finish(trace, model=self._usage_model(exchange), amends=True)
        conclusion.usage_position = position
        self._remember(request_id, position)
        if self._metrics is not None:
            self._metrics.provisional_amended.inc()
        log.info(
            "provisional_conclusion_amended",
            request_id=request_id,
            finish_reason=trace.finish_reason,
            status=records.LEDGER_STATUS.get(trace.status, records.FAILED),
            replica_end_after_stream_seconds=round(replica_end - conclusion.ended_at, 3),
        )
        return position

    def _report(self, exchange: Exchange) -> None:
        """Concludes the request and hands its trace over (usage + record), exactly once
        (→ `Phase.CONCLUDED`); provisionally when its wait for the replica's report ran out."""
        trace, conclusion = exchange.trace, exchange.conclusion
        if self._active.get(trace.request_id) is exchange:
            del self._active[trace.request_id]
        provisional = conclusion.waiting is not None and conclusion.reported is None
        conclusion.waiting = None
        exchange.phase = Phase.CONCLUDED
        try:
            if conclusion.ended_in is not Phase.REFUSED:
                _conclude(exchange)
                # The key's tokens per minute and month (`keylimits`), once, now known.
                if trace.usage is not None:
                    exchange.request.key.account(trace.usage.total_tokens)
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
            position = self._reporter.finish(
                trace, model=self._usage_model(exchange), provisional=provisional
            )
            if trace.deployment and self._metrics is not None:
                status = records.LEDGER_STATUS.get(trace.status, records.FAILED)
                self._metrics.adapter_requests.labels(trace.deployment, trace.adapter, status).inc()
                self._metrics.revision_requests.labels(
                    trace.deployment, trace.revision, status
                ).inc()
                if trace.first_token is not None:
                    self._metrics.revision_ttft.labels(trace.deployment, trace.revision).observe(
                        max(0.0, trace.first_token - trace.start)
                    )
            conclusion.usage_position = position
            if trace.request_id:
                self._remember(trace.request_id, position)
                if provisional:
                    self._keep_provisional(exchange)
            if conclusion.concluded is not None and not conclusion.concluded.done():
                conclusion.concluded.set_result(position)

    def _usage_model(self, exchange: Exchange) -> str:
        """What usage groups the request by: the name its model is served under, else
        `headers.UNKNOWN_MODEL` (a routed request keeps its name if the table lost it since)."""
        model = exchange.trace.model
        if self._served_name is None:
            return model or headers.UNKNOWN_MODEL
        name = self._served_name(model) if model else headers.UNKNOWN_MODEL
        if name == headers.UNKNOWN_MODEL and exchange.trace.deployment:
            return model
        return name

    def _keep_provisional(self, exchange: Exchange) -> None:
        self._provisional[exchange.trace.request_id] = exchange
        if len(self._provisional) > _PROVISIONAL_MEMORY:
            self._provisional.popitem(last=False)
        if self._metrics is not None:
            self._metrics.provisional_conclusions.inc()

    def _remember(self, request_id: str, position: int) -> None:
        self._concluded[request_id] = position
        if len(self._concluded) > _CONCLUDED_MEMORY:
            self._concluded.popitem(last=False)


async def _concluded(exchange: Exchange) -> int:
    """Waits until `exchange` is concluded; its usage report's position (0: none)."""
    conclusion = exchange.conclusion
    if exchange.phase is Phase.CONCLUDED:
        return conclusion.usage_position
    if conclusion.concluded is None:
        conclusion.concluded = asyncio.get_running_loop().create_future()
    return await asyncio.shield(conclusion.concluded)


def _release(exchange: Exchange) -> None:
    """Gives the slot back (a grant that raced the end included) and the key's concurrency
    slot (`keylimits.KeyLease.release`)."""
    exchange.request.key.release()
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
    endpoints = exchange.pick.endpoints
    served = next((e for e in endpoints if e.address == address), None)
    if served is not None:
        trace.replica, trace.node = served.replica_id or served.address, served.node
    # The revision whose figures it counts in (a canary's error rate): the served endpoint's,
    # else the primary's, which the breakers' verdict also goes to.
    revision_of = served if served is not None else (endpoints[0] if endpoints else None)
    if revision_of is not None:
        trace.revision = revision_of.revision
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
