"""The key table watch (`KeyTableWatch`) against a small fake KeyTableService over real gRPC
on loopback: snapshot then changes into the `KeyTable`, the router's identity and token, a
reconnect with a new snapshot after a broken, out-of-order or quiet stream, the stale table
(unknown keys 503, known keys served; logged once each way), its metrics, and the composition
root's pepper rules. With real auth instances: tests/integration/test_key_table.py."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.auth.v1 import key_table_pb2_grpc
from inferplane.router.app import build_app
from inferplane.router.key_source import KeyTableMetrics, KeyTableWatch
from inferplane.router.keys import AUTH_UNAVAILABLE, KeyTable
from inferplane.router.routes import RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import StaticRouteSource
from inferplane.runtime import ConfigError, UnauthenticatedError, UnavailableError
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.testing.clock import FakeClock
from inferplane.wire.headers import INTERNAL_TOKEN

PEPPER = b"pepper-of-the-tests-0123456789"
HASHER = SecretHasher(PEPPER)
KNOWN = "ip-known-secret-0123456789abcdef"
OTHER = "ip-other-secret-0123456789abcdef"


def _entry(secret: str, key_id: str = "k1", **fields: Any) -> kpb.KeyEntry:
    return kpb.KeyEntry(
        secret_hash=HASHER.hash(secret),
        key_id=key_id,
        tenant="acme",
        scopes=["inference"],
        tier="standard",
        **fields,
    )


def _snapshot(*entries: kpb.KeyEntry, revision: int = 1) -> kpb.WatchKeyTableResponse:
    return kpb.WatchKeyTableResponse(snapshot=True, entries=entries, revision=revision)


def _headers(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


Script = Callable[[int], list[kpb.WatchKeyTableResponse]]


class FakeKeyTableService(key_table_pb2_grpc.KeyTableServiceServicer):  # type: ignore[misc]
    """Each stream sends `script(n)` (n: the stream's number from 0), then holds until
    `release` is set (then ends); records each request and its metadata."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[kpb.WatchKeyTableRequest, dict[str, str]]] = []
        self.release = asyncio.Event()

    async def WatchKeyTable(
        self, request: kpb.WatchKeyTableRequest, context: Any
    ) -> AsyncIterator[kpb.WatchKeyTableResponse]:
        n = len(self.requests)
        self.requests.append((request, dict(context.invocation_metadata() or ())))
        for message in self.script(n):
            yield message
        await self.release.wait()


async def _serve(fake: FakeKeyTableService, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    key_table_pb2_grpc.add_KeyTableServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _watch(port: int, table: KeyTable, **kwargs: Any) -> KeyTableWatch:
    values: dict[str, Any] = {"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05}
    values.update(kwargs)
    return KeyTableWatch(f"127.0.0.1:{port}", table, **values)


def test_the_watch_applies_the_snapshot_then_changes_as_the_router() -> None:
    """The router's id, heartbeat and internal token go with the request; the snapshot
    fills the table, a change revokes a key in it, a removal drops another."""

    def script(n: int) -> list[kpb.WatchKeyTableResponse]:
        return [
            _snapshot(_entry(KNOWN), _entry(OTHER, "k2")),
            kpb.WatchKeyTableResponse(entries=[_entry(KNOWN, revoked=True)], revision=2),
            kpb.WatchKeyTableResponse(removed=[HASHER.hash(OTHER)], revision=3),
        ]

    async def scenario() -> None:
        fake = FakeKeyTableService(script)
        server, port = await _serve(fake)
        table = KeyTable(HASHER, FakeClock())
        watch = _watch(
            port, table, router_id="router-1", internal_token="t0k", heartbeat_seconds=0.5
        )
        await watch.start()
        try:
            await _until(lambda: len(table) == 1)
        finally:
            await watch.stop()
            await server.stop(0)
        request, metadata = fake.requests[0]
        assert (request.router_id, request.heartbeat_seconds) == ("router-1", 0.5)
        assert metadata[INTERNAL_TOKEN] == "t0k"
        assert watch.received.is_set() and watch.snapshots == 1
        with pytest.raises(UnauthenticatedError, match="revoked"):
            table.authenticate(_headers(KNOWN), "/v1/chat/completions")
        with pytest.raises(UnauthenticatedError, match="Incorrect API key"):
            table.authenticate(_headers(OTHER), "/v1/chat/completions")

    asyncio.run(scenario())


def test_a_restarted_auth_is_watched_again_from_a_new_snapshot() -> None:
    """Auth goes away mid-stream and comes back on the same port: the watch reconnects (with
    backoff), replaces its table with the new snapshot, and the table was kept meanwhile."""

    def script(n: int) -> list[kpb.WatchKeyTableResponse]:
        return [_snapshot(_entry(KNOWN))] if n == 0 else [_snapshot(_entry(OTHER, "k2"))]

    async def scenario() -> None:
        fake = FakeKeyTableService(script)
        server, port = await _serve(fake)
        table = KeyTable(HASHER, FakeClock())
        watch = _watch(port, table)
        await watch.start()
        try:
            await _until(lambda: watch.snapshots == 1)
            await server.stop(0)
            await asyncio.sleep(0.2)  # auth away: the table stays
            assert table.authenticate(_headers(KNOWN), "/v1/models").key_id == "k1"
            server, _ = await _serve(fake, port)
            await _until(lambda: watch.snapshots == 2)
            assert table.authenticate(_headers(OTHER), "/v1/models").key_id == "k2"
            with pytest.raises(UnauthenticatedError):
                table.authenticate(_headers(KNOWN), "/v1/models")
            assert watch.connects >= 2
        finally:
            await watch.stop()
            await server.stop(0)

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["no_snapshot_first", "revision_gap", "quiet"])
def test_a_stream_out_of_order_or_quiet_is_dropped_and_opened_again(fault: str) -> None:
    """A first message that is no snapshot or a revision gap means the stream cannot be
    trusted; a stream quiet for three heartbeats may be stuck on an auth that cannot read its
    database. Each time the watch opens a new stream (and gets a snapshot there)."""

    def script(n: int) -> list[kpb.WatchKeyTableResponse]:
        if n > 0:
            return [_snapshot(_entry(OTHER, "k2"))]
        if fault == "no_snapshot_first":
            return [kpb.WatchKeyTableResponse(entries=[_entry(KNOWN)], revision=1)]
        if fault == "revision_gap":
            return [_snapshot(_entry(KNOWN)), kpb.WatchKeyTableResponse(revision=3)]
        return [_snapshot(_entry(KNOWN))]

    async def scenario() -> None:
        fake = FakeKeyTableService(script)
        server, port = await _serve(fake)
        table = KeyTable(HASHER, FakeClock())
        watch = _watch(port, table, heartbeat_seconds=0.1, idle_timeout_seconds=0.3)
        await watch.start()
        try:
            await _until(lambda: len(fake.requests) >= 2 and watch.received.is_set())
            await _until(lambda: HASHER.hash(OTHER) in table._entries)
        finally:
            await watch.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_stale_table_serves_known_keys_and_answers_503_for_unknown_ones() -> None:
    """Nothing from auth for longer than the stale bound: a key the table holds still
    authenticates, one it does not know is refused with 503 auth_unavailable (it may have been
    created since), not 401; logged once when it goes stale and once when it recovers."""

    def script(n: int) -> list[kpb.WatchKeyTableResponse]:
        return [_snapshot(_entry(KNOWN))]

    async def scenario() -> list[dict[str, Any]]:
        fake = FakeKeyTableService(script)
        server, port = await _serve(fake)
        clock = FakeClock()
        table = KeyTable(HASHER, clock, stale_after_seconds=5)
        registry = CollectorRegistry()
        KeyTableMetrics(registry, table)
        assert registry.get_sample_value("inferplane_router_key_table_age_seconds") == math.inf
        watch = _watch(port, table, check_seconds=0.01)
        with structlog.testing.capture_logs() as logs:
            await watch.start()
            try:
                await _until(lambda: watch.received.is_set())
                clock.advance(2)
                assert registry.get_sample_value("inferplane_router_key_table_age_seconds") == 2
                assert registry.get_sample_value("inferplane_router_key_table_keys") == 1
                with pytest.raises(UnauthenticatedError):
                    table.authenticate(_headers(OTHER), "/v1/chat/completions")
                clock.advance(4)  # 6 s without an update: stale
                assert table.authenticate(_headers(KNOWN), "/v1/chat/completions").key_id == "k1"
                with pytest.raises(UnavailableError) as info:
                    table.authenticate(_headers(OTHER), "/v1/chat/completions")
                assert info.value.code == AUTH_UNAVAILABLE
                await asyncio.sleep(0.1)
                # Auth's next stream (the fake ends this one) brings a fresh snapshot.
                fake.release.set()
                await _until(lambda: watch.snapshots >= 2)
                await asyncio.sleep(0.1)
                with pytest.raises(UnauthenticatedError):
                    table.authenticate(_headers(OTHER), "/v1/chat/completions")
            finally:
                await watch.stop()
                await server.stop(0)
        return logs

    logs = asyncio.run(scenario())
    events = [e["event"] for e in logs if e["event"] in ("key_table_stale", "key_table_fresh")]
    assert events == ["key_table_stale", "key_table_fresh"]


def test_the_router_needs_auths_pepper_with_an_auth_address(tmp_path: Path) -> None:
    static = StaticRouteSource(RouteTable.of([]))
    with pytest.raises(ConfigError, match="auth_pepper"):
        build_app(RouterSettings(auth_address="127.0.0.1:1"), source=static)
    short = tmp_path / "short"
    short.write_text("too-short\n")
    for bad in (
        {"auth_pepper": "too-short"},
        {"auth_pepper_file": str(short)},
        {"auth_pepper_file": str(tmp_path / "missing")},
        {"auth_pepper": PEPPER.decode(), "auth_pepper_file": str(short)},
    ):
        with pytest.raises(ConfigError):
            build_app(RouterSettings(auth_address="127.0.0.1:1", **bad), source=static)
    # The file as auth writes it (`<data_dir>/auth-pepper`: the text and a newline).
    pepper_file = tmp_path / "auth-pepper"
    pepper_file.write_text(PEPPER.decode() + "\n")
    registry = CollectorRegistry()
    app = build_app(
        RouterSettings(auth_address="127.0.0.1:1", auth_pepper_file=str(pepper_file)),
        source=static,
        registry=registry,
    )
    app.key_table.apply(_snapshot(_entry(KNOWN)))
    assert app.key_table.authenticate(_headers(KNOWN), "/v1/models").key_id == "k1"
    assert registry.get_sample_value("inferplane_router_key_table_keys") == 1
    # No auth: the table stays empty and unreceived, and no watch or metric exists.
    bare = CollectorRegistry()
    app = build_app(RouterSettings(), source=static, registry=bare)
    assert not app.key_table.received and len(app.key_table) == 0
    assert bare.get_sample_value("inferplane_router_key_table_keys") is None
