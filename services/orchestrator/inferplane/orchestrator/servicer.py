"""gRPC servicers of the orchestrator service (proto ⇄ domain; errors are mapped by the runtime).

Every use case runs in a worker thread (`asyncio.to_thread`): the control plane does blocking
database I/O and CPU-bound placement, and the event loop must keep serving heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.orchestrator.catalog.compat_check import CompatibilityCheck, Override
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.convert import (
    adapter_from_proto,
    adapter_to_proto,
    decision_to_proto,
    demand_from_proto,
    deployment_from_proto,
    deployment_to_proto,
    domain_paths,
    node_from_status,
    node_to_proto,
    observed_from_status,
    placement_to_proto,
)
from inferplane.orchestrator.fleet.model import ObservedReplica
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.release.matrix import CompatibilityMatrix
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.orchestrator.routing import RoutingHub
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError, PermissionDeniedError
from inferplane.runtime.security.identity import ROUTER, peer_identity

pb = orchestrator_pb2
Context = Any  # grpc.aio.ServicerContext


def _deployment_id(name: str, param: str = "name") -> str:
    if not name.startswith("deployments/") or not name.removeprefix("deployments/"):
        raise InvalidArgumentError(
            f"{param} must look like deployments/{{deployment}}, got {name!r}", param=param
        )
    return name.removeprefix("deployments/")


def _adapter_id(name: str) -> str:
    if not name.startswith("adapters/") or not name.removeprefix("adapters/"):
        raise InvalidArgumentError(
            f"name must look like adapters/{{adapter}}, got {name!r}", param="name"
        )
    return name.removeprefix("adapters/")


class DeploymentService(
    orchestrator_pb2_grpc.DeploymentServiceServicer  # type: ignore[misc]
):
    """inferplane.orchestrator.v1.DeploymentService; `compat`: the compatibility matrix and
    its check (None: ListCompatibility and ListForcedChanges answer FAILED_PRECONDITION)."""

    def __init__(self, control: ControlPlane, compat: CompatibilityCheck | None = None) -> None:
        self._control = control
        self._compat = compat

    async def CreateDeployment(
        self, request: pb.CreateDeploymentRequest, context: Context
    ) -> pb.CreateDeploymentResponse:
        deployment = deployment_from_proto(request.deployment, request.deployment_id)
        view = await asyncio.to_thread(
            self._control.create,
            deployment,
            validate_only=request.validate_only,
            override=_override(request, context),
        )
        return pb.CreateDeploymentResponse(deployment=deployment_to_proto(view))

    async def GetDeployment(
        self, request: pb.GetDeploymentRequest, context: Context
    ) -> pb.GetDeploymentResponse:
        view = await asyncio.to_thread(self._control.get, _deployment_id(request.name))
        return pb.GetDeploymentResponse(deployment=deployment_to_proto(view))

    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: Context
    ) -> pb.ListDeploymentsResponse:
        page = await asyncio.to_thread(
            self._control.list_deployments, request.page_size, request.page_token
        )
        return pb.ListDeploymentsResponse(
            deployments=[deployment_to_proto(v) for v in page.items],
            next_page_token=page.next_page_token,
        )

    async def UpdateDeployment(
        self, request: pb.UpdateDeploymentRequest, context: Context
    ) -> pb.UpdateDeploymentResponse:
        deployment_id = _deployment_id(request.deployment.name, "deployment.name")
        incoming = deployment_from_proto(request.deployment, deployment_id)
        view = await asyncio.to_thread(
            self._control.update,
            incoming,
            domain_paths(list(request.update_mask.paths)),
            override=_override(request, context),
        )
        return pb.UpdateDeploymentResponse(deployment=deployment_to_proto(view))

    async def DeleteDeployment(
        self, request: pb.DeleteDeploymentRequest, context: Context
    ) -> pb.DeleteDeploymentResponse:
        await asyncio.to_thread(self._control.delete, _deployment_id(request.name))
        return pb.DeleteDeploymentResponse()

    async def ListDeploymentReplicas(
        self, request: pb.ListDeploymentReplicasRequest, context: Context
    ) -> pb.ListDeploymentReplicasResponse:
        name = _deployment_id(request.parent, "parent")
        page = await asyncio.to_thread(
            self._control.replicas, name, request.page_size, request.page_token
        )
        observed = self._control.observed_replicas()
        return pb.ListDeploymentReplicasResponse(
            placements=[
                placement_to_proto(item, _reported(observed, item))
                if isinstance(item, Placement)
                else placement_to_proto(item, None)
                for item in page.items
            ],
            next_page_token=page.next_page_token,
        )

    async def ExplainPlacement(
        self, request: pb.ExplainPlacementRequest, context: Context
    ) -> pb.ExplainPlacementResponse:
        lines = await asyncio.to_thread(self._control.explain, _deployment_id(request.name))
        return pb.ExplainPlacementResponse(lines=lines)

    async def ListAutoscalerDecisions(
        self, request: pb.ListAutoscalerDecisionsRequest, context: Context
    ) -> pb.ListAutoscalerDecisionsResponse:
        """The autoscaler's recent decisions, newest first (`Catalogue.autoscaler_decisions`).

        Raises:
            InvalidArgumentError: `deployment` set but not `deployments/{deployment}`.
            NotFoundError: no such deployment.
        """
        name = _deployment_id(request.deployment, "deployment") if request.deployment else ""
        decisions = await asyncio.to_thread(
            self._control.autoscaler_decisions, name, request.page_size
        )
        return pb.ListAutoscalerDecisionsResponse(
            decisions=[decision_to_proto(d) for d in decisions]
        )

    async def CreateAdapter(
        self, request: pb.CreateAdapterRequest, context: Context
    ) -> pb.CreateAdapterResponse:
        adapter = adapter_from_proto(request.adapter, request.adapter_id)
        created = await asyncio.to_thread(self._control.create_adapter, adapter)
        return pb.CreateAdapterResponse(adapter=adapter_to_proto(created))

    async def GetAdapter(
        self, request: pb.GetAdapterRequest, context: Context
    ) -> pb.GetAdapterResponse:
        adapter = await asyncio.to_thread(self._control.get_adapter, _adapter_id(request.name))
        return pb.GetAdapterResponse(adapter=adapter_to_proto(adapter))

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: Context
    ) -> pb.ListAdaptersResponse:
        base = request.base_deployment
        if base:
            base = _deployment_id(base, "base_deployment")
        adapters = await asyncio.to_thread(self._control.list_adapters, base)
        return pb.ListAdaptersResponse(adapters=[adapter_to_proto(a) for a in adapters])

    async def DeleteAdapter(
        self, request: pb.DeleteAdapterRequest, context: Context
    ) -> pb.DeleteAdapterResponse:
        left = await asyncio.to_thread(self._control.delete_adapter, _adapter_id(request.name))
        return pb.DeleteAdapterResponse(adapter=adapter_to_proto(left) if left else None)

    async def ListCompatibility(
        self, request: pb.ListCompatibilityRequest, context: Context
    ) -> pb.ListCompatibilityResponse:
        """Each combination's current verdict, newest first (`CompatibilityMatrix.list`).

        Raises:
            InvalidArgumentError: unknown `verdict`, or a bad `page_token`.
            FailedPreconditionError: no matrix configured.
        """
        matrix = self._matrix()
        entries, token = await asyncio.to_thread(
            matrix.list,
            deployment=request.deployment.removeprefix("deployments/"),
            engine_version=request.engine_version,
            model_digest=request.model_digest,
            verdict=request.verdict,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListCompatibilityResponse(entries=entries, next_page_token=token)

    async def ListForcedChanges(
        self, request: pb.ListForcedChangesRequest, context: Context
    ) -> pb.ListForcedChangesResponse:
        """Creates and updates that overrode a failed verdict, newest first.

        Raises:
            FailedPreconditionError: no matrix configured.
        """
        matrix = self._matrix()
        changes = await asyncio.to_thread(
            matrix.list_forced,
            deployment=request.deployment.removeprefix("deployments/"),
            page_size=request.page_size,
        )
        return pb.ListForcedChangesResponse(changes=changes)

    def _matrix(self) -> CompatibilityMatrix:
        if self._compat is None:
            raise FailedPreconditionError(
                "this orchestrator keeps no compatibility matrix", reason="NO_COMPATIBILITY_MATRIX"
            )
        return self._compat.matrix


def _override(
    request: pb.CreateDeploymentRequest | pb.UpdateDeploymentRequest, context: Context
) -> Override:
    """The request's force and force_reason, and its caller: the peer's certificate identity
    (`admin` for operators' CLIs), or "anonymous" on a plaintext server."""
    return Override(
        force=request.force,
        reason=request.force_reason,
        actor=peer_identity(context) or "anonymous",
    )


def _reported(
    observed: Mapping[str, Mapping[str, ObservedReplica]], placement: Placement
) -> ObservedReplica | None:
    """What the placement's node-agent reports for it: node-agents name a replica by slot and
    revision (`release.spec.agent_replica_id`), placements by slot; a report under the bare
    slot id is accepted too."""
    on_node = observed.get(placement.node, {})
    return on_node.get(agent_replica_id(placement.replica_id, placement.revision)) or on_node.get(
        placement.replica_id
    )


class NodeService(
    orchestrator_pb2_grpc.NodeServiceServicer  # type: ignore[misc]
):
    """inferplane.orchestrator.v1.NodeService; `compat` learns the replicas' artifacts from
    every registration and heartbeat (`CompatibilityCheck.observe`)."""

    def __init__(self, control: ControlPlane, compat: CompatibilityCheck | None = None) -> None:
        self._control = control
        self._compat = compat

    async def _observe(self, status: nodeagent_pb2.NodeStatus) -> None:
        if self._compat is not None:
            await asyncio.to_thread(self._compat.observe, status.replicas)

    def _node_proto(self, name: str) -> pb.Node:
        node = self._control.node(name)
        observed = self._control.observed_replicas().get(node.name, {})
        raw = [
            r.raw for _, r in sorted(observed.items()) if isinstance(r.raw, nodeagent_pb2.Replica)
        ]
        return node_to_proto(node, raw)

    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: Context
    ) -> pb.RegisterNodeResponse:
        status = request.status
        node = await asyncio.to_thread(
            self._control.register_node, node_from_status(status), observed_from_status(status)
        )
        await self._observe(status)
        return pb.RegisterNodeResponse(
            node=self._node_proto(node.name),
            heartbeat_interval_seconds=max(1, round(self._control.heartbeat_interval_seconds)),
        )

    async def StreamHeartbeats(
        self, request_iterator: AsyncIterator[pb.StreamHeartbeatsRequest], context: Context
    ) -> AsyncIterator[pb.StreamHeartbeatsResponse]:
        async for beat in request_iterator:
            if not beat.status.node:
                raise InvalidArgumentError(
                    "status.node (the node name) is required", param="status.node"
                )
            node = await asyncio.to_thread(
                self._control.heartbeat,
                node_from_status(beat.status),
                observed_from_status(beat.status),
            )
            await self._observe(beat.status)
            yield pb.StreamHeartbeatsResponse(condition=node.condition.value)

    async def GetNode(self, request: pb.GetNodeRequest, context: Context) -> pb.GetNodeResponse:
        return pb.GetNodeResponse(node=self._node_proto(request.name))

    async def ListNodes(
        self, request: pb.ListNodesRequest, context: Context
    ) -> pb.ListNodesResponse:
        page = self._control.list_nodes(request.page_size, request.page_token)
        return pb.ListNodesResponse(
            nodes=[self._node_proto(n.name) for n in page.items],
            next_page_token=page.next_page_token,
        )

    async def DrainNode(
        self, request: pb.DrainNodeRequest, context: Context
    ) -> pb.DrainNodeResponse:
        node = await asyncio.to_thread(self._control.drain_node, request.name)
        return pb.DrainNodeResponse(node=self._node_proto(node.name))

    async def UncordonNode(
        self, request: pb.UncordonNodeRequest, context: Context
    ) -> pb.UncordonNodeResponse:
        node = await asyncio.to_thread(self._control.uncordon_node, request.name)
        return pb.UncordonNodeResponse(node=self._node_proto(node.name))


class RoutingService(
    orchestrator_pb2_grpc.RoutingServiceServicer  # type: ignore[misc]
):
    """inferplane.orchestrator.v1.RoutingService: the table the reconcile loop publishes."""

    def __init__(self, hub: RoutingHub) -> None:
        self._hub = hub

    async def WatchRoutingTable(
        self, request: pb.WatchRoutingTableRequest, context: Context
    ) -> AsyncIterator[pb.WatchRoutingTableResponse]:
        """The full table (only `models` when given) at once, then each changed table; the
        version is a content hash, equal tables are never sent twice in a row. With
        `router_id`, the router's own view: its shares of each replica's cap and its lease
        epoch (`RoutingHub`).

        Raises:
            PermissionDeniedError: `router_id` from an identity other than the router's.
        """
        _check_router(request.router_id, context)
        tables = self._hub.watch(tuple(request.models), request.router_id)
        async with contextlib.aclosing(tables):  # the stream counts as closed at once
            async for table in tables:
                yield table

    async def RenewRouterLease(
        self, request: pb.RenewRouterLeaseRequest, context: Context
    ) -> pb.RenewRouterLeaseResponse:
        """Renews a router's lease on its shares and takes its acknowledgement (`RoutingHub.
        renew`).

        Raises:
            InvalidArgumentError: no `router_id`.
            PermissionDeniedError: called by an identity other than the router's.
            FailedPreconditionError: the router has no watch stream open here.
        """
        if not request.router_id:
            raise InvalidArgumentError("router_id is required", param="router_id")
        _check_router(request.router_id, context)
        seconds = self._hub.renew(
            request.router_id,
            request.lease_epoch,
            request.version,
            [(r.address, r.replica_id) for r in request.over_share],
            release=request.release,
            demand=[(d.deployment, demand_from_proto(d)) for d in request.demand],
            held=[((h.replica.address, h.replica.replica_id), h.requests) for h in request.held],
        )
        return pb.RenewRouterLeaseResponse(
            lease_seconds=seconds, hold_seconds=self._hub.hold_seconds
        )


def _check_router(router_id: str, context: Context) -> None:
    """Only routers take shares of the caps (a plaintext server has no identities)."""
    if not router_id:
        return
    identity = peer_identity(context)
    if identity is not None and identity != ROUTER:
        raise PermissionDeniedError(
            f"identity {identity!r} may not take a share of the replicas' caps (router_id)",
            code="identity_not_allowed",
            param="router_id",
        )
