"""LoRA adapters in the router (issue 29): the routing table's adapter fields, key allow-lists
naming adapters, the picker's adapter headers, the prefix table keyed per adapter, adapter
affinity among the replicas the policy would accept, and the adapter in usage and metrics.

Real parts: the picker over loopback gRPC (ext_proc as Envoy drives it), admission and the
policies; the replicas' engine states are written as the replica state watch would."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.router.adapter_affinity import AdapterAffinity
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.policies import default_registry
from inferplane.router.reporting import Reporter
from inferplane.router.routes import ModelRoute, RouteTable, resolve
from inferplane.router.sources import table_from_proto
from inferplane.runtime import ErrorInterceptor, NotFoundError, PermissionDeniedError
from inferplane.testing.clock import FakeClock
from inferplane.wire import headers

from .fakes import ExtProcStream, FakeScheduler, RecordingUsage, client_body, endpoints

pytestmark = pytest.mark.timeout(30)

CHAT = "/v1/chat/completions"
SOURCE = "/models/lora/pirate"


def table(n: int = 3, policy: str = "least_load") -> RouteTable:
    base = ModelRoute("kimi-tiny", endpoints(n), deployment="kimi-tiny", routing_policy=policy)
    adapter = dataclasses.replace(
        base, model="kimi-tiny:pirate", adapter="pirate", adapter_source=SOURCE
    )
    other = dataclasses.replace(
        base, model="kimi-tiny:poet", adapter="poet", adapter_source="/models/lora/poet"
    )
    return RouteTable.of(
        [
            base,
            dataclasses.replace(base, model="tiny"),
            adapter,
            dataclasses.replace(adapter, model="arr"),
            other,
        ]
    )


def allowed(*names: str) -> dict[str, str]:
    return {headers.ALLOWED_MODELS: ",".join(names)}


@pytest.mark.parametrize(
    ("grant", "model", "ok"),
    [
        (("kimi-tiny",), "kimi-tiny", True),
        (("kimi-tiny",), "kimi-tiny:pirate", False),  # the base does not grant its adapters
        (("kimi-tiny",), "arr", False),
        (("kimi-tiny:pirate",), "kimi-tiny", False),  # an adapter does not grant its base
        (("kimi-tiny:pirate",), "kimi-tiny:pirate", True),
        (("kimi-tiny:pirate",), "arr", True),  # any name of the adapter grants all of them
        (("arr",), "kimi-tiny:pirate", True),
        (("arr",), "kimi-tiny:poet", False),  # nor another adapter of the same base
        (("tiny",), "kimi-tiny", True),  # a deployment alias grants the deployment
        (("tiny",), "kimi-tiny:pirate", False),
        ((), "kimi-tiny:pirate", True),  # no list: every model
    ],
)
def test_allow_lists_name_adapters_explicitly(grant: tuple[str, ...], model: str, ok: bool) -> None:
    routes = table()
    if ok:
        assert resolve(routes, model, allowed(*grant)).model == model
        return
    with pytest.raises(PermissionDeniedError) as info:
        resolve(routes, model, allowed(*grant))
    assert info.value.code == "model_not_allowed"


def test_a_refused_key_learns_nothing_and_a_deleted_adapter_is_404() -> None:
    routes = table()
    with pytest.raises(PermissionDeniedError):  # not a 404: existence stays hidden
        resolve(routes, "kimi-tiny:gone", allowed("kimi-tiny"))
    with pytest.raises(NotFoundError):
        resolve(routes, "kimi-tiny:gone", {})


def test_the_orchestrator_table_carries_adapter_name_and_source() -> None:
    message = opb.WatchRoutingTableResponse(
        version="v1",
        routes=[
            opb.ModelRoute(model="kimi-tiny", deployment="kimi-tiny"),
            opb.ModelRoute(
                model="kimi-tiny:pirate",
                deployment="kimi-tiny",
                adapter="pirate",
                adapter_source=SOURCE,
            ),
        ],
    )
    parsed = table_from_proto(message)
    route = parsed.get("kimi-tiny:pirate")
    assert route is not None
    assert (route.deployment_key, route.adapter, route.adapter_source) == (
        "kimi-tiny",
        "pirate",
        SOURCE,
    )
    base = parsed.get("kimi-tiny")
    assert base is not None and base.adapter == "" and base.adapter_source == ""


def chat(text: str, model: str = "kimi-tiny") -> pb.ChatCompletionRequest:
    message = pb.ChatMessage(role="user", name=text)  # any field: bytes the hash covers
    return pb.ChatCompletionRequest(model=model, messages=[message])


def test_prefix_hashes_are_keyed_per_adapter_and_the_base_is_unchanged() -> None:
    extract = FeatureExtractor(block_bytes=64)
    request = chat("the same long prompt " * 40)
    base = extract.chat(request, {})
    pirate = extract.chat(request, {}, "pirate")
    poet = extract.chat(request, {}, "poet")
    assert base == extract.chat(request, {}, "")  # "" is the base: the hashes of before
    assert len(base.prefix_blocks) == len(pirate.prefix_blocks) > 3
    for a, b in ((base, pirate), (pirate, poet), (base, poet)):
        assert not set(a.prefix_blocks) & set(b.prefix_blocks)
        assert a.root != b.root
    assert pirate.adapter == "pirate" and base.adapter == ""
    completion = pb.CompletionRequest(model="m")
    completion.prompt.string_value = "x" * 640
    assert not set(extract.completion(completion, {}, "pirate").prefix_blocks) & set(
        extract.completion(completion, {}).prefix_blocks
    )


@dataclasses.dataclass
class Affinity:
    admission: Admission
    engines: EngineStates
    affinity: AdapterAffinity
    clock: FakeClock
    routes: RouteTable

    def loaded(self, replica: str, *adapters: str) -> None:
        self.engines.put(EngineState(replica, loaded_adapters=frozenset(adapters)))

    async def pick(self, model: str) -> str:
        route = self.routes.get(model)
        assert route is not None
        features = RequestFeatures(adapter=route.adapter)
        slot = await self.admission.acquire(route, features)
        return slot.endpoint.replica_id


@pytest.fixture
def affinity() -> Iterator[Affinity]:
    clock = FakeClock()
    engines = EngineStates(clock.monotonic)
    chooser = AdapterAffinity(engines, load_factor=1.25)
    admission = Admission(
        default_registry(), AdmissionSettings(), clock, FakeScheduler(clock), affinity=chooser
    )
    routes = table(4)
    admission.apply(routes)
    yield Affinity(admission, engines, chooser, clock, routes)


def test_affinity_prefers_a_replica_holding_the_adapter(affinity: Affinity) -> None:
    async def scenario() -> None:
        # Least load would pick r0 (all idle); r2 holds the adapter: it takes the request.
        for r in ("r0", "r1", "r3"):
            affinity.loaded(r)
        affinity.loaded("r2", "pirate")
        assert await affinity.pick("kimi-tiny:pirate") == "r2"
        assert await affinity.pick("arr") == "r0"  # r2 is at the bounded-load cap now
        assert affinity.affinity.redirected == 1
        assert await affinity.pick("kimi-tiny") in {"r1", "r3"}  # the base: no preference

    asyncio.run(scenario())


def test_affinity_without_a_known_state_or_holder_keeps_the_policys_choice(
    affinity: Affinity,
) -> None:
    async def scenario() -> None:
        affinity.loaded("r2", "pirate")
        # r0's state is unknown: no preference (the policy's choice loads it on a miss).
        assert await affinity.pick("kimi-tiny:pirate") == "r0"
        affinity.loaded("r1")
        affinity.clock.advance(10)  # r2's state goes stale: not a holder any more
        affinity.loaded("r1")
        assert await affinity.pick("kimi-tiny:poet") == "r1"
        assert await affinity.pick("kimi-tiny:pirate") in {"r2", "r3"}
        assert affinity.affinity.redirected == 0

    asyncio.run(scenario())


def test_holders_follow_each_replicas_latest_state() -> None:
    clock = FakeClock()
    engines = EngineStates(clock.monotonic)
    engines.put(EngineState("r0", loaded_adapters=frozenset({"a", "b"})))
    engines.put(EngineState("r1", loaded_adapters=frozenset({"b"})))
    assert engines.holders("b") == {"r0", "r1"}
    engines.put(EngineState("r0", loaded_adapters=frozenset({"a"})))
    assert engines.holders("b") == {"r1"} and engines.holders("a") == {"r0"}
    engines.drop("r1")
    assert engines.holders("b") == frozenset()


@contextlib.asynccontextmanager
async def picker(routes: RouteTable) -> AsyncIterator[tuple[ExtProcStream, RecordingUsage, Any]]:
    clock = FakeClock()
    admission = Admission(default_registry(), AdmissionSettings(), clock, FakeScheduler(clock))
    admission.apply(routes)
    usage = RecordingUsage()
    metrics = RouterMetrics(CollectorRegistry())
    servicer = EndpointPicker(
        lambda: routes,
        admission,
        Reporter(usage, None, clock, wall_clock=lambda: 1.7e9),
        settings=PickerSettings(keepalive_seconds=0.01),
        metrics=metrics,
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    ext_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield ExtProcStream(ext_grpc.ExternalProcessorStub(channel)), usage, metrics
    finally:
        await server.stop(0)


def _mutation(answer: ext_pb.ProcessingResponse) -> tuple[dict[str, str], list[str]]:
    mutation = answer.request_body.response.header_mutation
    values = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return values, list(mutation.remove_headers)


KEYED = {"x-inferplane-key-id": "k1", "x-request-id": "req-1", "x-inferplane-tenant": "t1"}


@pytest.mark.parametrize(("model", "adapter"), [("arr", "pirate"), ("kimi-tiny", "")])
def test_the_pick_names_the_adapter_to_the_replica_and_usage_and_metrics_carry_it(
    model: str, adapter: str
) -> None:
    async def scenario() -> None:
        async with picker(table()) as (stream, usage, metrics):
            await stream.headers(CHAT, KEYED)
            request = pb.ChatCompletionRequest(model=model, messages=[pb.ChatMessage(role="user")])
            answer = await stream.body(
                client_body(pb.StreamChatCompletionEventsRequest(request=request))
            )
            values, removed = _mutation(answer)
            if adapter:
                assert values[headers.ADAPTER] == adapter
                assert values[headers.ADAPTER_SOURCE] == SOURCE
                assert headers.ADAPTER not in removed
            else:  # a client's copy (through a gateway that kept it) never passes
                assert headers.ADAPTER not in values
                assert {headers.ADAPTER, headers.ADAPTER_SOURCE} <= set(removed)
            await stream.response_headers({":status": "200", "content-type": "application/grpc"})
            await stream.response_trailers({"grpc-status": "0"})
            await stream.close()
            for _ in range(200):
                if usage.reports:
                    break
                await asyncio.sleep(0.005)
            (report,) = usage.reports
            assert report.adapter == adapter and report.usage().adapter == adapter
            assert report.deployment == "kimi-tiny"
            counted = metrics.adapter_requests.labels("kimi-tiny", adapter, "completed")
            assert counted._value.get() == 1

    asyncio.run(scenario())


def test_models_lists_each_adapter_name_with_its_base_owner() -> None:
    from inferplane.router.servicer import ModelsService

    routes = table()
    owned = RouteTable.of(
        [dataclasses.replace(r, owned_by="acme", created=7) for r in routes.routes.values()]
    )
    listed = asyncio.run(ModelsService(lambda: owned).ListModels(pb.ListModelsRequest(), None))
    models = {m.id: m for m in listed.data}
    assert {"kimi-tiny:pirate", "arr", "kimi-tiny:poet"} <= set(models)
    assert models["arr"].owned_by == models["kimi-tiny"].owned_by == "acme"
