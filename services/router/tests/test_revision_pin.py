"""An operator's request pinned to one profile revision (`router.revision_pin`, issue 30): the
picker over real gRPC driven as Envoy drives it (`ExtProcStream`), keys authenticated with a
hand-fed `KeyTable`, a route whose canary shares give the stable revision all live traffic and
the candidate none (a candidate under qualification)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.keys import KeyTable
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.policies import default_registry
from inferplane.router.reporting import Reporter
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.runtime import ErrorInterceptor
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.testing.clock import FakeClock
from inferplane.wire import headers

from .fakes import ExtProcStream, FakeScheduler, RecordingUsage

pytestmark = pytest.mark.timeout(30)

PEPPER = b"p" * 32
ADMIN = "ip-admin-secret-0123456789"
USER = "ip-user-secret-0123456789"
CHAT = "/v1/chat/completions"
STABLE, CANDIDATE, GONE = "rev-stable", "rev-candidate", "rev-gone"

#: r0, r1: stable (100 % of live traffic); r2: the candidate (no share: dark); r3: a draining
#: replica of an old revision.
ROUTE = ModelRoute(
    "m",
    (
        Endpoint("10.0.0.0:50054", "r0", revision=STABLE),
        Endpoint("10.0.0.1:50054", "r1", revision=STABLE),
        Endpoint("10.0.0.2:50054", "r2", revision=CANDIDATE),
        Endpoint("10.0.0.3:50054", "r3", revision=GONE, draining=True),
    ),
    deployment="d",
    routing_policy="least_load",
    revision_shares=((STABLE, 100),),
)


def _keys() -> KeyTable:
    table = KeyTable(SecretHasher(PEPPER), FakeClock())
    entries = [
        kpb.KeyEntry(
            secret_hash=SecretHasher(PEPPER).hash(secret),
            key_id=key_id,
            tenant="t1",
            scopes=scopes,
            tier="standard",
        )
        for secret, key_id, scopes in (
            (ADMIN, "k-admin", ["inference", "admin"]),
            (USER, "k-user", ["inference"]),
        )
    ]
    table.apply(kpb.WatchKeyTableResponse(snapshot=True, entries=entries))
    return table


@dataclasses.dataclass
class _Rig:
    stub: ext_grpc.ExternalProcessorStub
    records: list[telemetry_pb2.RequestRecord]

    async def pick(
        self, key: str, revision: str | None, path: str = CHAT
    ) -> tuple[ExtProcStream, ext_pb.ProcessingResponse, ext_pb.ProcessingResponse]:
        """The request's headers answer and its body answer."""
        stream = ExtProcStream(self.stub)
        metadata = {"authorization": f"Bearer {key}"}
        if revision is not None:
            metadata[headers.REVISION] = revision
        first = await stream.headers(path, metadata)
        assert first.HasField("request_headers"), first
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ).encode()
        return stream, first, await stream.body(body)


@contextlib.asynccontextmanager
async def _rig() -> AsyncIterator[_Rig]:
    table = RouteTable.of([ROUTE])
    clock = FakeClock()
    control = Admission(default_registry(), AdmissionSettings(), clock, FakeScheduler(clock))
    control.apply(table)
    records: list[telemetry_pb2.RequestRecord] = []
    picker = EndpointPicker(
        lambda: table,
        control,
        Reporter(RecordingUsage(), records.append, clock, wall_clock=lambda: 1.7e9),
        settings=PickerSettings(keepalive_seconds=0.01),
        metrics=RouterMetrics(CollectorRegistry()),
        keys=_keys(),
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield _Rig(ext_grpc.ExternalProcessorStub(channel), records)
    finally:
        await server.stop(0)


def _endpoints(answer: ext_pb.ProcessingResponse) -> list[str]:
    assert answer.HasField("request_body"), answer
    lb = answer.dynamic_metadata.fields[headers.PICK_NAMESPACE].struct_value
    return lb.fields[headers.DESTINATION_ENDPOINT].string_value.split(",")


def _error(answer: ext_pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert answer.HasField("immediate_response"), answer
    body = json.loads(answer.immediate_response.body)
    return answer.immediate_response.status.code, body


def _removed(answer: ext_pb.ProcessingResponse) -> list[str]:
    return list(answer.request_headers.response.header_mutation.remove_headers)


def test_an_admin_key_reaches_the_dark_candidate_and_only_it() -> None:
    """Pinned to the candidate (no share: no live traffic), an admin key's request goes to the
    candidate's replica, with no fallback to another revision; the pin header is removed
    before the replica; the response names the served revision."""

    async def scenario() -> None:
        async with _rig() as rig:
            stream, first, answer = await rig.pick(ADMIN, CANDIDATE)
            assert headers.REVISION in _removed(first)
            assert _endpoints(answer) == ["10.0.0.2:50054"]
            reply = await stream.response_headers(
                {":status": "200", headers.SERVED_BY: "r2"}, served="10.0.0.2:50054"
            )
            mutation = reply.response_headers.response.header_mutation
            served = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
            assert served[headers.SERVED_REVISION] == CANDIDATE

    asyncio.run(scenario())


def test_a_pin_to_the_stable_revision_lists_only_its_replicas() -> None:
    """Pinned to the stable revision: its two replicas (primary and fallback), never the
    candidate's or the draining one's."""

    async def scenario() -> None:
        async with _rig() as rig:
            for _ in range(3):
                _, _, answer = await rig.pick(ADMIN, STABLE)
                assert set(_endpoints(answer)) == {"10.0.0.0:50054", "10.0.0.1:50054"}

    asyncio.run(scenario())


def test_without_a_pin_live_traffic_never_reaches_the_candidate() -> None:
    """The same admin key without the header: the canary shares decide (stable only), and no
    header is removed (there was none)."""

    async def scenario() -> None:
        async with _rig() as rig:
            for _ in range(3):
                _, first, answer = await rig.pick(ADMIN, None)
                assert headers.REVISION not in _removed(first)
                assert "10.0.0.2:50054" not in _endpoints(answer)

    asyncio.run(scenario())


def test_a_key_without_the_admin_scope_is_refused_403_in_openais_shape() -> None:
    """An inference key that sends the pin: 403 insufficient_scope naming the header, in
    OpenAI's error shape, and no replica picked."""

    async def scenario() -> None:
        async with _rig() as rig:
            _, _, answer = await rig.pick(USER, CANDIDATE)
            status, body = _error(answer)
            assert status == 403
            assert body["error"]["code"] == "insufficient_scope"
            assert body["error"]["param"] == headers.REVISION
            assert "admin" in body["error"]["message"]

    asyncio.run(scenario())


def test_a_key_without_the_admin_scope_is_refused_in_anthropics_shape_on_messages() -> None:
    """The same refusal on `/v1/messages` is Anthropic's error body."""

    async def scenario() -> None:
        async with _rig() as rig:
            stream = ExtProcStream(rig.stub)
            metadata = {"x-api-key": USER, headers.REVISION: CANDIDATE}
            assert (await stream.headers("/v1/messages", metadata)).HasField("request_headers")
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
            answer = await stream.body(json.dumps(body).encode())
            status, error = _error(answer)
            assert status == 403
            assert error["type"] == "error" and error["error"]["type"] == "permission_error"

    asyncio.run(scenario())


@pytest.mark.parametrize("revision", [GONE, "rev-unknown"], ids=["draining", "unknown"])
def test_a_pin_to_a_revision_without_a_ready_replica_is_503(revision: str) -> None:
    """A revision whose replicas all drain, or that no replica runs: 503
    revision_unavailable, not another revision's replica."""

    async def scenario() -> None:
        async with _rig() as rig:
            _, _, answer = await rig.pick(ADMIN, revision)
            status, body = _error(answer)
            assert status == 503
            assert body["error"]["code"] == "revision_unavailable"
            assert revision in body["error"]["message"]

    asyncio.run(scenario())


def test_an_empty_pin_is_no_pin() -> None:
    """An empty header value pins nothing (any key): the shares decide."""

    async def scenario() -> None:
        async with _rig() as rig:
            _, _, answer = await rig.pick(USER, "")
            assert set(_endpoints(answer)) <= {"10.0.0.0:50054", "10.0.0.1:50054"}

    asyncio.run(scenario())
