"""LoRA adapters in the catalogue (issue 29): validation with the field named, the gRPC API,
the routing table's adapter routes on the base's replicas, the replica spec's LoRA fields,
deletion with its drain grace, and the checks deployments get (names, LoRA kept on, delete).

Real parts: the orchestrator over gRPC (SQLite in a tmp dir), the reconciler with node-agents
in memory (the only fake: no engine starts here)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.app import build_components
from inferplane.orchestrator.catalog.model import LoraAdapter
from inferplane.orchestrator.convert import deployment_from_proto, node_from_status
from inferplane.orchestrator.release.agents import ProbeResult
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from inferplane.testing.clock import FakeClock

S = na.Replica.State
ADDRESS = "127.0.0.1:50052"


def make_adapter(root: Path, name: str = "pirate", r: int = 8) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "peft_type": "LORA"}))
    return folder


def lora_proto(fx: Any, **profile: Any) -> pb.Deployment:
    proto = fx.tiny_cpu_proto(aliases=["tiny"])
    proto.profile.max_loras = profile.get("max_loras", 2)
    proto.profile.max_lora_rank = profile.get("max_lora_rank", 16)
    proto.rollout.CopyFrom(pb.RolloutStrategy(max_surge=1, drain_grace_period_seconds=30))
    return proto


class Agents:
    """Node-agents in memory: every started replica is READY at once and warms up."""

    def __init__(self) -> None:
        self.replicas: dict[str, na.Replica] = {}

    async def list_replicas(self, address: str) -> list[na.Replica]:
        return [self.replicas[k] for k in sorted(self.replicas)]

    async def start_replica(self, address: str, replica_id: str, spec: na.ReplicaSpec) -> Any:
        self.replicas[replica_id] = na.Replica(
            name=f"replicas/{replica_id}", spec=spec, state=S.STATE_READY, inference_address=address
        )
        return self.replicas[replica_id]

    async def drain_replica(self, address: str, replica_id: str, grace: int) -> na.Replica:
        self.replicas[replica_id].state = S.STATE_DRAINING
        return self.replicas[replica_id]

    async def stop_replica(self, address: str, replica_id: str, grace: int) -> na.Replica:
        self.replicas[replica_id].state = S.STATE_STOPPED
        return self.replicas[replica_id]

    async def probe(self, *args: Any, **kwargs: Any) -> ProbeResult:
        return ProbeResult(True, 0.05)

    async def close(self) -> None:
        return None


@dataclasses.dataclass
class World:
    components: Any
    agents: Agents
    clock: FakeClock
    root: Path

    @property
    def control(self) -> Any:
        return self.components.control

    def tick(self, times: int = 3) -> None:
        async def ticks() -> None:
            for _ in range(times):
                await self.components.reconciler.reconcile_once()
                for _ in range(5):
                    await asyncio.sleep(0)

        asyncio.run(ticks())

    def routes(self) -> dict[str, pb.ModelRoute]:
        return {r.model: r for r in self.components.hub.table.routes}


@pytest.fixture
def world(tmp_path: Path, fx: Any) -> Iterator[World]:
    root = tmp_path / "lora"
    root.mkdir()
    clock, agents = FakeClock(), Agents()
    settings = fx.make_settings(tmp_path, reconcile=False, lora_root=str(root))
    components = build_components(settings, clock=clock, agents=agents)
    components.store.create_schema()
    components.releases.create_schema()
    components.control.load()
    components.reconciler.load()
    components.control.register_node(node_from_status(fx.cpu_status("cpu-a")))
    components.control.create(deployment_from_proto(lora_proto(fx), "kimi-tiny"))
    yield World(components, agents, clock, root)
    components.store.close()


def adapter(world: World, name: str = "pirate", **kw: Any) -> LoraAdapter:
    values: dict[str, Any] = {
        "adapter_id": name,
        "base_deployment": "deployments/kimi-tiny",
        "source": str(make_adapter(world.root, name)),
        "rank": 8,
    }
    values.update(kw)
    return LoraAdapter(**values)


def refused(call: Any, *args: Any) -> Any:
    with pytest.raises(Exception) as info:
        call(*args)
    return info.value


def test_create_routes_the_adapter_on_the_base_replicas_with_its_name_and_source(
    world: World,
) -> None:
    created = world.control.create_adapter(adapter(world, aliases=("pirate-chat",)))
    assert created.phase == "Ready" and created.model == "kimi-tiny:pirate"
    assert created.source == os.path.realpath(world.root / "pirate")
    world.tick()
    routes = world.routes()
    base = routes["kimi-tiny"]
    assert len(base.endpoints) == 1 and not base.adapter
    for model in ("kimi-tiny:pirate", "pirate-chat"):
        route = routes[model]
        assert (route.deployment, route.adapter) == ("kimi-tiny", "pirate")
        assert route.adapter_source == created.source
        assert list(route.endpoints) == list(base.endpoints)
        assert route.routing_policy == base.routing_policy
    assert "tiny:pirate" not in routes  # a deployment alias does not name adapters
    (replica,) = world.agents.replicas.values()
    spec = replica.spec
    assert (spec.max_loras, spec.max_lora_rank) == (2, 16)
    assert spec.lora_root == os.path.realpath(world.root)


def test_delete_leaves_the_table_at_once_and_the_row_after_the_drain_grace(
    world: World,
) -> None:
    world.control.create_adapter(adapter(world))
    world.tick()
    assert "kimi-tiny:pirate" in world.routes()
    deleting = world.control.delete_adapter("adapters/pirate")
    assert deleting.phase == "Deleting"
    world.tick(1)
    assert "kimi-tiny:pirate" not in world.routes()  # new requests: 404
    assert world.control.get_adapter("pirate").phase == "Deleting"
    # The name stays taken while requests may still use it.
    err = refused(world.control.create_adapter, adapter(world))
    assert isinstance(err, AlreadyExistsError)
    world.clock.advance(29)
    assert world.control.sweep_adapters() == []
    world.clock.advance(1)
    assert world.control.sweep_adapters() == ["pirate"]
    assert isinstance(refused(world.control.get_adapter, "pirate"), NotFoundError)
    world.control.create_adapter(adapter(world))  # the name is free again


@pytest.mark.parametrize(
    ("change", "param", "text"),
    [
        ({"adapter_id": "a:b"}, "adapter_id", "no ':'"),
        ({"base_deployment": "deployments/nope"}, "adapter.base_deployment", "does not exist"),
        ({"rank": 12}, "adapter.rank", "one of vLLM's ranks"),
        ({"rank": 32}, "adapter.rank", "exceeds deployments/kimi-tiny's profile.max_lora_rank"),
        ({"source": "relative/pirate"}, "adapter.source", "absolute"),
        ({"source": "/etc"}, "adapter.source", "outside the adapter root"),
        ({"aliases": ("kimi-tiny:pirate",)}, "adapter.aliases", "equals the model name"),
        ({"aliases": ("bad alias",)}, "adapter.aliases", "must be 1-256"),
    ],
)
def test_bad_fields_are_invalid_argument_naming_the_field(
    world: World, change: dict[str, Any], param: str, text: str
) -> None:
    err = refused(world.control.create_adapter, adapter(world, **change))
    assert isinstance(err, InvalidArgumentError), err
    assert err.param == param and text in err.message, err.message


def test_source_may_not_escape_the_root(world: World, tmp_path: Path) -> None:
    outside = make_adapter(tmp_path / "elsewhere", "evil")
    (world.root / "link").symlink_to(outside)
    for source in (world.root / "link", f"{world.root}/../elsewhere/evil"):
        err = refused(world.control.create_adapter, adapter(world, source=str(source)))
        assert isinstance(err, InvalidArgumentError) and err.param == "adapter.source"
    (world.root / "empty").mkdir()
    err = refused(world.control.create_adapter, adapter(world, source=str(world.root / "empty")))
    assert "adapter_config.json" in err.message


def test_rank_comes_from_the_config_when_unset_and_may_not_be_below_it(world: World) -> None:
    wide = make_adapter(world.root, "wide", r=12)
    created = world.control.create_adapter(LoraAdapter("wide", "kimi-tiny", str(wide), 0))
    assert created.rank == 16  # the smallest allowed rank holding r=12
    wider = make_adapter(world.root, "wider", r=16)
    err = refused(world.control.create_adapter, LoraAdapter("w3", "kimi-tiny", str(wider), 8))
    assert isinstance(err, InvalidArgumentError) and err.param == "adapter.rank"
    assert "r=16" in err.message


def test_names_are_unique_across_deployments_aliases_and_adapters(world: World, fx: Any) -> None:
    world.control.create_adapter(adapter(world, aliases=("pirate-chat",)))
    err = refused(world.control.create_adapter, adapter(world, "other", aliases=("pirate-chat",)))
    assert isinstance(err, AlreadyExistsError) and err.param == "adapter.aliases"
    err = refused(world.control.create_adapter, adapter(world, "other", aliases=("tiny",)))
    assert isinstance(err, AlreadyExistsError) and "deployments/kimi-tiny" in err.message
    # A deployment may not take an adapter's model name as an alias either.
    taken = deployment_from_proto(fx.tiny_cpu_proto(aliases=["pirate-chat"]), "other")
    err = refused(world.control.create, taken)
    assert isinstance(err, AlreadyExistsError) and err.param == "deployment.aliases"


def test_base_must_allow_lora_and_keep_it_while_adapters_exist(world: World, fx: Any) -> None:
    world.control.create(deployment_from_proto(fx.tiny_cpu_proto(), "plain"))
    err = refused(world.control.create_adapter, adapter(world, base_deployment="plain"))
    assert isinstance(err, InvalidArgumentError) and "max_loras is 0" in err.message
    world.control.create_adapter(adapter(world))
    current = world.control.resolve("kimi-tiny")
    off = dataclasses.replace(current.profile, max_loras=0, max_lora_rank=0)
    err = refused(world.control.update, dataclasses.replace(current, profile=off), ["profile"])
    assert isinstance(err, FailedPreconditionError) and err.param.endswith("max_loras")
    err = refused(world.control.delete, "kimi-tiny")
    assert isinstance(err, FailedPreconditionError) and "pirate" in err.message
    world.control.delete_adapter("pirate")
    world.control.delete("kimi-tiny")  # a deleting adapter goes with its base
    assert world.control.sweep_adapters() == ["pirate"]


def test_profile_lora_fields_are_validated_and_change_the_revision(fx: Any) -> None:
    plain = deployment_from_proto(fx.tiny_cpu_proto(), "x").normalised()
    lora = deployment_from_proto(lora_proto(fx, max_lora_rank=0), "x").normalised()
    assert lora.profile.max_lora_rank == 16  # vLLM's default when unset
    assert lora.revision != plain.revision
    from inferplane.orchestrator.catalog.validation import validate_deployment

    for fields, param in (
        ({"max_loras": 9}, "deployment.profile.max_loras"),
        ({"max_lora_rank": 24}, "deployment.profile.max_lora_rank"),
        ({"max_loras": 0, "max_lora_rank": 16}, "deployment.profile.max_lora_rank"),
    ):
        bad = deployment_from_proto(lora_proto(fx, **fields), "x").normalised()
        with pytest.raises(InvalidArgumentError) as info:
            validate_deployment(bad)
        assert info.value.param == param
    # vLLM's --grpc server has no runtime adapter loading: the node-agent would refuse the spec.
    grpc = lora_proto(fx)
    grpc.profile.transport = "grpc"
    with pytest.raises(InvalidArgumentError) as info:
        validate_deployment(deployment_from_proto(grpc, "x").normalised())
    assert info.value.param == "deployment.profile.transport" and "LoRA" in info.value.message


def test_the_grpc_api_creates_gets_lists_and_deletes(tmp_path: Path, fx: Any) -> None:
    root = tmp_path / "lora"
    source = make_adapter(root, "pirate")
    settings = fx.make_settings(tmp_path, lora_root=str(root), reconcile=False)
    with fx.running(settings, FakeClock()) as orch:
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("cpu-a")), timeout=10)
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="kimi-tiny", deployment=lora_proto(fx)),
            timeout=10,
        )
        got = orch.deployments.GetDeployment(
            pb.GetDeploymentRequest(name="deployments/kimi-tiny"), timeout=10
        ).deployment
        assert (got.profile.max_loras, got.profile.max_lora_rank) == (2, 16)
        created = orch.deployments.CreateAdapter(
            pb.CreateAdapterRequest(
                adapter_id="pirate",
                adapter=pb.LoraAdapter(
                    base_deployment="deployments/tiny", source=str(source), aliases=["arr"]
                ),
            ),
            timeout=10,
        ).adapter
        assert created.name == "adapters/pirate" and created.phase == "Ready"
        assert created.base_deployment == "deployments/kimi-tiny" and created.rank == 8
        assert created.create_time.seconds > 0
        got_adapter = orch.deployments.GetAdapter(
            pb.GetAdapterRequest(name="adapters/pirate"), timeout=10
        ).adapter
        assert got_adapter == created
        listed = orch.deployments.ListAdapters(
            pb.ListAdaptersRequest(base_deployment="deployments/kimi-tiny"), timeout=10
        ).adapters
        assert [a.name for a in listed] == ["adapters/pirate"]
        with pytest.raises(grpc.RpcError) as info:
            orch.deployments.CreateAdapter(
                pb.CreateAdapterRequest(
                    adapter_id="x",
                    adapter=pb.LoraAdapter(base_deployment="deployments/kimi-tiny", source="/x"),
                ),
                timeout=10,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
        assert trailers["x-openai-error-param"] == "adapter.source"
        left = orch.deployments.DeleteAdapter(
            pb.DeleteAdapterRequest(name="adapters/pirate"), timeout=10
        ).adapter
        assert left.phase == "Deleting"
        with pytest.raises(grpc.RpcError) as info:
            orch.deployments.GetAdapter(pb.GetAdapterRequest(name="pirate"), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_adapters_survive_a_restart(tmp_path: Path, fx: Any) -> None:
    root = tmp_path / "lora"
    make_adapter(root, "pirate")
    settings = fx.make_settings(tmp_path, lora_root=str(root), reconcile=False)
    first = build_components(settings, clock=FakeClock())
    first.store.create_schema()
    first.control.load()
    first.control.create(deployment_from_proto(lora_proto(fx), "kimi-tiny"))
    made = first.control.create_adapter(
        LoraAdapter("pirate", "kimi-tiny", str(root / "pirate"), 8, aliases=("arr",))
    )
    first.store.close()
    second = build_components(settings, clock=FakeClock())
    second.control.load()
    assert second.control.adapters() == (made,)
    second.store.close()


def test_the_store_keeps_every_field(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta, timezone

    from inferplane.orchestrator.store.base import StateChange
    from inferplane.orchestrator.store.sql import SqlStateStore

    t0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=5)))
    made = LoraAdapter(
        adapter_id="A" * 128,
        base_deployment="b" * 128,
        source="/lora/" + "s" * 4000,
        rank=512,
        aliases=("zz/last", "org/x:v2"),
        phase="Deleting",
        create_time=t0,
        delete_time=t0 + timedelta(seconds=1),
    )
    for field in dataclasses.fields(LoraAdapter):
        assert getattr(made, field.name) != field.default, field.name
    store = SqlStateStore(f"sqlite:///{tmp_path / 'o.db'}")
    store.create_schema()
    store.commit(StateChange(put_adapters=(made,)))
    (loaded,) = store.load().adapters
    assert loaded == made and loaded.create_time.tzinfo == UTC  # type: ignore[union-attr]
    store.commit(StateChange(delete_adapters=(made.adapter_id,)))
    assert store.load().adapters == ()
    store.close()


def test_the_cli_creates_lists_gets_and_deletes(tmp_path: Path, fx: Any) -> None:
    from typer.testing import CliRunner

    from inferplane.orchestrator.cli import app

    root = tmp_path / "lora"
    source = make_adapter(root, "pirate")
    settings = fx.make_settings(tmp_path, lora_root=str(root), reconcile=False)
    runner = CliRunner(env={"INFERPLANE_PLAINTEXT": "1"})
    with fx.running(settings, FakeClock()) as orch:
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("cpu-a")), timeout=10)
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="kimi-tiny", deployment=lora_proto(fx)),
            timeout=10,
        )
        address = ["--address", orch.address]
        create = ["adapters", "create", "pirate", "--base", "tiny", "--source", str(source)]
        made = runner.invoke(app, [*create, "--alias", "arr", *address])
        assert made.exit_code == 0, made.output
        assert "adapters/pirate: model kimi-tiny:pirate (aliases arr), rank 8, Ready" in made.output
        listed = runner.invoke(app, ["adapters", "list", "--base", "kimi-tiny", *address])
        assert listed.exit_code == 0 and "kimi-tiny:pirate" in listed.output, listed.output
        got = runner.invoke(app, ["adapters", "get", "pirate", *address])
        assert got.exit_code == 0 and "source " + os.path.realpath(source) in got.output
        bad = runner.invoke(
            app, ["adapters", "create", "x", "--base", "kimi-tiny", "--source", "/etc", *address]
        )
        assert bad.exit_code == 1 and "INVALID_ARGUMENT" in bad.output
        gone = runner.invoke(app, ["adapters", "delete", "pirate", *address])
        assert gone.exit_code == 0 and "adapters/pirate Deleting" in gone.output


def test_a_deleting_adapter_goes_once_the_routers_report_its_base_idle(world: World) -> None:
    world.control.create_adapter(adapter(world))
    world.control.delete_adapter("pirate")
    asked: list[tuple[str, float]] = []

    def quiet(deployment_id: str, within: float) -> bool:
        asked.append((deployment_id, within))
        return busy is False

    busy = True
    world.clock.advance(1)  # the routers may not have the table yet: not asked
    assert world.control.sweep_adapters(quiet, propagation_seconds=1.0) == []
    assert asked == []
    world.clock.advance(4)  # a base busy with other requests keeps it
    assert world.control.sweep_adapters(quiet, propagation_seconds=1.0) == []
    assert asked == [("kimi-tiny", 4.0)]  # reports made after the routers saw the table
    busy = False
    assert world.control.sweep_adapters(quiet, propagation_seconds=1.0) == ["pirate"]


def test_quiet_needs_every_fresh_router_to_have_reported_idle_since_then() -> None:
    from inferplane.orchestrator.autoscale.demand import DemandBook, RouterDemand

    clock = FakeClock()
    book = DemandBook(clock=clock, stale_after_seconds=10)
    assert not book.quiet_since("d", 0.0)  # no router reported: unknown
    book.record("r1", [("d", RouterDemand())])
    clock.advance(3)
    book.record("r2", [("d", RouterDemand(in_flight_requests=1))])
    since = clock.monotonic()
    assert not book.quiet_since("d", since - 3)  # r2 has a request in flight
    book.record("r2", [("d", RouterDemand())])
    assert not book.quiet_since("d", since)  # r1's last report is older than `since`
    assert book.quiet_since("d", since - 3)
    clock.advance(11)  # both silent past the stale limit: unknown again
    assert not book.quiet_since("d", since)
