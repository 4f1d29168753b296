"""A tiny service for shutdown tests: ListAlerts takes `delay` seconds, then answers.

python slow_app.py PORT DELAY EVENT_LOOP
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import App, ServicerBinding, ServiceSettings, run


class SlowTelemetry(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    async def ListAlerts(self, request: Any, context: Any) -> telemetry_pb2.ListAlertsResponse:
        await asyncio.sleep(float(sys.argv[2]))
        return telemetry_pb2.ListAlertsResponse(alerts=[telemetry_pb2.Alert(kind="done")])


def main() -> None:
    settings = ServiceSettings(
        port=int(sys.argv[1]), grace_period_seconds=5, event_loop=sys.argv[3]
    )
    app = App(
        component="slow",
        registry=CollectorRegistry(),
        servicers=[
            ServicerBinding(
                "inferplane.telemetry.v1.TelemetryService",
                SlowTelemetry(),
                telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server,
            )
        ],
    )
    run(lambda _settings: app, settings)  # what every service's __main__ does


if __name__ == "__main__":
    main()
