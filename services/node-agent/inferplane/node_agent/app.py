"""Composition root of the node-agent service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.node_agent.agent.wiring import build_node_agent
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.runtime import App, ServicerBinding
from inferplane.runtime.security.identity import ADMIN, ORCHESTRATOR, PeerPolicy


def build_app(settings: NodeAgentSettings) -> App:
    """Wires the node-agent, the node's control plane (issue 16): replica supervision,
    NodeAgentService and orchestrator registration. It serves no InferenceService: each
    replica process does, on its own port, and gets the telemetry address, node name and
    pipeline options from the settings (`agent.wiring.supervisor_config`)."""
    agent = build_node_agent(settings)
    return App(
        component="node_agent",
        registry=CollectorRegistry(),
        # Replica control: the orchestrator's reconciler and releases, and operators.
        peer_policy=PeerPolicy(
            {"/inferplane.nodeagent.v1.NodeAgentService/": [ORCHESTRATOR, ADMIN]}
        ),
        servicers=[
            ServicerBinding(
                "inferplane.nodeagent.v1.NodeAgentService",
                agent.servicer,
                nodeagent_pb2_grpc.add_NodeAgentServiceServicer_to_server,
            ),
        ],
        start=agent.start,
        drain=agent.drain,
        stop=agent.stop,
    )
