"""Composition root of the node-agent service."""

from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.node_agent.agent.wiring import build_node_agent
from inferplane.node_agent.pipeline import InferenceServicer, ModelAssetsCache
from inferplane.node_agent.pipeline.outcome import OutcomeSink, discard_outcome
from inferplane.node_agent.pipeline.records import record_sender
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.runtime import App, NotFoundError, ServicerBinding, freeze_heap, grpc_options
from inferplane.telemetry_client import RecordSink, SinkSettings


def build_app(settings: NodeAgentSettings) -> App:
    """Wires the node-agent: engine supervision, NodeAgentService, orchestrator registration,
    the render → generate → parse pipeline over the supervisor's replicas, and telemetry."""
    registry = CollectorRegistry()
    agent = build_node_agent(settings)
    sink: RecordSink | None = None
    on_outcome: OutcomeSink = discard_outcome
    if settings.telemetry_address:
        sink = RecordSink(
            SinkSettings(target=settings.telemetry_address),
            registry,
            channel_options=grpc_options(settings),
        )

        def deployment_of(replica_id: str) -> str:
            try:
                return str(agent.manager.get(replica_id).spec.deployment)
            except NotFoundError:  # the replica was stopped meanwhile: the model name is used
                return ""

        on_outcome = record_sender(
            sink.record,
            node=settings.node_name or socket.gethostname(),
            deployment_of=deployment_of,
            wall_clock=time.time,
        )
    inference = InferenceServicer(
        agent.manager,
        ModelAssetsCache(on_loaded=freeze_heap if settings.gc_freeze else lambda: None),
        on_outcome=on_outcome,
        strict_tool_calls=settings.strict_tool_calls,
        owned_by=settings.owned_by,
    )

    async def start() -> None:
        if sink is not None:
            await sink.start()
        await agent.start()

    async def drain() -> None:
        await agent.drain()

    async def stop() -> None:
        await agent.stop()
        if sink is not None:
            await sink.close()

    return App(
        component="node_agent",
        registry=registry,
        servicers=[
            ServicerBinding(
                "inferplane.nodeagent.v1.NodeAgentService",
                agent.servicer,
                nodeagent_pb2_grpc.add_NodeAgentServiceServicer_to_server,
            ),
            ServicerBinding(
                "inferplane.inference.v1.InferenceService",
                inference,
                inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            ),
        ],
        start=start,
        drain=drain,
        stop=stop,
    )
