"""Service identity (issue 18): mutual TLS from a local CA and a per-RPC policy, on a real
gRPC server built by the runtime (`RunningServer`)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import App, ConfigError, RunningServer, ServicerBinding, ServiceSettings
from inferplane.runtime.security.identity import PeerPolicy, PeerSecurity
from inferplane.runtime.security.pki import LocalCA

SERVICE = "/inferplane.telemetry.v1.TelemetryService/"


class _Telemetry(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    async def QueryLatency(
        self, request: telemetry_pb2.QueryLatencyRequest, context: object
    ) -> telemetry_pb2.QueryLatencyResponse:
        return telemetry_pb2.QueryLatencyResponse()

    async def ListAlerts(
        self, request: telemetry_pb2.ListAlertsRequest, context: object
    ) -> telemetry_pb2.ListAlertsResponse:
        return telemetry_pb2.ListAlertsResponse()


def _pki(root: Path, *names: str) -> Path:
    ca = LocalCA.ensure(root)
    for name in names:
        ca.issue(name, dns_names=("localhost", name), ip_addresses=("127.0.0.1",))
    return root


def _app(policy: PeerPolicy | None) -> App:
    return App(
        component="telemetry",
        servicers=[
            ServicerBinding(
                "inferplane.telemetry.v1.TelemetryService",
                _Telemetry(),
                telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server,
            )
        ],
        registry=CollectorRegistry(),
        peer_policy=policy,
    )


async def _code(channel: grpc.aio.Channel, call: str = "QueryLatency") -> grpc.StatusCode:
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    request = (
        telemetry_pb2.QueryLatencyRequest()
        if call == "QueryLatency"
        else telemetry_pb2.ListAlertsRequest()
    )
    try:
        await getattr(stub, call)(request, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_policy_decides_per_method_and_identity(tmp_path: Path) -> None:
    """Only the listed identity calls a method; another service's certificate gets
    PERMISSION_DENIED; no certificate, or one from another CA, gets no connection at all (the
    handshake requires one); a rotated server certificate is served to new connections
    without a restart."""
    pki = _pki(tmp_path / "pki", "telemetry", "router", "admin")
    rogue = _pki(tmp_path / "rogue", "router")
    policy = PeerPolicy({SERVICE + "QueryLatency": ["router"], SERVICE: ["admin"]})
    settings = ServiceSettings(tls_dir=pki, port=0)

    async def scenario() -> None:
        server = RunningServer(_app(policy), settings)
        await server.start()
        address = f"127.0.0.1:{server.port}"
        try:
            router = PeerSecurity(pki, "router")
            admin = PeerSecurity(pki, "admin")
            async with router.aio_channel(address) as ch:
                assert await _code(ch) == grpc.StatusCode.OK
                assert await _code(ch, "ListAlerts") == grpc.StatusCode.PERMISSION_DENIED
            async with admin.aio_channel(address) as ch:
                assert await _code(ch, "ListAlerts") == grpc.StatusCode.OK
                assert await _code(ch) == grpc.StatusCode.PERMISSION_DENIED
            # TLS without a client certificate: trusts the CA, presents nothing.
            anonymous = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
            async with grpc.aio.secure_channel(address, anonymous) as ch:
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
            async with admin.aio_channel(address) as ch:  # health: any identity
                health = health_pb2_grpc.HealthStub(ch)
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with PeerSecurity(rogue, "router").aio_channel(address) as ch:
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(address) as ch:
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE

            # Rotation: a new CA and new leaves; new handshakes use them at once.
            for name in ("ca.crt", "ca.key", "telemetry.crt", "telemetry.key"):
                (pki / name).unlink()
            _pki(pki, "telemetry", "router")
            await asyncio.sleep(0.01)
            async with PeerSecurity(pki, "router").aio_channel(address) as ch:
                assert await _code(ch) == grpc.StatusCode.OK
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_without_a_policy_any_certificate_from_the_ca_is_enough(tmp_path: Path) -> None:
    pki = _pki(tmp_path, "telemetry", "router")

    async def scenario() -> None:
        server = RunningServer(_app(None), ServiceSettings(tls_dir=pki, port=0))
        await server.start()
        try:
            address = f"127.0.0.1:{server.port}"
            async with PeerSecurity(pki, "router").aio_channel(address) as ch:
                assert await _code(ch) == grpc.StatusCode.OK
            anonymous = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
            async with grpc.aio.secure_channel(address, anonymous) as ch:
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_service_needs_an_identity_or_the_explicit_plaintext_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--plaintext"):
        PeerSecurity.from_settings(None, "router", plaintext=False)
    with pytest.raises(ConfigError, match=r"router\.crt"):
        PeerSecurity.from_settings(_pki(tmp_path, "auth"), "router", plaintext=False)
    assert not PeerSecurity.from_settings(None, "router", plaintext=True).mtls
    assert PeerSecurity.from_settings(tmp_path, "auth", plaintext=False).mtls
    with pytest.raises(ValueError, match=r"not '/pkg\.Service/'"):
        PeerPolicy({"QueryLatency": ["router"]})
    assert dataclasses.replace(ServiceSettings(), plaintext=True).security("node_agent").name == (
        "node-agent"
    )


def test_a_peer_dialled_by_address_is_checked_against_its_identity(tmp_path: Path) -> None:
    """`server_options(identity)`: the server's certificate must name that identity, whatever
    address it was dialled at (one node-agent certificate serves every node): an address the
    certificate does not name is accepted, the wrong identity is refused."""
    root = tmp_path / "pki"
    ca = LocalCA.ensure(root)
    ca.issue("telemetry", dns_names=("telemetry",))  # no localhost, no IP
    ca.issue("router", dns_names=("router",))
    settings = ServiceSettings(tls_dir=root, port=0)

    async def scenario() -> None:
        server = RunningServer(_app(None), settings)
        await server.start()
        address = f"127.0.0.1:{server.port}"
        client = PeerSecurity(root, "router")
        try:
            async with client.aio_channel(address) as ch:  # checked against 127.0.0.1
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
            async with client.aio_channel(address, client.server_options("telemetry")) as ch:
                assert await _code(ch) == grpc.StatusCode.OK
            async with client.aio_channel(address, client.server_options("router")) as ch:
                assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop()

    asyncio.run(scenario())
    assert PeerSecurity.plaintext().server_options("router") == []
