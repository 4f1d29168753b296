"""The replica's inference server: `inferplane.inference.v1.InferenceService` over the process's
one replica (`service.py`), the bodies it runs (`bodies.py`, `speech.py`), one request's facts
and the one classification of its end (`facts.py`), and what telemetry gets of it
(`outcome.py`)."""

from inferplane.replica.server.facts import RequestFacts
from inferplane.replica.server.outcome import (
    End,
    Ending,
    OutcomeSink,
    RequestOutcome,
    discard_outcome,
    record_sender,
)
from inferplane.replica.server.service import InferenceServicer, ReportToPicker, StreamMetrics

__all__ = [
    "End",
    "Ending",
    "InferenceServicer",
    "OutcomeSink",
    "ReportToPicker",
    "RequestFacts",
    "RequestOutcome",
    "StreamMetrics",
    "discard_outcome",
    "record_sender",
]
