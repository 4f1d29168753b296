"""The router's own Prometheus metrics (base units; labels bounded by the fleet's size).

Request latency, status and token metrics are telemetry's (from the router's records); here
is what only the router knows: its queues, breakers, slots and fallbacks.

- `inferplane_router_queued_requests{deployment}` (gauge): requests waiting for a slot;
- `inferplane_router_queued_flows{deployment}` (gauge): API keys (keyless requests: one per
  tier) with a request waiting; with the queued requests, how concentrated the queue is;
- `inferplane_router_queue_refusals_total{deployment,reason}` (counter): 429s of the admission
  queue, `reason` one of `queue_full` (the whole queue), `flow_share` (the key held its fair
  share of the queue: fairness at work, see admission.py), `timeout` (no slot in time),
  `kv_cache_full` (KV-fit admission: no replica's KV cache had room for the request in time,
  kvfit.py), and the 503s `cold_start` (held for a deployment at zero past its cold-start
  budget);
- `inferplane_router_cold_waiting_requests{deployment}` (gauge): requests held because the
  deployment has no ready replica (scale from zero, issue 29);
- `inferplane_router_in_flight_requests{deployment,replica}` (gauge): slots taken;
- `inferplane_router_circuit_breaker_state{deployment,replica,state}` (gauge, a state set:
  1 for the replica's current state among closed, open, half_open, else 0);
- with shared caps (issue 20), `inferplane_router_cap_share_requests{deployment,replica}`
  (gauge): this router's share of the replica's cap it admits on,
  `inferplane_router_cap_lease_valid` (gauge, 1 or 0): whether it may admit on its shares,
  under its lease or during the lease's hold (0: it admits nothing new; requests queue), and
  `inferplane_router_cap_shares_held_over_seconds` (gauge): how long it has admitted on its
  last lease's shares without a lease of its table (the orchestrator away, restarting or
  failing over: issue 31), 0 while it holds one;
- `inferplane_router_fallbacks_served_total` (counter): requests a fallback of the pick
  served because the endpoints before it failed before their first byte (Envoy retried down
  the list; Envoy's own `cluster.inferplane_replicas.upstream_rq_retry*` stats count the
  attempts and what its retry budget refused);
- `inferplane_router_orphan_outcomes_total` (counter): replicas' reports of requests this
  address picked before it restarted, whose usage it reported from the report;
- `inferplane_router_provisional_conclusions_total` and
  `inferplane_router_provisional_amended_total` (counters): requests concluded without hearing
  how they ended (response started, no trailers, no replica report within
  `outcome_wait_seconds`), and those of them whose replica's late report amended the usage;
- `inferplane_router_adapter_requests_total{deployment,adapter,status}` (counter): requests
  routed to a deployment that ended, by the LoRA adapter their route named (issue 29; "" for
  the base model) and how they ended (`completed`, `failed`, `cancelled`). The adapter label is
  a catalogue name from the routing table, never the client's text: its values are bounded by
  the catalogue's adapters.
- `inferplane_router_revision_requests_total{deployment,revision,status}` (counter) and
  `inferplane_router_revision_ttft_seconds{deployment,revision}` (histogram, from the arrival
  at the router, requests that produced output): requests routed to a deployment that ended,
  by the profile revision of the replica that served them (issue 30; "" when none did or the
  table names none) — a canary's live figures beside its stable revision's. A deployment
  serves one revision, two during a rollout or canary: the label adds at most one series per
  deployment and status;
- `inferplane_router_canary_fallbacks_total{deployment,revision}` (counter): requests whose
  canary revision (`revision`) had no usable endpoint, served by the split's other revision
  instead of refused (`canary.py`).

Gauges are read from `Admission` at scrape time (no work on the request path); the scrape
runs on the metrics thread and only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferplane.router.admission import Admission
from inferplane.router.breaker import BreakerState

BREAKER_STATES = tuple(s.value for s in BreakerState)
# TTFT buckets (seconds): from a cached short prompt on a GPU to a long prefill on a CPU.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """Counters the endpoint picker increments (the admission collector is separate)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.fallbacks_served = Counter(
            "inferplane_router_fallbacks_served",
            "Requests a fallback endpoint of the pick served, because the endpoints before it "
            "failed before their first byte.",
            registry=registry,
        )
        self.orphan_outcomes = Counter(
            "inferplane_router_orphan_outcomes",
            "Replicas' reports of requests picked before this router restarted, whose usage "
            "was reported from the report.",
            registry=registry,
        )
        self.provisional_conclusions = Counter(
            "inferplane_router_provisional_conclusions",
            "Requests concluded as cancelled without hearing how they ended (no trailers, no "
            "replica report within outcome_wait_seconds).",
            registry=registry,
        )
        self.provisional_amended = Counter(
            "inferplane_router_provisional_amended",
            "Provisionally concluded requests whose replica's late report amended the usage.",
            registry=registry,
        )
        self.adapter_requests = Counter(
            "inferplane_router_adapter_requests",
            "Requests routed to a deployment that ended, by the LoRA adapter their route named "
            '("" for the base model) and how they ended.',
            ["deployment", "adapter", "status"],
            registry=registry,
        )
        self.revision_requests = Counter(
            "inferplane_router_revision_requests",
            "Requests routed to a deployment that ended, by the profile revision of the "
            'replica that served them ("" when none did) and how they ended.',
            ["deployment", "revision", "status"],
            registry=registry,
        )
        self.revision_ttft = Histogram(
            "inferplane_router_revision_ttft_seconds",
            "Time to first token from the arrival at the router, by the profile revision of "
            "the replica that served the request (requests that produced output).",
            ["deployment", "revision"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.canary_fallbacks = Counter(
            "inferplane_router_canary_fallbacks",
            "Requests whose canary revision had no usable endpoint, served by another "
            "revision of the split instead of refused.",
            ["deployment", "revision"],
            registry=registry,
        )


class AdmissionCollector(Collector):
    """Queue lengths, slots and breaker states of the current routing table, per scrape."""

    def __init__(self, admission: Admission, now: Callable[[], float]) -> None:
        self._admission = admission
        self._now = now

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "inferplane_router_queued_requests",
            "Requests waiting in a deployment's admission queue.",
            labels=["deployment"],
        )
        flows = GaugeMetricFamily(
            "inferplane_router_queued_flows",
            "API keys (keyless requests form one per tier) with a request in a deployment's queue.",
            labels=["deployment"],
        )
        refusals = CounterMetricFamily(
            "inferplane_router_queue_refusals",
            "Requests the admission queue refused: 429 queue_full, flow_share (the key held "
            "its fair share of the queue), timeout, kv_cache_full (no replica's KV cache had "
            "room); 503 cold_start (a deployment at zero had no replica ready within its "
            "cold-start budget).",
            labels=["deployment", "reason"],
        )
        cold = GaugeMetricFamily(
            "inferplane_router_cold_waiting_requests",
            "Requests held because the deployment has no ready replica (scale from zero).",
            labels=["deployment"],
        )
        in_flight = GaugeMetricFamily(
            "inferplane_router_in_flight_requests",
            "Requests holding a slot on a replica.",
            labels=["deployment", "replica"],
        )
        breaker = GaugeMetricFamily(
            "inferplane_router_circuit_breaker_state",
            "1 for the replica's circuit-breaker state (closed, open, half_open), else 0.",
            labels=["deployment", "replica", "state"],
        )
        share = GaugeMetricFamily(
            "inferplane_router_cap_share_requests",
            "This router's share of the replica's concurrency cap (shared caps).",
            labels=["deployment", "replica"],
        )
        now = self._now()
        for name in self._admission.deployments():
            queued.add_metric([name], self._admission.queue_length(name))
            flows.add_metric([name], self._admission.queued_flows(name))
            cold.add_metric([name], self._admission.cold_waiting(name))
            for reason, count in self._admission.refused(name).items():
                refusals.add_metric([name, reason], count)
            replicas = self._admission.replicas(name)
            if replicas is None:
                continue
            for endpoint, state in zip(replicas.endpoints, replicas.states, strict=True):
                replica = endpoint.replica_id or endpoint.address
                in_flight.add_metric([name, replica], state.in_flight)
                part = self._admission.share(endpoint.key)
                if part is not None:
                    share.add_metric([name, replica], part)
                current = state.breaker.peek(now).value
                for value in BREAKER_STATES:
                    breaker.add_metric([name, replica, value], 1.0 if value == current else 0.0)
        yield queued
        yield flows
        yield cold
        yield refusals
        yield in_flight
        yield breaker
        valid = self._admission.lease_valid()
        if valid is not None:
            yield share
            lease = GaugeMetricFamily(
                "inferplane_router_cap_lease_valid",
                "1 while this router holds the lease to admit on its shares of the caps.",
            )
            lease.add_metric([], 1.0 if valid else 0.0)
            yield lease
            held = GaugeMetricFamily(
                "inferplane_router_cap_shares_held_over_seconds",
                "Seconds this router has admitted on its last lease's shares without a lease "
                "of its routing table (0 while it holds one).",
            )
            held.add_metric([], self._admission.held_over_seconds() or 0.0)
            yield held

    def describe(self) -> Iterator[Metric]:
        return iter(())
