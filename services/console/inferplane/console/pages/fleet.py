"""The platform pages: deployments (the orchestrator's catalogue and, for admin keys, where
replicas run) and alerts (telemetry's, admin keys only).

Errors: a refused call shows the platform's message with the edge's status; an unreachable
orchestrator or telemetry (a raw gRPC channel error) answers 503 naming the gRPC code; a
console key asking for alerts answers 403.
"""

from __future__ import annotations

import grpc
from aiohttp import web

from inferplane.console.web import Console
from inferplane.runtime import InferplaneError


class FleetPages:
    """`deployments` and `alerts` (GET; `alerts?resolved=1` includes resolved alerts)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    async def deployments_page(self, request: web.Request) -> web.StreamResponse:
        """Every deployment's model, phase, replica count and release; for an admin key also
        each replica's node, GPUs and health and the placement explanation (the fleet's
        layout is the operators', not a tenant's: a console key sees the catalogue only)."""
        _, identity, client = self.console.signed_in(request)
        try:
            views = await client.deployments(placements=identity.is_admin)
        except InferplaneError as exc:
            return await self.console.platform_error(request, exc, "deployments.html", views=[])
        except grpc.RpcError as exc:  # a raw channel error (the orchestrator unreachable)
            return self.console.render(
                request, "deployments.html", status=503, views=[],
                error=f"The orchestrator is unreachable: {exc.code().name}",  # type: ignore[attr-defined]
            )  # fmt: skip
        return self.console.render(request, "deployments.html", views=views)

    async def alerts_page(self, request: web.Request) -> web.StreamResponse:
        """Telemetry's alerts: platform operations, for admin keys only (403 otherwise)."""
        _, identity, client = self.console.signed_in(request)
        if not identity.is_admin:
            return self.console.render(
                request, "alerts.html", status=403, alerts=[], include_resolved=False,
                error="Alerts are for platform operators: sign in with an admin key.",
            )  # fmt: skip
        include_resolved = request.query.get("resolved") == "1"
        try:
            alerts = await client.alerts(include_resolved=include_resolved)
        except grpc.RpcError as exc:
            return self.console.render(
                request, "alerts.html", status=503, alerts=[], include_resolved=include_resolved,
                error=f"Telemetry is unreachable: {exc.code().name}",  # type: ignore[attr-defined]
            )  # fmt: skip
        return self.console.render(
            request, "alerts.html", alerts=alerts, include_resolved=include_resolved
        )
