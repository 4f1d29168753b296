"""The ADS server (state of the world): it only watches the `SnapshotCache` (go-control-plane's
`pkg/server/v3`).

Per stream: the node id comes from the first request (`set_node_on_first_message_only`). A
request subscribes its type URL (and, for EDS/RDS, resource names). A response is sent for a
subscribed type whenever the snapshot's version for it differs from what this stream last sent,
types in ADS order (CDS → EDS → LDS → RDS). A request echoing the last nonce with the version is
an ACK; one carrying `error_detail` is a NACK: logged with Envoy's message, nothing is resent
until the snapshot changes (Envoy keeps its last good config).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

import structlog
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from inferplane.edge import ENDPOINT_TYPE, ROUTE_TYPE
from inferplane.orchestrator.xds.cache import ADS_ORDER, Snapshot, SnapshotCache

log = structlog.get_logger("inferplane.orchestrator.xds")

_NAMED = (ENDPOINT_TYPE, ROUTE_TYPE)  # Envoy asks for these by name


@dataclasses.dataclass(slots=True)
class _TypeState:
    names: tuple[str, ...] = ()
    sent_version: str = ""
    sent_names: tuple[str, ...] = ()
    nonce: str = ""
    acked_version: str = ""


class AggregatedDiscoveryService(
    ads_pb2_grpc.AggregatedDiscoveryServiceServicer  # type: ignore[misc]
):
    """envoy.service.discovery.v3.AggregatedDiscoveryService over a `SnapshotCache`.

    `acks` / `nacks` count ACKed and NACKed responses (tests and logs read them).
    """

    def __init__(self, cache: SnapshotCache) -> None:
        self._cache = cache
        self._nonces = itertools.count(1)
        self.acks = 0
        self.nacks = 0
        self.streams = 0

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: Any
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await requests.put(request)
            finally:
                await requests.put(None)

        reader = asyncio.create_task(read())
        node_id = ""
        subscribed: dict[str, _TypeState] = {}
        generation = -1
        self.streams += 1
        try:
            while True:
                snapshot = self._cache.get(node_id)
                for response in self._responses(snapshot, subscribed):
                    yield response
                generation = self._cache.generation
                next_request = asyncio.ensure_future(requests.get())
                changed = asyncio.ensure_future(self._cache.wait_for_change(generation))
                try:
                    done, _ = await asyncio.wait(
                        {next_request, changed}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    # Also when the stream is cancelled mid-wait: no waiter outlives it.
                    for waiter in (next_request, changed):
                        if not waiter.done():
                            waiter.cancel()
                if next_request not in done:
                    continue
                request = next_request.result()
                if request is None:
                    return
                if request.node.id and not node_id:
                    node_id = request.node.id
                    log.info("xds_stream_opened", node=node_id, cluster=request.node.cluster)
                self._on_request(node_id, request, subscribed)
        finally:
            self.streams -= 1
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    def _on_request(
        self,
        node_id: str,
        request: discovery_pb2.DiscoveryRequest,
        subscribed: dict[str, _TypeState],
    ) -> None:
        state = subscribed.setdefault(request.type_url, _TypeState())
        if request.type_url in _NAMED:
            state.names = tuple(sorted(request.resource_names))
        if not request.response_nonce:
            return  # a first request (or a reconnect carrying its last version)
        if request.response_nonce != state.nonce:
            return  # a stale nonce: Envoy will answer the newer response too
        if request.HasField("error_detail"):
            self.nacks += 1
            log.warning(
                "xds_nack",
                node=node_id,
                type_url=request.type_url,
                rejected_version=state.sent_version,
                kept_version=request.version_info,
                error=request.error_detail.message,
            )
            return
        self.acks += 1
        state.acked_version = request.version_info
        log.debug("xds_ack", node=node_id, type_url=request.type_url, version=request.version_info)

    def _responses(
        self, snapshot: Snapshot | None, subscribed: dict[str, _TypeState]
    ) -> list[discovery_pb2.DiscoveryResponse]:
        if snapshot is None:
            return []
        out = []
        for type_url in ADS_ORDER:
            state = subscribed.get(type_url)
            if state is None:
                continue
            resources = snapshot.resources.get(type_url, {})
            names = state.names if type_url in _NAMED else ()
            version = snapshot.versions.get(type_url, "")
            if version == state.sent_version and names == state.sent_names:
                continue
            chosen = (
                [resources[n] for n in names if n in resources]
                if names
                else list(resources.values())
            )
            nonce = str(next(self._nonces))
            packed = []
            for resource in chosen:
                item = any_pb2.Any()
                item.Pack(resource)
                packed.append(item)
            out.append(
                discovery_pb2.DiscoveryResponse(
                    version_info=version, type_url=type_url, nonce=nonce, resources=packed
                )
            )
            state.sent_version, state.sent_names, state.nonce = version, names, nonce
        return out
