"""Fixtures for the auth tests: a real in-process auth server on a fake clock.

The server runs on its own event loop in a background thread (grpc.aio), bound to 127.0.0.1 on
a free port, with SQLite in a tmp dir; tests talk to it through the generated sync stubs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

from inferplane.api.auth.v1 import auth_pb2_grpc
from inferplane.auth.app import AuthComponents, build_components
from inferplane.auth.settings import AuthSettings
from inferplane.runtime import RunningServer
from inferplane.testing.clock import FakeClock
from inferplane.testing.links import Link
from inferplane.testing.loop import LoopThread

T = TypeVar("T")
ADMIN_KEY = "test-bootstrap-admin-key-0123456789abcdef"


@dataclasses.dataclass
class AuthHarness:
    """A running auth server plus handles on its parts."""

    settings: AuthSettings
    clock: FakeClock
    components: AuthComponents
    loop: LoopThread
    server: RunningServer
    channel: grpc.Channel

    @property
    def keys(self) -> auth_pb2_grpc.ApiKeyServiceStub:
        return auth_pb2_grpc.ApiKeyServiceStub(self.channel)

    @property
    def authz(self) -> external_auth_pb2_grpc.AuthorizationStub:
        return external_auth_pb2_grpc.AuthorizationStub(self.channel)

    def check(
        self,
        key: str | None,
        path: str = "/v1/chat/completions",
        extra: dict[str, str] | None = None,
        authorization: str | None = None,
    ) -> external_auth_pb2.CheckResponse:
        """Calls Check as Envoy would, with `Authorization: Bearer <key>` unless overridden."""
        headers = {":path": path, ":method": "POST", **(extra or {})}
        if authorization is not None:
            headers["authorization"] = authorization
        elif key is not None:
            headers["authorization"] = f"Bearer {key}"
        request = external_auth_pb2.CheckRequest(
            attributes=attribute_context_pb2.AttributeContext(
                request=attribute_context_pb2.AttributeContext.Request(
                    http=attribute_context_pb2.AttributeContext.HttpRequest(
                        method="POST", path=path, headers=headers
                    )
                )
            )
        )
        return self.authz.Check(request, timeout=5)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro)

    def admin_md(self, key: str = ADMIN_KEY) -> tuple[tuple[str, str], ...]:
        """gRPC metadata of a direct admin caller."""
        return (("authorization", f"Bearer {key}"),)

    @property
    def admin_key(self) -> str:
        return ADMIN_KEY


def _make_settings(data_dir: Path, **overrides: Any) -> AuthSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "data_dir": data_dir,
        "bootstrap_admin_key": ADMIN_KEY,
        "grace_period_seconds": 0.5,
    }
    values.update(overrides)
    return AuthSettings(**values)


@contextlib.contextmanager
def running_auth(settings: AuthSettings, clock: FakeClock | None = None) -> Iterator[AuthHarness]:
    """Starts the auth service (schema, bootstrap, gRPC server) and stops it afterwards."""
    clock = clock or FakeClock()
    components = build_components(settings, clock=clock)
    loop = LoopThread()

    async def start() -> RunningServer:
        server = RunningServer(components.app(), settings)
        await server.start()
        return server

    try:
        server = loop.run(start())
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield AuthHarness(settings, clock, components, loop, server, channel)
        finally:
            channel.close()
            loop.run(server.stop())
    finally:
        loop.close()


@pytest.fixture
def auth(tmp_path: Path) -> Iterator[AuthHarness]:
    """A running auth service on SQLite in a tmp dir, bootstrapped with ADMIN_KEY."""
    with running_auth(_make_settings(tmp_path)) as harness:
        yield harness


@pytest.fixture
def make_settings() -> Any:
    """`make_settings(data_dir, **overrides)`: test settings (loopback, port 0, ADMIN_KEY)."""
    return _make_settings


@pytest.fixture
def start_auth() -> Any:
    """`with start_auth(settings, clock) as harness:` for tests that restart the service."""
    return running_auth


# -- two regions (test_regions.py, test_region_shares.py) -----------------------------------


def eventually(check: Callable[[], Any], timeout: float = 8.0, what: str = "") -> Any:
    """`check()`'s first truthy result, polled every 20 ms.

    Raises: AssertionError (naming `what`) when none came within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


@pytest.fixture
def links() -> Iterator[dict[str, Link]]:
    """One cuttable link to each region's auth (what the other region dials)."""
    loop = LoopThread()
    made = {"eu1": Link(loop), "us1": Link(loop)}
    try:
        yield made
    finally:
        for link in made.values():
            link.cut()
        loop.close()
