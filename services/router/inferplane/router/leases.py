"""`CapLease`: this router's lease on its shares of the replicas' concurrency caps (issue 20).

The orchestrator splits each replica's cap among the routers that watch its routing table
with a `router_id` (`inferplane.orchestrator.routing`); this router admits on its shares
(`Admission`) only while it holds a lease of the table's `lease_epoch`. `CapLease` renews it
with `RoutingService.RenewRouterLease`: every fifth of the lease, at once after each new
table, and when a replica whose share shrank has drained to it (`Admission.on_drained`). One
renewal at a time; never per request.

The bound: a renewal sent at `t` (this router's monotonic clock) that grants `L` seconds, with
the hold `H` (`RenewRouterLeaseResponse.hold_seconds`), lets the router admit on its shares
until `t + L`, and, if no renewal comes (the orchestrator down, restarting, failing over, its
stream lost), on the last shares of that lease's epoch until `t + L + H` (`Admission`: the
"held-over" shares; the gauge `inferplane_router_cap_shares_held_over_seconds` says since
when). A table of a new epoch (an orchestrator restart, a new leader, a standby's view with
shares of 0) does not replace them before a lease of its epoch is granted: until then the
router admits on the last lease's shares, within that same `t + L + H`, and names them in each
renewal (`RenewRouterLeaseRequest.held`: per replica its share, or its requests in flight
there if more). After `t + L + H` it admits nothing new (requests wait, then 429) until its
next table and renewal. Why no cap is exceeded (the orchestrator's `routing.shares`):

- The shares one orchestrator grants (the `held` of all routers of one replica) sum to at most
  its cap, and a share grows only out of room nobody holds.
- That orchestrator received the renewal after `t` and keeps this router's `held` until
  `L + H + margin` after it did (margin: clock-rate differences), whether or not the router
  comes back, so no other router is given this router's room while it may still admit on it.
- An orchestrator that starts, or starts leading, either adopts its predecessor's `held` (the
  journal, written before any share is shown; each adopted router keeps its `held` for
  `L + H + margin`), or, without a complete hand-over, grants no room for `L + H + margin`
  from its start: every share granted before it has ended by then, held-over ones included.
  During that grace the only shares it shows are the held-over ones routers name, each
  clamped to the room nobody else holds; as they were granted by earlier orchestrators
  under the same rule, together they fit in the cap.
- The database's first leader (term 1, no grants written) knows no orchestrator granted
  before it: nothing to adopt, nothing to wait for.

So `H` trades availability during a control-plane outage (up to `L + H`, 15 + 30 s by
default, of admission without the orchestrator) against how long a router that died or is
cut off keeps its room from the others (`L + H + margin`, 46 s). Requests already admitted
run on; shares that shrank are reported until the requests above them ended (`over_share`),
and only then given to other routers.

Every renewal also carries this router's demand per deployment of its table (issue 29,
`DeploymentDemand`: the autoscaler's input): admission's queue, waits, 429s, requests in
flight and received, requests held for a cold start (`Admission.demand`), and the engines'
waiting requests (sum) and KV usage (max) over the deployment's replicas from their state
streams (`EngineStates`; a replica without a fresh state is left out). Its cost is one pass
over the table's deployments and replicas per renewal, none per request. A request held for a
deployment at zero renews at once (`Admission.on_cold`), so the orchestrator learns of it
without waiting for the period.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.router.admission import Admission
from inferplane.router.engine_state import EngineStates
from inferplane.router.routes import RouteTable
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.time.clock import Clock

# Renewals per lease: four may fail in a row before the lease runs out.
RENEWALS_PER_LEASE = 5
# Between attempts while no lease was granted yet (first table, orchestrator restarting).
RETRY_SECONDS = 1.0
# A renewal that takes longer is abandoned (the lease it would give counts from its start).
RENEW_TIMEOUT_SECONDS = 5.0


class CapLease:
    """Keeps `admission`'s lease on its shares of the caps, renewed at `address`.

    Args:
        address: the orchestrator's RoutingService (host:port), or where the router's
            routing-table watch is now (`OrchestratorRouteSource.address`, which follows the
            leader among several orchestrators): renewals go there.
        router_id: this router's id, as its routing-table watch sends it.
        admission: where the lease goes (`Admission.set_lease`) and the over-share replicas
            come from.
        clock: monotonic time of the lease (the same clock admission reads).
        engine_states: the replicas' engine states (the replica state watch's), for the
            engine part of the demand; None: reported as 0.
    """

    def __init__(
        self,
        address: str | Callable[[], str],
        router_id: str,
        admission: Admission,
        clock: Clock,
        *,
        security: PeerSecurity | None = None,
        options: Sequence[tuple[str, Any]] = (),
        retry_seconds: float = RETRY_SECONDS,
        engine_states: EngineStates | None = None,
    ) -> None:
        self._where = address if callable(address) else (lambda: address)
        self._address = self._where()
        self.router_id = router_id
        self._admission = admission
        self._clock = clock
        self._security = security or PeerSecurity.plaintext()
        self._options = list(options)
        self._retry = retry_seconds
        self._interval = retry_seconds
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None  # RoutingServiceStub on an aio channel (its stubs type sync)
        self._log = structlog.get_logger("inferplane.router.leases")
        self._engines = engine_states
        self.renewals = 0
        admission.on_drained = self.wake
        admission.on_cold = self.wake

    def wake(self) -> None:
        """Renews soon (a new table, a replica drained to its share)."""
        self._wake.set()

    def on_table(self, table: RouteTable) -> None:
        """`RouteSource` listener: a new table is acknowledged by a renewal at once."""
        self._wake.set()

    async def _stub_for(self) -> Any:
        address = self._where()
        if self._stub is not None and address != self._address:
            channel, self._channel, self._stub = self._channel, None, None
            if channel is not None:
                await channel.close(None)
        if self._stub is None:
            self._address = address
            self._channel = self._security.aio_channel(address, options=self._options)
            self._stub = orchestrator_pb2_grpc.RoutingServiceStub(self._channel)
        return self._stub

    async def renew(self, *, release: bool = False) -> bool:
        """One renewal now, acknowledging the applied table; returns whether a lease was
        granted (a failure is logged: the current lease simply runs out). With `release`,
        the router gives its shares back and admits nothing more."""
        table = self._admission.table
        epoch = table.lease_epoch if table is not None else ""
        request = opb.RenewRouterLeaseRequest(
            router_id=self.router_id,
            lease_epoch=epoch,
            version=table.version if table is not None else "",
            over_share=[
                opb.ReplicaRef(address=address, replica_id=replica_id)
                for address, replica_id in self._admission.over_share(release=release)
            ],
            release=release,
            demand=[] if release else self.demand(),
            held=[
                opb.HeldShare(
                    replica=opb.ReplicaRef(address=address, replica_id=replica_id),
                    requests=requests,
                )
                for (address, replica_id), requests in self._admission.held_over()
            ]
            if not release
            else [],
        )
        if release:
            self._admission.set_lease("", -float("inf"))
        sent = self._clock.monotonic()
        try:
            stub = await self._stub_for()
            response = await stub.RenewRouterLease(request, timeout=RENEW_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            self._interval = self._retry
            self._log.warning(
                "cap_lease_renewal_failed", address=self._address, code=exc.code().name
            )
            return False
        self.renewals += 1
        seconds = response.lease_seconds
        if seconds <= 0 or release:
            self._interval = self._retry
            return False
        self._interval = seconds / RENEWALS_PER_LEASE
        if epoch:
            self._admission.set_lease(epoch, sent + seconds, response.hold_seconds)
        return True

    def demand(self) -> list[opb.DeploymentDemand]:
        """This router's demand per deployment of its table now (the module docstring)."""
        out = []
        for d in self._admission.demand():
            waiting, kv_usage = 0, 0.0
            replicas = self._admission.replicas(d.deployment)
            if self._engines is not None and replicas is not None:
                get = self._engines.get
                for endpoint in replicas.endpoints:
                    state = get(endpoint.replica_id) if endpoint.replica_id else None
                    if state is not None:
                        waiting += state.waiting_requests
                        kv_usage = max(kv_usage, state.kv_usage)
            out.append(
                opb.DeploymentDemand(
                    deployment=d.deployment,
                    queued_requests=d.queued_requests,
                    max_queue_wait_seconds=d.max_queue_wait_seconds,
                    queue_rejections_total=d.queue_rejections_total,
                    in_flight_requests=d.in_flight_requests,
                    engine_waiting_requests=waiting,
                    kv_usage=kv_usage,
                    cold_waiting_requests=d.cold_waiting_requests,
                    requests_total=d.requests_total,
                )
            )
        return out

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cap-lease")

    async def stop(self) -> None:
        """Stops renewing and gives the shares back (best effort: otherwise they return to
        the other routers when the lease runs out)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._stub is not None:
            await self.renew(release=True)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = self._stub = None

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            await self.renew()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
