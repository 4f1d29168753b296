"""The autoscaling rule (`autoscale.policy.Policy`) on a fake clock: scale up at once, down
only after a whole stable window, no flapping under a load that swings faster than the window,
to zero after the idle period and back on cold demand, bounds respected; and the loop
(`autoscale.loop.Autoscaler`) over a real catalogue: free capacity bounds a scale-up (the
decision says why), opt-out deployments are never touched, the decision is stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferplane.orchestrator.app import build_components
from inferplane.orchestrator.autoscale.demand import DemandAggregate
from inferplane.orchestrator.autoscale.loop import Autoscaler, AutoscalerMetrics
from inferplane.orchestrator.autoscale.model import (
    HOLD,
    SCALE_DOWN,
    SCALE_FROM_ZERO,
    SCALE_TO_ZERO,
    SCALE_UP,
    Signals,
)
from inferplane.orchestrator.autoscale.policy import Policy
from inferplane.orchestrator.catalog.model import Autoscaling, Deployment, DeploymentProfile
from inferplane.orchestrator.convert import deployment_from_proto, node_from_status
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError
from inferplane.testing.clock import FakeClock

PROFILE = DeploymentProfile(
    model_source="m", parameter_count=1, num_layers=1, num_kv_heads=1, head_dim=1,
    max_model_len=1024, max_num_seqs=10,
)  # fmt: skip
WINDOW = 60


def deployment(replicas: int = 1, **autoscaling: Any) -> Deployment:
    settings = {"enabled": True, "scale_down_window_seconds": WINDOW, **autoscaling}
    return Deployment(
        "d",
        PROFILE,
        replicas=replicas,
        min_replicas=1,
        max_replicas=6,
        autoscaling=Autoscaling(**settings),
    )


class Sim:
    """The policy applied to a deployment on a fake clock: each `step` decides and applies."""

    def __init__(self, d: Deployment, grace: float = 2.0) -> None:
        self.d = d
        self.policy = Policy(grace_seconds=grace)
        self.now = 1000.0
        self.changes: list[tuple[float, str, int, int]] = []

    def step(self, seconds: float = 1.0, **signals: Any) -> str:
        self.now += seconds
        s = Signals(ready_replicas=self.d.replicas, **signals)
        rec = self.policy.decide(self.d, s, self.now)
        if rec.replicas != self.d.replicas:
            self.changes.append((self.now, rec.decision, self.d.replicas, rec.replicas))
            self.d = dataclasses.replace(self.d, replicas=rec.replicas)
        return rec.decision


def test_scale_up_is_immediate_and_proportional() -> None:
    sim = Sim(deployment())
    # target 8 in flight per replica (0.8 x max_num_seqs 10): 30 in flight -> 4 replicas.
    assert sim.step(in_flight_requests=30) == SCALE_UP
    assert sim.d.replicas == 4
    # One second later, more load: up again at once (no cooldown).
    assert sim.step(in_flight_requests=44) == SCALE_UP
    assert sim.d.replicas == 6  # ceil(44 / 8) = 6 = max_replicas
    assert sim.step(in_flight_requests=400) == HOLD  # bounded by max_replicas
    assert sim.d.replicas == 6


def test_pressure_adds_one_replica_once_the_last_ones_are_ready() -> None:
    sim = Sim(deployment(replicas=2))
    # A queue younger than the grace is not pressure yet.
    assert sim.step(queued_requests=3, max_queue_wait_seconds=1.0) == HOLD
    assert sim.step(queued_requests=3, max_queue_wait_seconds=2.5) == SCALE_UP
    assert sim.d.replicas == 3
    # The new replica is still starting (2 of 3 ready): no further step.
    rec = sim.policy.decide(sim.d, Signals(queued_requests=3, max_queue_wait_seconds=4,
                                           ready_replicas=2), sim.now + 1)  # fmt: skip
    assert rec.replicas == 3 and rec.decision == HOLD
    # Each pressure signal asks for one more once every replica is ready.
    for signals in (
        {"queue_rejections_per_second": 0.5},
        {"kv_usage": 0.95},
    ):
        before = sim.d.replicas
        assert sim.step(**signals) == SCALE_UP, signals
        assert sim.d.replicas == before + 1


def test_engine_waiting_and_ttft_over_the_slo_scale_up() -> None:
    sim = Sim(deployment(replicas=1))
    assert sim.step(engine_waiting_requests=2) == HOLD  # within the grace
    assert sim.step(seconds=3, engine_waiting_requests=2) == SCALE_UP
    slo = dataclasses.replace(PROFILE, ttft_slo_seconds=0.5)
    sim2 = Sim(dataclasses.replace(deployment(replicas=1), profile=slo))
    assert sim2.step(ttft_p99_seconds=0.4) == HOLD
    assert sim2.step(ttft_p99_seconds=0.9) == SCALE_UP
    no_slo = Sim(deployment(replicas=1))
    assert no_slo.step(ttft_p99_seconds=9.0) == HOLD  # 0 = no TTFT signal


def test_scale_down_waits_for_a_whole_stable_window_then_goes_to_the_window_max() -> None:
    sim = Sim(deployment())
    sim.step(in_flight_requests=40)  # 5 replicas
    assert sim.d.replicas == 5
    # Load drops: 20 then 10 in flight (3, then 2 replicas' worth) for less than the window.
    for _ in range(30):
        assert sim.step(in_flight_requests=20) == HOLD
    for _ in range(30):  # the first tick below starts the window: 60 s after it, down
        assert sim.step(in_flight_requests=10) == HOLD
    assert sim.d.replicas == 5
    assert sim.step(in_flight_requests=10) == SCALE_DOWN
    assert sim.d.replicas == 3  # the most any tick of the window asked for
    # The next step down needs another whole window.
    for _ in range(WINDOW):
        assert sim.step(in_flight_requests=10) == HOLD
    assert sim.step(in_flight_requests=10) == SCALE_DOWN
    assert sim.d.replicas == 2
    # Never below the floor max(min_replicas, 1).
    for _ in range(3 * WINDOW):
        sim.step()
    assert sim.d.replicas == 1


def test_no_flapping_under_load_oscillating_faster_than_the_window() -> None:
    """Load swings between 2.5 and 0.5 replicas' worth with a 40 s period (< the 60 s window)
    for 20 minutes: replicas go up once and stay; not one down/up."""
    sim = Sim(deployment())
    for second in range(1200):
        high = (second % 40) < 20
        sim.step(in_flight_requests=20 if high else 4)
    assert [c[1] for c in sim.changes] == [SCALE_UP]
    assert sim.d.replicas == 3
    # Once the load stays low for a whole window, one step down to what it needs.
    for _ in range(WINDOW + 1):
        sim.step(in_flight_requests=4)
    assert [c[1] for c in sim.changes] == [SCALE_UP, SCALE_DOWN]
    assert sim.d.replicas == 1


def test_scale_to_zero_after_idle_and_back_on_cold_demand() -> None:
    sim = Sim(deployment(replicas=2, scale_to_zero=True, idle_seconds_before_zero=300))
    # Busy at 2: holds.
    assert sim.step(in_flight_requests=12, idle_seconds=0) == HOLD
    # Idle: one window later down to the floor (1), never to 0 before the idle period.
    for t in range(1, 299):
        sim.step(idle_seconds=t)
    assert sim.d.replicas == 1
    assert sim.step(idle_seconds=300) == SCALE_TO_ZERO
    assert sim.d.replicas == 0
    # At zero with no request: stays at zero (the floor of 1 does not apply).
    for t in range(301, 400):
        assert sim.step(idle_seconds=t) == HOLD
    assert sim.d.replicas == 0
    # A request held for the cold start: one replica at once.
    assert sim.step(cold_waiting_requests=1, idle_seconds=0) == SCALE_FROM_ZERO
    assert sim.d.replicas == 1
    assert [c[1] for c in sim.changes] == [SCALE_DOWN, SCALE_TO_ZERO, SCALE_FROM_ZERO]


def test_without_scale_to_zero_idle_stays_at_the_floor() -> None:
    sim = Sim(deployment(replicas=1))  # scale_to_zero off
    for t in range(1, 2000):
        sim.step(idle_seconds=t)
    assert sim.d.replicas == 1 and sim.changes == []
    assert dataclasses.replace(sim.d, min_replicas=0).replica_floor == 1


def test_a_request_in_flight_blocks_scale_to_zero() -> None:
    sim = Sim(deployment(replicas=1, scale_to_zero=True, idle_seconds_before_zero=10))
    # idle_seconds counts from the last request seen; something still in flight holds it.
    assert sim.step(idle_seconds=50, in_flight_requests=1) == HOLD
    assert sim.d.replicas == 1


# ---- the loop over a real catalogue ---------------------------------------------------


@pytest.fixture
def world(tmp_path: Path, fx: Any) -> Any:
    clock = FakeClock()
    components = build_components(fx.make_settings(tmp_path, reconcile=False), clock=clock)
    components.store.create_schema()
    control = components.control
    control.load()
    return components, control, clock, fx


def make_autoscaler(control: Any, clock: FakeClock, demand: dict[str, DemandAggregate]) -> Any:
    registry = CollectorRegistry()
    scaler = Autoscaler(
        control,
        lambda d: demand.get(d, DemandAggregate()),
        lambda d: next(x.replicas for x in control.deployments() if x.deployment_id == d),
        clock=clock,
        metrics=AutoscalerMetrics(registry),
    )
    return scaler, registry


def test_loop_bounds_scale_up_by_free_capacity_and_leaves_opt_out_deployments(world: Any) -> None:
    _, control, clock, fx = world
    # One 8-GPU node: a Llama-8B replica takes one GPU (26 GB of 80): 8 fit.
    control.register_node(node_from_status(fx.gpu_status("g1", gpus=2)), [])
    auto = fx.llama8b_proto(min_replicas=1, max_replicas=6)
    auto.autoscaling.enabled = True
    control.create(deployment_from_proto(auto, "auto"))
    fixed = fx.llama8b_proto(replicas=1)
    control.create(deployment_from_proto(fixed, "fixed"))
    demand = {
        "auto": DemandAggregate(in_flight_requests=40),  # 40 / 6.4 -> 7 replicas asked
        "fixed": DemandAggregate(in_flight_requests=400),
    }
    scaler, registry = make_autoscaler(control, clock, demand)
    asyncio.run(scaler.tick())
    by_id = {d.deployment_id: d for d in control.deployments()}
    # 2 GPUs, "fixed" holds one: "auto" can have 1 more (2), not the 6 it asked for.
    assert by_id["auto"].replicas < 6
    assert by_id["fixed"].replicas == 1  # opt-out: never touched
    placed, unplaced = control.placements().of("auto")
    assert len(placed) == by_id["auto"].replicas and not unplaced
    decisions = control.autoscaler_decisions("deployments/auto", 10)
    assert [d.decision for d in decisions] == [SCALE_UP]
    assert "cannot be placed" in decisions[0].reason
    assert control.autoscaler_decisions("deployments/fixed", 10) == ()
    view = control.get("auto")
    status = scaler.status(view.deployment, view.status).autoscaler
    assert status is not None and status.desired_replicas == 6
    assert (
        registry.get_sample_value(
            "inferplane_autoscaler_decisions_total", {"deployment": "auto", "decision": SCALE_UP}
        )
        == 1.0
    )
    assert (
        registry.get_sample_value("inferplane_autoscaler_desired_replicas", {"deployment": "auto"})
        == 6.0
    )
    assert scaler.status(by_id["fixed"], view.status).autoscaler is None


def test_catalogue_owns_replicas_only_through_the_autoscaler(world: Any) -> None:
    _, control, _, fx = world
    control.register_node(node_from_status(fx.gpu_status("g1")), [])
    auto = fx.llama8b_proto(min_replicas=1, max_replicas=3)
    auto.autoscaling.enabled = True
    auto.autoscaling.scale_to_zero = True
    control.create(deployment_from_proto(auto, "auto"))
    incoming = deployment_from_proto(fx.llama8b_proto(replicas=2), "auto")
    with pytest.raises(FailedPreconditionError, match="set by the autoscaler") as raised:
        control.update(incoming, ["replicas"])
    assert raised.value.param == "deployment.replicas"
    # The autoscaler's write of 0 (scale to zero) survives an operator's update of bounds.
    assert control.autoscale("auto", 0, SCALE_TO_ZERO, "idle", Signals()) == (0, "")
    wider = deployment_from_proto(fx.llama8b_proto(max_replicas=4), "auto")
    assert control.update(wider, ["max_replicas"]).deployment.replicas == 0
    # Enabling autoscaling by update mask moves replicas into the new bounds at once.
    control.create(deployment_from_proto(fx.llama8b_proto(replicas=4), "fixed"))
    enable = fx.llama8b_proto(max_replicas=2)
    enable.autoscaling.enabled = True
    turned = control.update(
        deployment_from_proto(enable, "fixed"), ["autoscaling.enabled", "max_replicas"]
    )
    assert turned.deployment.autoscaled and turned.deployment.replicas == 2
    # Disabling it gives replicas back to the operator.
    off_again = fx.llama8b_proto(replicas=3, max_replicas=3)
    back = control.update(
        deployment_from_proto(off_again, "fixed"), ["autoscaling", "replicas", "max_replicas"]
    )
    assert not back.deployment.autoscaled and back.deployment.replicas == 3
    # Bad bounds and settings name the field.
    bad = fx.llama8b_proto(min_replicas=3, max_replicas=2)
    bad.autoscaling.enabled = True
    with pytest.raises(InvalidArgumentError) as invalid:
        control.create(deployment_from_proto(bad, "bad"))
    assert invalid.value.param == "deployment.min_replicas"
    zero_max = fx.llama8b_proto()
    zero_max.autoscaling.enabled = True
    with pytest.raises(InvalidArgumentError) as invalid:
        control.create(deployment_from_proto(zero_max, "bad"))
    assert invalid.value.param == "deployment.max_replicas"
    kv = fx.llama8b_proto(max_replicas=2)
    kv.autoscaling.enabled = True
    kv.autoscaling.max_kv_usage = 1.5
    with pytest.raises(InvalidArgumentError) as invalid:
        control.create(deployment_from_proto(kv, "bad"))
    assert invalid.value.param == "deployment.autoscaling.max_kv_usage"
    off = fx.llama8b_proto()
    off.autoscaling.scale_to_zero = True
    with pytest.raises(InvalidArgumentError) as invalid:
        control.create(deployment_from_proto(off, "bad"))
    assert invalid.value.param == "deployment.autoscaling.scale_to_zero"


def test_autoscaling_and_the_ttft_slo_travel_through_the_proto(fx: Any) -> None:
    from inferplane.orchestrator.catalog.service import DeploymentStatus, DeploymentView
    from inferplane.orchestrator.convert import deployment_to_proto

    message = fx.llama8b_proto(min_replicas=1, max_replicas=4, profile={"ttft_slo_seconds": 0.5})
    message.autoscaling.enabled = True
    message.autoscaling.scale_to_zero = True
    message.autoscaling.scale_down_window_seconds = 90
    message.autoscaling.target_in_flight_per_replica = 3.5
    d = deployment_from_proto(message, "x").normalised()
    assert d.autoscaling == Autoscaling(True, True, 90, 0, 0, 3.5, 0.0)
    assert d.profile.ttft_slo_seconds == 0.5
    view = DeploymentView(d, (), (), DeploymentStatus("Available", "", 1, d.revision))
    back = deployment_to_proto(view)
    assert back.autoscaling == message.autoscaling
    assert back.profile.ttft_slo_seconds == 0.5
    assert not back.status.HasField("autoscaler")
    plain = deployment_to_proto(
        DeploymentView(dataclasses.replace(d, autoscaling=Autoscaling()), (), (), view.status)
    )
    assert not plain.HasField("autoscaling")  # never set: no message


class FakeLatency:
    """A `LatencyReader` returning a set TTFT p99; counts its reads."""

    def __init__(self, ttft: float | None) -> None:
        self.ttft = ttft
        self.reads: list[tuple[str, float]] = []

    async def read(self, deployment_id: str, window_seconds: float) -> Any:
        from inferplane.orchestrator.release.gate import GateReading

        self.reads.append((deployment_id, window_seconds))
        return None if self.ttft is None else GateReading(10, 0, self.ttft)


def test_loop_reads_ttft_for_slo_profiles_at_most_every_interval(world: Any) -> None:
    from inferplane.orchestrator.autoscale.loop import AutoscaleSettings

    _, control, clock, fx = world
    control.register_node(node_from_status(fx.gpu_status("g1")), [])
    slo = fx.llama8b_proto(min_replicas=1, max_replicas=3, profile={"ttft_slo_seconds": 0.5})
    slo.autoscaling.enabled = True
    control.create(deployment_from_proto(slo, "slo"))
    plain = fx.llama8b_proto(min_replicas=1, max_replicas=3)
    plain.autoscaling.enabled = True
    control.create(deployment_from_proto(plain, "plain"))
    latency = FakeLatency(0.9)
    scaler = Autoscaler(
        control,
        lambda d: DemandAggregate(),
        lambda d: next(x.replicas for x in control.deployments() if x.deployment_id == d),
        clock=clock,
        settings=AutoscaleSettings(ttft_window_seconds=30, ttft_interval_seconds=10),
        latency=latency,
    )
    asyncio.run(scaler.tick())
    assert latency.reads == [("slo", 30)]  # only the profile with an SLO is read
    replicas = {d.deployment_id: d.replicas for d in control.deployments()}
    assert replicas == {"slo": 2, "plain": 1}  # TTFT p99 0.9 s > 0.5 s: one more
    decision = control.autoscaler_decisions("deployments/slo", 1)[0]
    assert "TTFT p99 0.900 s > ttft_slo_seconds 0.5" in decision.reason
    assert decision.signals.ttft_p99_seconds == 0.9
    clock.advance(5)
    asyncio.run(scaler.tick())
    assert len(latency.reads) == 1  # the cached reading, within the interval: one more again
    assert {d.deployment_id: d.replicas for d in control.deployments()}["slo"] == 3
    clock.advance(6)
    latency.ttft = None  # telemetry unreadable: no TTFT signal, no scale-up
    asyncio.run(scaler.tick())
    assert len(latency.reads) == 2
    assert {d.deployment_id: d.replicas for d in control.deployments()}["slo"] == 3  # held
    view = control.get("slo")
    status = scaler.status(view.deployment, view.status).autoscaler
    assert status is not None and status.signals.ttft_p99_seconds == 0.0
    scaler.reset()
    assert scaler.status(view.deployment, view.status).autoscaler.reason == "no tick yet"


def test_a_request_held_for_a_cold_start_counts_once() -> None:
    """Routers count a held request among their queued ones too (DeploymentDemand): 12 held
    requests at a target of 8 per replica ask for 2 replicas, not 3 (the sum, 24, would)."""
    sim = Sim(deployment(replicas=1))
    assert sim.step(queued_requests=12, cold_waiting_requests=12) == SCALE_UP
    assert sim.d.replicas == 2
