"""The platform pages: deployments (the orchestrator's catalogue with each autoscaled
deployment's signals and recent decisions, and, for admin keys, where replicas run) and alerts
(telemetry's, admin keys only).

Errors: a refused call shows the platform's message with the edge's status; an unreachable
orchestrator or telemetry (a raw gRPC channel error) answers 503 naming the gRPC code; a
console key asking for alerts answers 403.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
from aiohttp import web
from markupsafe import Markup

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.console.charts import Step, step_chart
from inferplane.console.platform import DeploymentView
from inferplane.console.web import Console
from inferplane.runtime import InferplaneError


def replica_steps(decisions: Sequence[orchestrator_pb2.AutoscalerDecision]) -> list[Step]:
    """The replica count over time from autoscaler decisions (any order): the first
    decision's `from_replicas` at its time, then each decision's `to_replicas` from its time
    on."""
    ordered = sorted(decisions, key=lambda d: (d.time.seconds, d.time.nanos))
    if not ordered:
        return []
    first = ordered[0]
    steps = [Step(first.time.ToNanoseconds() / 1e9, first.from_replicas)]
    steps += [Step(d.time.ToNanoseconds() / 1e9, d.to_replicas) for d in ordered]
    return steps


def replica_charts(views: Sequence[DeploymentView], now: float) -> dict[str, Markup]:
    """Deployment name → an SVG step chart of its replicas over its recent autoscaler
    decisions, up to `now` (seconds since the epoch); only deployments with decisions."""
    charts = {}
    for i, view in enumerate(views, start=1):
        steps = replica_steps(view.decisions)
        if steps:
            short = view.deployment.name.split("/")[-1]
            charts[view.deployment.name] = step_chart(
                steps, end=now, title=f"Replicas of {short} after each autoscaler decision",
                unit="replicas", chart_id=f"replicas-chart-{i}",
            )  # fmt: skip
    return charts


class FleetPages:
    """`deployments` and `alerts` (GET; `alerts?resolved=1` includes resolved alerts)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    async def deployments_page(self, request: web.Request) -> web.StreamResponse:
        """Every deployment's model, phase, replica count and release, and for an autoscaled
        one its bounds, desired replicas, scale to zero, last decision, signals and recent
        decisions (with a step chart of its replicas); for an admin key also each replica's
        node, GPUs and health, the placement explanation and the compatibility matrix with its
        forced changes (the fleet's layout is the
        operators', not a tenant's: a console key sees the catalogue only)."""
        _, identity, client = self.console.signed_in(request)
        try:
            views = await client.deployments(placements=identity.is_admin)
        except InferplaneError as exc:
            return await self.console.platform_error(
                request, exc, "deployments.html", views=[], charts={}
            )
        except grpc.RpcError as exc:  # a raw channel error (the orchestrator unreachable)
            return self.console.render(
                request, "deployments.html", status=503, views=[], charts={},
                error=f"The orchestrator is unreachable: {exc.code().name}",  # type: ignore[attr-defined]
            )  # fmt: skip
        charts = replica_charts(views, time.time())
        # The compatibility matrix: release verdicts and overrides are the operators' view.
        compat = await client.compatibility() if identity.is_admin else None
        return self.console.render(
            request, "deployments.html", views=views, charts=charts, compat=compat
        )

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
