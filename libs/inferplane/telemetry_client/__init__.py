"""Client side of telemetry: `RecordSink`, the request path's non-blocking record hand-off.

Routers and node-agents build one `RecordSink` in their composition root (with their
registry), `await sink.start()` on start-up, call `sink.record(record)` once per request, and
`await sink.close()` on shutdown.
"""

from inferplane.telemetry_client._sink import (
    RETRYABLE_CODES,
    RecordSink,
    SinkMetrics,
    SinkSettings,
)

__all__ = ["RETRYABLE_CODES", "RecordSink", "SinkMetrics", "SinkSettings"]
