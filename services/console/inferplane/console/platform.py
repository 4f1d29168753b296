"""How the console reaches the platform: `inferplane.sdk` acting for the signed-in key.

Every key and usage call goes to auth with the session's key as the bearer token, so auth
decides what it may see (`ApiKeyService.caller`: an admin key sees every tenant, a key with
the `console` scope only its own tenant, and never reaches the admin scope). The console
itself presents the operator (`admin`) identity over mutual TLS, as the CLIs do: auth's
per-RPC policy admits that identity only with a valid key, and the orchestrator and telemetry
reads are read-only: every signed-in key sees the catalogue (deployments, phase, replica
counts), and only an admin key sees where replicas run (placements, their explanation) and
the alerts; the console offers no write on them.

With regions (`ConsoleSettings.usage_regions`), the usage page and its CSV read every region's
ledger and merge them (`inferplane.sdk.AsyncMultiRegionUsage`, `merge_usage`: each request
once, totals from the merged rows); a region that cannot be read fails the page with
`UnavailableError` (reason `USAGE_INCOMPLETE`, naming the region) rather than showing a
partial total.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Protocol

import grpc

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.console.sessions import Identity
from inferplane.runtime import InferplaneError, PermissionDeniedError
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.sdk import AsyncClient, AsyncMultiRegionUsage, KeyWithSecret, MergedUsage

# A tenant name no key can have (tenants start with a letter or digit): asking for it tells
# an admin (allowed, empty answer) from a console key (refused: another tenant).
_PROBE_TENANT = "."
MAX_USAGE_ROWS = 10_000  # CSV export and per-page tables stop here
#: How long a merged multi-region read is reused for the same filters: the usage page asks for
#: three groupings of one period, which one read of every region answers.
MERGED_USAGE_REUSE_SECONDS = 5.0


#: The autoscaler decisions the deployments page shows per deployment (newest first).
AUTOSCALER_DECISIONS_SHOWN = 20


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentView:
    """A deployment with its replicas' placements and the orchestrator's explanation, and,
    when autoscaling is enabled, the autoscaler's recent decisions (newest first; with
    `decisions_error` saying why they could not be read, e.g. an orchestrator without
    `ListAutoscalerDecisions`)."""

    deployment: orchestrator_pb2.Deployment
    placements: Sequence[orchestrator_pb2.Placement]
    explanation: Sequence[str]
    decisions: Sequence[orchestrator_pb2.AutoscalerDecision] = ()
    decisions_error: str = ""


#: The compatibility matrix's entries and forced changes the deployments page shows (admins).
COMPATIBILITY_SHOWN = 100
FORCED_CHANGES_SHOWN = 20


@dataclasses.dataclass(frozen=True, slots=True)
class CompatibilityView:
    """The compatibility matrix (issue 30): each combination's current verdict and the changes
    that overrode a failed one, newest first; `error` says why they could not be read."""

    entries: Sequence[orchestrator_pb2.CompatibilityEntry] = ()
    forced: Sequence[orchestrator_pb2.ForcedChange] = ()
    error: str = ""


class PlatformSession(Protocol):
    """What a page may ask the platform, as the signed-in key (see `SdkSession`)."""

    async def identify(self) -> Identity: ...

    async def list_keys(self, *, show_inactive: bool) -> Sequence[auth_pb2.ApiKey]: ...

    async def create_key(self, key: auth_pb2.ApiKey) -> KeyWithSecret: ...

    async def rotate_key(self, name: str, grace_period_seconds: int) -> KeyWithSecret: ...

    async def revoke_key(self, name: str) -> auth_pb2.ApiKey: ...

    async def update_key(self, key: auth_pb2.ApiKey, fields: Sequence[str]) -> auth_pb2.ApiKey: ...

    async def usage_groups(
        self, by: str, *, start: datetime, key: str = ""
    ) -> Sequence[usage_pb2.UsageGroup]: ...

    async def usage_rows(
        self, *, start: datetime, key: str = "", limit: int = MAX_USAGE_ROWS
    ) -> Sequence[usage_pb2.UsageRow]: ...

    async def deployments(self, *, placements: bool = True) -> Sequence[DeploymentView]:
        """Every deployment (with its autoscaler's recent decisions when autoscaling is
        enabled: the catalogue's, for every key); with `placements`, its replicas'
        placements and explanation."""

    async def compatibility(self) -> CompatibilityView: ...

    async def alerts(self, *, include_resolved: bool) -> Sequence[telemetry_pb2.Alert]: ...

    async def close(self) -> None: ...


class Platform(Protocol):
    """Opens a `PlatformSession` for a key (at sign-in)."""

    def open(self, api_key: str) -> PlatformSession: ...


class SdkSession:
    """`PlatformSession` over `inferplane.sdk.AsyncClient` (auth and orchestrator) and the
    telemetry service's generated stub (the SDK has no telemetry client).

    Errors are the SDK's: `InferplaneError` subclasses carrying OpenAI's code and the HTTP
    status the edge would answer.
    """

    def __init__(
        self,
        api_key: str,
        *,
        auth: str,
        orchestrator: str,
        telemetry: str,
        security: PeerSecurity,
        timeout: float,
        usage_regions: Mapping[str, str] | None = None,
    ) -> None:
        self._regions = (
            AsyncMultiRegionUsage(
                usage_regions, security=security, admin_key=api_key, timeout=timeout
            )
            if usage_regions
            else None
        )
        self._merged: tuple[tuple[datetime, str], float, MergedUsage] | None = None
        self._client = AsyncClient(
            auth=auth,
            orchestrator=orchestrator or None,
            security=security,
            admin_key=api_key,
            timeout=timeout,
        )
        self._api_key = api_key
        self._telemetry_address = telemetry
        self._security = security
        self._timeout = timeout
        self._telemetry_channel: grpc.aio.Channel | None = None

    async def identify(self) -> Identity:
        """Who the key is: an admin, or a console key and its tenant.

        Raises:
            UnauthenticatedError: an unknown, revoked or expired key.
            PermissionDeniedError: a key with neither the admin nor the console scope.
        """
        try:
            async for _ in self._client.keys.list(tenant=_PROBE_TENANT, page_size=1):
                break
        except PermissionDeniedError as exc:
            if exc.param != "tenant":  # no admin or console scope at all
                raise
            # A console key: its own tenant's list always holds the key itself.
            async for key in self._client.keys.list(page_size=1):
                return Identity(self._api_key, key.tenant, is_admin=False)
            raise
        return Identity(self._api_key, "", is_admin=True)

    async def list_keys(self, *, show_inactive: bool) -> Sequence[auth_pb2.ApiKey]:
        return [k async for k in self._client.keys.list(show_inactive=show_inactive)]

    async def create_key(self, key: auth_pb2.ApiKey) -> KeyWithSecret:
        return await self._client.keys.create(key)

    async def rotate_key(self, name: str, grace_period_seconds: int) -> KeyWithSecret:
        return await self._client.keys.rotate(name, grace_period_seconds=grace_period_seconds)

    async def revoke_key(self, name: str) -> auth_pb2.ApiKey:
        return await self._client.keys.revoke(name)

    async def update_key(self, key: auth_pb2.ApiKey, fields: Sequence[str]) -> auth_pb2.ApiKey:
        return await self._client.keys.update(key, fields)

    async def _merged_usage(
        self, regions: AsyncMultiRegionUsage, start: datetime, key: str
    ) -> MergedUsage:
        """Every region's rows since `start` (of `key` when set), merged; reused for
        `MERGED_USAGE_REUSE_SECONDS` for the same filters."""
        now = time.monotonic()
        if self._merged is not None:
            filters, when, merged = self._merged
            if filters == (start, key) and now - when < MERGED_USAGE_REUSE_SECONDS:
                return merged
        merged = await regions.rows(start=start, key=key)
        self._merged = ((start, key), now, merged)
        return merged

    async def usage_groups(
        self, by: str, *, start: datetime, key: str = ""
    ) -> Sequence[usage_pb2.UsageGroup]:
        if self._regions is not None:
            return (await self._merged_usage(self._regions, start, key)).groups(by)
        return [g async for g in self._client.usage.groups(by, start=start, key=key)]

    async def usage_rows(
        self, *, start: datetime, key: str = "", limit: int = MAX_USAGE_ROWS
    ) -> Sequence[usage_pb2.UsageRow]:
        if self._regions is not None:
            merged = await self._merged_usage(self._regions, start, key)
            return [r.row for r in merged.rows[:limit]]
        rows: list[usage_pb2.UsageRow] = []
        async for row in self._client.usage.rows(start=start, key=key, page_size=1000):
            rows.append(row)
            if len(rows) >= limit:
                break
        return rows

    async def deployments(self, *, placements: bool = True) -> Sequence[DeploymentView]:
        views = []
        async for deployment in self._client.deployments.list():
            decisions: Sequence[orchestrator_pb2.AutoscalerDecision] = ()
            decisions_error = ""
            if deployment.autoscaling.enabled:
                try:
                    decisions = await self._client.deployments.autoscaler_decisions(
                        deployment.name, page_size=AUTOSCALER_DECISIONS_SHOWN
                    )
                except InferplaneError as exc:
                    decisions_error = exc.message
            replicas: list[orchestrator_pb2.Placement] = []
            explanation: Sequence[str] = []
            if placements:
                replicas = [p async for p in self._client.deployments.replicas(deployment.name)]
                try:
                    explanation = await self._client.deployments.explain(deployment.name)
                except InferplaneError as exc:
                    explanation = [f"(no explanation: {exc.message})"]
            views.append(
                DeploymentView(deployment, replicas, explanation, decisions, decisions_error)
            )
        return views

    async def compatibility(self) -> CompatibilityView:
        """The newest COMPATIBILITY_SHOWN entries and FORCED_CHANGES_SHOWN forced changes; a
        refused call (e.g. an orchestrator without the matrix) is the view's `error`."""
        entries: list[orchestrator_pb2.CompatibilityEntry] = []
        try:
            async for entry in self._client.deployments.list_compatibility(
                page_size=COMPATIBILITY_SHOWN
            ):
                entries.append(entry)
                if len(entries) >= COMPATIBILITY_SHOWN:
                    break
            forced = await self._client.deployments.list_forced_changes(
                page_size=FORCED_CHANGES_SHOWN
            )
        except InferplaneError as exc:
            return CompatibilityView(entries, (), exc.message)
        return CompatibilityView(entries, forced)

    async def alerts(self, *, include_resolved: bool) -> Sequence[telemetry_pb2.Alert]:
        if not self._telemetry_address:
            return []
        if self._telemetry_channel is None:
            self._telemetry_channel = self._security.aio_channel(self._telemetry_address)
        stub = telemetry_pb2_grpc.TelemetryServiceStub(self._telemetry_channel)
        response = await stub.ListAlerts(
            telemetry_pb2.ListAlertsRequest(include_resolved=include_resolved),
            timeout=self._timeout,
        )
        return list(response.alerts)

    async def close(self) -> None:
        await self._client.close()
        if self._regions is not None:
            await self._regions.close()
        if self._telemetry_channel is not None:
            await self._telemetry_channel.close(None)
            self._telemetry_channel = None


@dataclasses.dataclass(frozen=True, slots=True)
class SdkPlatform:
    """`Platform` over the SDK: the services' addresses and the identity to present
    (`usage_regions`: region → auth address whose ledgers the usage pages merge; empty: `auth`
    only)."""

    auth: str
    orchestrator: str
    telemetry: str
    security: PeerSecurity
    timeout: float = 10.0
    usage_regions: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def open(self, api_key: str) -> PlatformSession:
        return SdkSession(
            api_key,
            auth=self.auth,
            orchestrator=self.orchestrator,
            telemetry=self.telemetry,
            security=self.security,
            timeout=self.timeout,
            usage_regions=self.usage_regions,
        )
