"""What node-agents run, as the reconcile loop sees it: the loop's settings, per-node backoff,
and the observation of one tick (`ListReplicas` on every node that is not NotReady, all asked at
once, a silent one unreachable for the tick) with the calls that back a node off when they fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta

import structlog
from tenacity import RetryCallState, wait_exponential

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.orchestrator.fleet.model import Node, NodeCondition
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.orchestrator.release.store import ManagedReplica

log = structlog.get_logger("inferplane.orchestrator.reconcile")

S = nodeagent_pb2.Replica.State
#: States of a replica that runs (or is about to): not gone.
LIVE_STATES = (S.STATE_STARTING, S.STATE_READY, S.STATE_RESTARTING, S.STATE_DRAINING)


@dataclasses.dataclass(frozen=True, slots=True)
class ReconcileSettings:
    """Knobs of the loop, in seconds.

    interval_seconds: time between ticks when nothing wakes the loop.
    propagation_seconds: between marking a replica draining in the routing table and
        DrainReplica (routers must see the table before the replica refuses requests).
    warmup_attempts / warmup_retry_seconds: warm-up requests tried on a new READY replica.
    backoff_initial_seconds / backoff_max_seconds: per-node backoff after a failed call.
    observe_timeout_seconds: how long a tick waits for one node-agent's ListReplicas (all
        nodes are asked at once); one that has not answered by then is unreachable for this
        tick (backoff). A node whose network went silent answers nothing and resets nothing:
        without this bound it held the whole tick, and so the routing table, for the control
        calls' deadline (30 s), its replicas still listed after the node was NotReady
        (tests/multihost, issue 20).
    """

    interval_seconds: float = 1.0
    propagation_seconds: float = 1.0
    warmup_attempts: int = 3
    warmup_retry_seconds: float = 1.0
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    observe_timeout_seconds: float = 5.0


class NodeBackoff:
    """Per-node exponential backoff on the injected clock: after n consecutive failures a node
    is left alone for min(initial · 2^(n-1), max) seconds (tenacity `wait_exponential`)."""

    def __init__(self, initial_seconds: float, max_seconds: float) -> None:
        self._wait = wait_exponential(multiplier=initial_seconds, max=max_seconds)
        self._failures: dict[str, int] = {}
        self._until: dict[str, datetime] = {}

    def blocked(self, node: str, now: datetime) -> bool:
        until = self._until.get(node)
        return until is not None and now < until

    def failed(self, node: str, now: datetime) -> float:
        """Records a failure; returns the backoff in seconds."""
        failures = self._failures.get(node, 0) + 1
        self._failures[node] = failures
        state = RetryCallState(None, None, (), {})
        state.attempt_number = failures
        delay = float(self._wait(state))
        self._until[node] = now + timedelta(seconds=delay)
        return delay

    def succeeded(self, node: str) -> None:
        self._failures.pop(node, None)
        self._until.pop(node, None)


class Observation:
    """The reconcile loop's view of the node-agents (a base of `Reconciler`, which sets the
    attributes): the last good `ListReplicas` answer per node, the nodes that answered this
    tick, and node-agent calls under per-node backoff."""

    _agents: NodeAgents
    _settings: ReconcileSettings
    _backoff: NodeBackoff
    _observed: dict[str, dict[str, nodeagent_pb2.Replica]]
    _reachable: set[str]

    async def _observe(self, nodes: Mapping[str, Node], now: datetime) -> None:
        self._reachable = set()
        for name in list(self._observed):
            node = nodes.get(name)
            if node is None or node.condition is NodeCondition.NOT_READY:
                del self._observed[name]
        asked = [
            (name, node)
            for name, node in sorted(nodes.items())
            if node.condition is not NodeCondition.NOT_READY
            and node.address
            and not self._backoff.blocked(name, now)
        ]
        answers = await asyncio.gather(
            *(
                asyncio.wait_for(
                    self._agents.list_replicas(node.address),
                    self._settings.observe_timeout_seconds,
                )
                for _name, node in asked
            ),
            return_exceptions=True,
        )
        for (name, _node), answer in zip(asked, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer  # cancellation of the tick itself
                error = str(answer) or type(answer).__name__
                delay = self._backoff.failed(name, now)
                log.warning("node_agent_unreachable", node=name, error=error, retry_in=delay)
                continue
            self._backoff.succeeded(name)
            self._reachable.add(name)
            self._observed[name] = {r.name.removeprefix("replicas/"): r for r in answer}

    def _seen(self, record: ManagedReplica) -> nodeagent_pb2.Replica | None:
        return self._observed.get(record.node, {}).get(record.replica_id)

    def _ready(self, record: ManagedReplica) -> bool:
        seen = self._seen(record)
        return seen is not None and seen.state == S.STATE_READY

    def _gone(self, record: ManagedReplica) -> bool:
        """The node answered and does not run the replica (absent, STOPPED or FAILED)."""
        if record.node not in self._reachable:
            return False
        seen = self._seen(record)
        return seen is None or seen.state not in LIVE_STATES

    async def _call(self, node: str, now: datetime, call):  # type: ignore[no-untyped-def]
        """Awaits a node-agent call; on failure logs, backs the node off, returns None."""
        if self._backoff.blocked(node, now):
            call.close()
            return None
        try:
            return await call
        except Exception as exc:
            delay = self._backoff.failed(node, now)
            log.warning("node_agent_call_failed", node=node, error=str(exc), retry_in=delay)
            return None
