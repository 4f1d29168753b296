"""The usage pages with regions (`ConsoleSettings.usage_regions`): `SdkSession` against two
in-process auth services (plaintext), one per region, merges their ledgers: each request once
(a provisional copy in one region loses to the served request in the other), groups per day,
model and key summed from the merged rows, the CSV's rows; a region that cannot be read fails
the read instead of showing a partial total."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.auth.app import build_components
from inferplane.auth.settings import AuthSettings
from inferplane.console.platform import SdkSession
from inferplane.console.settings import ConsoleSettings
from inferplane.runtime import ConfigError, RunningServer, UnavailableError
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.testing.clock import FakeClock

ADMIN_KEY = "ip-admin-key-0000000000000000000000000000000"
USAGE = {  # region -> (request id, tokens, extra fields)
    "eu": [("eu-1", 30, {}), ("dup", 0, {"status": "cancelled", "provisional": True})],
    "us": [("us-1", 60, {"model": "embed-tiny"}), ("dup", 90, {})],
}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _auth(data_dir: Path, clock: FakeClock) -> RunningServer:
    settings = AuthSettings(
        host="127.0.0.1", port=0, data_dir=data_dir, bootstrap_admin_key=ADMIN_KEY,
        plaintext=True, grace_period_seconds=0.2,
    )  # fmt: skip
    server = RunningServer(build_components(settings, clock=clock).app(), settings)
    await server.start()
    return server


async def _report(server: RunningServer, region: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        rows = [
            usage_pb2.RequestUsage(
                key_id=f"key-{region}",
                request_id=request_id,
                model=extra.pop("model", "kimi-tiny"),
                prompt_tokens=tokens // 3,
                completion_tokens=tokens - tokens // 3,
                **extra,
            )
            for request_id, tokens, extra in ((r, t, dict(x)) for r, t, x in USAGE[region])
        ]
        stub = usage_pb2_grpc.UsageServiceStub(channel)
        await stub.ReportUsage(usage_pb2.ReportUsageRequest(usage=rows), timeout=10)


def test_the_usage_pages_merge_every_regions_ledger(tmp_path: Path) -> None:
    clock = FakeClock()
    start = clock.now() - timedelta(days=1)

    async def scenario() -> dict[str, Any]:
        servers = {r: await _auth(tmp_path / r, clock) for r in USAGE}
        try:
            for region, server in servers.items():
                await _report(server, region)
            regions = {r: f"127.0.0.1:{s.port}" for r, s in servers.items()}
            down = {"eu": regions["eu"], "us": f"127.0.0.1:{_closed_port()}"}
            got: dict[str, Any] = {}
            for name, usage_regions in (("up", regions), ("down", down)):
                session = SdkSession(
                    ADMIN_KEY, auth=regions["eu"], orchestrator="", telemetry="",
                    security=PeerSecurity.plaintext("admin"), timeout=10.0,
                    usage_regions=usage_regions,
                )  # fmt: skip
                try:
                    got[name] = {
                        by: await session.usage_groups(by, start=start) for by in ("day", "model")
                    }
                    got[name]["rows"] = await session.usage_rows(start=start)
                except UnavailableError as exc:
                    got[name] = exc
                finally:
                    await session.close()
            return got
        finally:
            for server in servers.values():
                await server.stop()

    got = asyncio.run(scenario())
    up = got["up"]
    assert sorted(r.request_id for r in up["rows"]) == ["dup", "eu-1", "us-1"]
    (dup,) = [r for r in up["rows"] if r.request_id == "dup"]
    assert (dup.status, dup.prompt_tokens + dup.completion_tokens) == ("completed", 90)
    (day,) = up["day"]
    assert day.group == clock.now().astimezone(UTC).strftime("%Y-%m-%dT00:00:00Z")
    assert (day.requests, day.prompt_tokens + day.completion_tokens) == (3, 180)
    by_model = {g.group: g.prompt_tokens + g.completion_tokens for g in up["model"]}
    assert by_model == {"embed-tiny": 60, "kimi-tiny": 120}
    down = got["down"]
    assert isinstance(down, UnavailableError) and down.reason == "USAGE_INCOMPLETE"
    assert "region us" in down.message


def test_usage_regions_are_checked_at_start() -> None:
    settings = ConsoleSettings(usage_regions={"eu": "a:1", "us": "b:2"})
    assert dict(settings.usage_regions) == {"eu": "a:1", "us": "b:2"}
    with pytest.raises(ConfigError, match="invalid region name"):
        ConsoleSettings(usage_regions={"EU": "a:1"})
    with pytest.raises(ConfigError, match="no auth address"):
        ConsoleSettings(usage_regions={"eu": ""})
    assert ConsoleSettings().usage_regions == {}
