"""Fixtures for the console's unit tests: a hand-written fake platform (what auth, the
orchestrator and telemetry would answer for each key) and a console on a real aiohttp server
driven by aiohttp's test client (cookies kept, like a browser)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.console.app import build_app
from inferplane.console.platform import CompatibilityView, DeploymentView
from inferplane.console.sessions import Identity
from inferplane.console.settings import ConsoleSettings
from inferplane.runtime import NotFoundError, PermissionDeniedError, UnauthenticatedError
from inferplane.sdk import KeyWithSecret
from inferplane.testing.clock import FakeClock

ADMIN_KEY = "ip-admin-key-0000000000000000000000000000000"
ACME_KEY = "ip-acme-console-00000000000000000000000000000"
INFERENCE_KEY = "ip-acme-inference-000000000000000000000000000"


@dataclasses.dataclass
class FakePlatform:
    """Keys by tenant, as auth would scope them: an admin sees all, a console key its tenant."""

    keys: dict[str, auth_pb2.ApiKey] = dataclasses.field(default_factory=dict)
    created: list[auth_pb2.ApiKey] = dataclasses.field(default_factory=list)
    rows: list[usage_pb2.UsageRow] = dataclasses.field(default_factory=list)
    groups: dict[str, list[usage_pb2.UsageGroup]] = dataclasses.field(default_factory=dict)
    closed: int = 0
    updates: list[tuple[auth_pb2.ApiKey, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    revoked_secrets: set[str] = dataclasses.field(default_factory=set)
    # Set: the orchestrator refuses ListAutoscalerDecisions with this message.
    decisions_error: str = ""
    # What ListCompatibility / ListForcedChanges answer (issue 30).
    compatibility: CompatibilityView = dataclasses.field(default_factory=CompatibilityView)

    def __post_init__(self) -> None:
        for key_id, tenant in (("k-acme", "acme"), ("k-globex", "globex")):
            self.keys[key_id] = auth_pb2.ApiKey(
                name=f"api-keys/{key_id}",
                display_name=f"{tenant} app",
                tenant=tenant,
                scopes=["inference"],
                key_prefix="ip-abcde",
                state=auth_pb2.ApiKey.STATE_ACTIVE,
            )

    def open(self, api_key: str) -> FakeSession:
        return FakeSession(self, api_key)


class FakeSession:
    def __init__(self, platform: FakePlatform, api_key: str) -> None:
        self.p = platform
        self.api_key = api_key

    def _tenant(self) -> str | None:
        if self.api_key in self.p.revoked_secrets:
            raise UnauthenticatedError("Incorrect API key provided", code="invalid_api_key")
        if self.api_key == ADMIN_KEY:
            return None
        if self.api_key == ACME_KEY:
            return "acme"
        if self.api_key == INFERENCE_KEY:
            raise PermissionDeniedError("lacks the 'admin' (or 'console') scope")
        raise UnauthenticatedError("Incorrect API key provided", code="invalid_api_key")

    async def identify(self) -> Identity:
        tenant = self._tenant()
        return Identity(self.api_key, tenant or "", is_admin=tenant is None)

    async def list_keys(self, *, show_inactive: bool) -> Sequence[auth_pb2.ApiKey]:
        tenant = self._tenant()
        return [k for k in self.p.keys.values() if tenant is None or k.tenant == tenant]

    async def create_key(self, key: auth_pb2.ApiKey) -> KeyWithSecret:
        tenant = self._tenant()
        self.p.created.append(key)
        made = auth_pb2.ApiKey()
        made.CopyFrom(key)
        made.name = f"api-keys/new{len(self.p.created)}"
        made.tenant = tenant or key.tenant or "default"
        made.state = auth_pb2.ApiKey.STATE_ACTIVE
        made.key_prefix = "ip-newkk"
        self.p.keys[made.name.split("/")[1]] = made
        return KeyWithSecret(made, f"ip-secret-{len(self.p.created)}-" + "s" * 30)

    def _own(self, name: str) -> auth_pb2.ApiKey:
        tenant = self._tenant()
        key = self.p.keys.get(name.removeprefix("api-keys/"))
        if key is None or (tenant is not None and key.tenant != tenant):
            raise NotFoundError(f"api-keys/{name} not found")
        return key

    async def rotate_key(self, name: str, grace_period_seconds: int) -> KeyWithSecret:
        return KeyWithSecret(self._own(name), "ip-rotated-" + "r" * 35)

    async def update_key(self, key: auth_pb2.ApiKey, fields: Sequence[str]) -> auth_pb2.ApiKey:
        stored = self._own(key.name)
        self.p.updates.append((key, tuple(fields)))
        for field in fields:
            if field in ("scopes", "allowed_models"):
                getattr(stored, field)[:] = list(getattr(key, field))
            elif field == "limits":
                stored.limits.CopyFrom(key.limits)
            else:
                setattr(stored, field, getattr(key, field))
        return stored

    async def revoke_key(self, name: str) -> auth_pb2.ApiKey:
        key = self._own(name)
        key.state = auth_pb2.ApiKey.STATE_REVOKED
        return key

    async def usage_groups(
        self, by: str, *, start: datetime, key: str = ""
    ) -> Sequence[usage_pb2.UsageGroup]:
        self._tenant()
        return self.p.groups.get(by, [])

    async def usage_rows(
        self, *, start: datetime, key: str = "", limit: int = 10_000
    ) -> Sequence[usage_pb2.UsageRow]:
        tenant = self._tenant()
        return [r for r in self.p.rows if tenant is None or r.tenant == tenant]

    async def deployments(self, *, placements: bool = True) -> Sequence[DeploymentView]:
        self._tenant()
        deployment = orchestrator_pb2.Deployment(name="deployments/kimi-tiny", replicas=1)
        deployment.status.phase = "Ready"
        auto = DeploymentView(
            autoscaled_deployment(), [], [],
            [] if self.p.decisions_error else autoscaler_decisions(), self.p.decisions_error,
        )  # fmt: skip
        if not placements:
            return [DeploymentView(deployment, [], []), auto]
        placement = orchestrator_pb2.Placement(replica_id="kimi-tiny-0", node="gpu-node-7")
        return [
            DeploymentView(deployment, [placement], ["placed on gpu-node-7: most free"]),
            auto,
        ]

    async def compatibility(self) -> CompatibilityView:
        return self.p.compatibility

    async def alerts(self, *, include_resolved: bool) -> Sequence[telemetry_pb2.Alert]:
        return [telemetry_pb2.Alert(kind="ttft_p99", deployment="kimi-tiny", message="slow")]

    async def close(self) -> None:
        self.p.closed += 1


# An autoscaler reason with markup in it: the page must show it as text.
HOSTILE_REASON = "queue <b>8</b> > target & <script>alert(1)</script>"


def autoscaled_deployment() -> orchestrator_pb2.Deployment:
    """`kimi-auto`: autoscaling on (1..4, scale to zero, 30 s window, TTFT SLO 0.5 s), the
    autoscaler asking for 3 after a scale-up whose reason holds markup."""
    deployment = orchestrator_pb2.Deployment(
        name="deployments/kimi-auto", min_replicas=1, max_replicas=4, replicas=3
    )
    deployment.profile.ttft_slo_seconds = 0.5
    deployment.autoscaling.CopyFrom(
        orchestrator_pb2.Autoscaling(
            enabled=True, scale_to_zero=True, scale_down_window_seconds=30,
            idle_seconds_before_zero=90, cold_start_budget_seconds=45,
        )
    )  # fmt: skip
    deployment.status.phase = "Ready"
    deployment.status.ready_replicas = 2
    status = deployment.status.autoscaler
    status.desired_replicas = 3
    status.last_decision = "scale_up"
    status.reason = HOSTILE_REASON
    status.last_change_time.FromSeconds(1_790_000_100)
    status.signals.CopyFrom(
        orchestrator_pb2.AutoscalerSignals(
            queued_requests=8, max_queue_wait_seconds=1.25, queue_rejections_per_second=0.5,
            in_flight_requests=13, engine_waiting_requests=2, kv_usage=0.42,
            ttft_p99_seconds=0.875, idle_seconds=0, ready_replicas=2,
        )
    )  # fmt: skip
    return deployment


def autoscaler_decisions() -> list[orchestrator_pb2.AutoscalerDecision]:
    """kimi-auto's decisions, newest first: from zero to 1, then up to 3."""
    older = orchestrator_pb2.AutoscalerDecision(
        deployment="deployments/kimi-auto", decision="scale_from_zero", from_replicas=0,
        to_replicas=1, reason="1 request held at zero",
        signals=orchestrator_pb2.AutoscalerSignals(cold_waiting_requests=1, idle_seconds=0),
    )  # fmt: skip
    older.time.FromSeconds(1_790_000_000)
    newer = orchestrator_pb2.AutoscalerDecision(
        deployment="deployments/kimi-auto", decision="scale_up", from_replicas=1,
        to_replicas=3, reason=HOSTILE_REASON,
        signals=orchestrator_pb2.AutoscalerSignals(queued_requests=8, in_flight_requests=13),
    )  # fmt: skip
    newer.time.FromSeconds(1_790_000_100)
    return [newer, older]


CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(page: str) -> str:
    match = CSRF_RE.search(page)
    assert match, "the page has no CSRF token"
    return match.group(1)


Scenario = Callable[[TestClient[Any, Any], FakePlatform, FakeClock], Awaitable[None]]


@pytest.fixture
def run_console() -> Callable[..., None]:
    """`run_console(scenario, **settings)`: runs `scenario(client, platform, clock)` against
    a console on a real aiohttp server (and, with `edge_app`, a fake edge beside it)."""

    def run(
        scenario: Scenario, *, edge_app: web.Application | None = None, **overrides: Any
    ) -> None:
        async def main() -> None:
            edge = None
            if edge_app is not None:
                edge = TestServer(edge_app)
                await edge.start_server()
                overrides["edge_url"] = str(edge.make_url("/")).rstrip("/")
            settings = ConsoleSettings(plaintext=True, **overrides)
            platform, clock = FakePlatform(), FakeClock()
            client = TestClient(TestServer(build_app(settings, platform=platform, clock=clock)))
            await client.start_server()
            try:
                await scenario(client, platform, clock)
            finally:
                await client.close()
                if edge is not None:
                    await edge.close()

        asyncio.run(main())

    return run


async def _sign_in(client: TestClient[Any, Any], key: str) -> Any:
    page = await (await client.get("/console/sign-in")).text()
    return await client.post(
        "/console/sign-in",
        data={"api_key": key, "csrf_token": csrf_of(page)},
        allow_redirects=True,
    )


@pytest.fixture
def sign_in() -> Callable[[TestClient[Any, Any], str], Awaitable[Any]]:
    """`await sign_in(client, key)`: the sign-in form filled and posted (redirects followed)."""
    return _sign_in


@pytest.fixture
def csrf() -> Callable[[str], str]:
    """`csrf(page_html)`: the CSRF token of a page's forms."""
    return csrf_of
