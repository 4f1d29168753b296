"""`inferplane.router.v1.OutcomeService`: replicas report to the picker how requests ended.

The picker reads a request's `ResponseSummary` from the response trailers Envoy shows it, but
Envoy cancels the picker's side stream when the client goes away, and an OpenAI client does so
as soon as it has read `data: [DONE]` — often before the trailers reached the picker (measured
through the local stack: 1 to 3 requests of 4). The replica that served the request reports the
same summary here (it learns where from the `x-inferplane-picker` request header), so usage and
records stay exact whatever the client does.
"""

from __future__ import annotations

from typing import Any

from inferplane.api.router.v1 import outcome_pb2, outcome_pb2_grpc
from inferplane.router.picker.server import EndpointPicker
from inferplane.wire import ResponseSummary

SERVICE_NAME = "inferplane.router.v1.OutcomeService"


class OutcomeService(outcome_pb2_grpc.OutcomeServiceServicer):  # type: ignore[misc]
    """Hands each reported outcome to the picker and answers once the conclusions they name
    are in the durable usage outbox (`EndpointPicker.report_outcomes_settled`): an
    acknowledged report is never only in this process's memory."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    async def ReportOutcomes(
        self, request: outcome_pb2.ReportOutcomesRequest, context: Any
    ) -> outcome_pb2.ReportOutcomesResponse:
        matched = await self._picker.report_outcomes_settled(
            [
                (outcome.request_id, ResponseSummary.from_metadata(dict(outcome.summary)))
                for outcome in request.outcomes
                if outcome.request_id
            ]
        )
        return outcome_pb2.ReportOutcomesResponse(matched=matched)
