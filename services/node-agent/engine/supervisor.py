"""The replica supervisor: starts engine replicas, watches them, restarts them with
exponential backoff, drains and stops them. Implements `LocalReplica` and `ReplicaDirectory`
(engine/api.py) for the inference pipeline.

Lifecycle of a replica (states are `nodeagent.v1.Replica.State`):

    STARTING ──ready──► READY ──engine died / unhealthy──► RESTARTING ──ready──► READY
        │                 │                                     │
        │              drain()                     start attempts exhausted
        ▼                 ▼                                     ▼
   (fails: RESTARTING) DRAINING ──stop()──► STOPPED           FAILED

A start attempt succeeds when the engine says healthy (gRPC `HealthCheck`, or `GET /health` on
the `http-completions` transport: `EngineClient.healthy`) within `startup_timeout_seconds`.
Failed attempts are retried by tenacity with exponential backoff, at most
`max_start_attempts` in a row; an engine that was READY for `stable_after_seconds` earns a
fresh budget when it dies (so a crash-looping engine ends FAILED, a long-lived one restarts).
Time is read and slept only through the injected `Clock`, so tests run the backoff instantly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_fixed,
)

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.engine.api import EngineClient
from inferplane.node_agent.engine.cpus import BIND_ENV, CpuCorePool
from inferplane.node_agent.engine.launcher import has_nvidia_gpu
from inferplane.node_agent.engine.priority import renice_engine_cores, set_autogroup_niceness
from inferplane.node_agent.engine.process import (
    LAUNCHER_COMMAND,
    EngineHandle,
    LaunchPlan,
    ProcessSpawner,
    Spawner,
    plan_launch,
    resolve_transport,
)
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
)

log = structlog.get_logger("inferplane.node_agent.engine")

State = nodeagent_pb2.Replica.State


class Clock(Protocol):
    """Time as the supervisor sees it: monotonic seconds, wall-clock timestamps, sleeping."""

    def monotonic(self) -> float: ...

    def now(self) -> dt.datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """Supervision knobs; seconds unless named otherwise.

    Backoff before restart attempt n (n ≥ 1) is min(backoff_initial · 2^(n-1), backoff_max)
    (tenacity `wait_exponential`). `cpu` None: probe for an NVIDIA GPU. On a CPU node each
    engine rank gets `cpu_cores_per_rank` cores of its own, out of the node's cores less the
    `cpu_reserved_cores` lowest (engine/cpus.py; fewer when fewer are free, `nobind` when
    not even one per rank is), and once ready its engine core runs at niceness
    `cpu_engine_core_niceness` and its session's autogroup at `cpu_engine_autogroup_niceness`
    (0: left as they are; engine/priority.py).
    """

    data_dir: Path
    engine_command: tuple[str, ...] = LAUNCHER_COMMAND
    host: str = "127.0.0.1"
    startup_timeout_seconds: float = 180.0
    health_interval_seconds: float = 2.0
    startup_poll_seconds: float = 0.5
    unhealthy_threshold: int = 3
    max_start_attempts: int = 5
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    stable_after_seconds: float = 300.0
    stop_timeout_seconds: float = 15.0
    drain_grace_seconds: float = 30.0
    cpu: bool | None = None
    cpu_cores_per_rank: int = 2
    cpu_reserved_cores: int = 1
    cpu_engine_core_niceness: int = 19
    cpu_engine_autogroup_niceness: int = 10


class EngineStartError(Exception):
    """One start attempt failed (exited, timed out, or never became healthy)."""


class _EngineDied(Exception):
    """A READY engine died; `stable` when it had been READY long enough to earn a new budget."""

    def __init__(self, message: str, *, stable: bool) -> None:
        super().__init__(message)
        self.stable = stable


def _worth_retrying(exc: BaseException) -> bool:
    # A stable run that died leaves the retry loop and starts a fresh one (a new budget).
    return isinstance(exc, EngineStartError) or (isinstance(exc, _EngineDied) and not exc.stable)


ClientFactory = Callable[[str], EngineClient]
"""Makes the client of a started engine from `LaunchPlan.client_address`."""


def default_client(address: str) -> EngineClient:
    """The transport's client: `HttpEngineClient` for an `http://` URL (`http-completions`),
    `GrpcEngineClient` for `host:port` (`grpc`)."""
    if address.startswith("http://"):
        from inferplane.node_agent.engine.http_client import HttpEngineClient

        return HttpEngineClient(address)
    from inferplane.node_agent.engine.grpc_client import GrpcEngineClient

    return GrpcEngineClient(address)


class Replica:
    """One engine replica on this node (implements `LocalReplica`)."""

    def __init__(
        self,
        replica_id: str,
        spec: nodeagent_pb2.ReplicaSpec,
        *,
        config: SupervisorConfig,
        clock: Clock,
        spawner: Spawner,
        client_factory: ClientFactory,
        planner: Callable[[str, nodeagent_pb2.ReplicaSpec], LaunchPlan],
        release: Callable[[str], None] = lambda replica_id: None,
    ) -> None:
        self._id = replica_id
        self._spec = spec
        self._config = config
        self._clock = clock
        self._spawner = spawner
        self._client_factory = client_factory
        self._planner = planner
        self._release = release
        self.state: int = State.STATE_STARTING
        self.restart_count = 0
        self.last_error = ""
        self.in_flight = 0
        self.start_time: dt.datetime | None = None
        self.ready_time: dt.datetime | None = None
        self.metrics_url = ""
        self.grpc_address = ""
        self._engine: EngineClient | None = None
        self._handle: EngineHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._draining = False
        self._state_changed = asyncio.Condition()

    # --- LocalReplica -------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        return self._id

    @property
    def spec(self) -> nodeagent_pb2.ReplicaSpec:
        return self._spec

    @property
    def engine(self) -> EngineClient:
        if self._engine is None:
            raise UnavailableError(f"replica {self._id} has no running engine")
        return self._engine

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Counts one request in flight. Raises UnavailableError unless READY."""
        if self.state != State.STATE_READY:
            raise UnavailableError(
                f"replica {self._id} is {State.Name(self.state)}, not taking requests",
                reason="REPLICA_NOT_READY",
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    # --- observation --------------------------------------------------------------------

    @property
    def pid(self) -> int:
        handle = self._handle
        return handle.pid if handle is not None and handle.returncode is None else 0

    def to_proto(self, inference_address: str = "") -> nodeagent_pb2.Replica:
        """The replica as `nodeagent.v1.Replica`."""
        msg = nodeagent_pb2.Replica(
            name=f"replicas/{self._id}",
            spec=self._spec,
            state=self.state,  # type: ignore[arg-type]
            inference_address=inference_address,
            engine_pid=self.pid,
            restart_count=self.restart_count,
            last_error=self.last_error,
            in_flight_requests=self.in_flight,
            metrics_url=self.metrics_url if self.pid else "",
        )
        if self.start_time is not None:
            msg.start_time.FromDatetime(self.start_time)
        if self.ready_time is not None:
            msg.ready_time.FromDatetime(self.ready_time)
        return msg

    def _not_ready_state(self, state: int) -> int:
        # Once draining, an engine that (re)starts must not take new requests again.
        return State.STATE_DRAINING if self._draining else state

    async def _set_state(self, state: int) -> None:
        if state != self.state:
            log.info(
                "replica_state",
                replica=self._id,
                state=State.Name(state),  # type: ignore[arg-type]
                restart_count=self.restart_count,
                last_error=self.last_error or None,
            )
        self.state = state
        async with self._state_changed:
            self._state_changed.notify_all()

    async def wait_for_state(self, *states: int, timeout: float | None = None) -> int:
        """Waits (real time) until the replica is in one of `states`; returns the state.

        Raises:
            TimeoutError: not reached within `timeout` seconds.
        """

        async def reached() -> int:
            async with self._state_changed:
                await self._state_changed.wait_for(lambda: self.state in states)
            return self.state

        return await asyncio.wait_for(reached(), timeout)

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts supervising (returns at once; the replica is STARTING)."""
        self.start_time = self._clock.now()
        self._task = asyncio.create_task(self._supervise(), name=f"replica-{self._id}")

    async def _supervise(self) -> None:
        try:
            while not self._stopping:
                retrying = AsyncRetrying(
                    stop=stop_after_attempt(self._config.max_start_attempts),
                    wait=wait_exponential(
                        multiplier=self._config.backoff_initial_seconds,
                        max=self._config.backoff_max_seconds,
                    ),
                    retry=retry_if_exception(_worth_retrying),
                    sleep=self._clock.sleep,
                    before_sleep=self._before_retry,
                    reraise=True,
                )
                try:
                    await retrying(self._run_once)
                except _EngineDied as died:
                    if self._stopping:
                        return
                    if died.stable:
                        # A long healthy run: start over at once with a fresh attempt budget.
                        self.last_error = str(died)
                        self.restart_count += 1
                        await self._set_state(self._not_ready_state(State.STATE_RESTARTING))
                        continue
                    await self._give_up(str(died))
                    return
                except EngineStartError as exc:
                    if self._stopping:
                        return
                    await self._give_up(str(exc))
                    return
                return  # _run_once returned: stopping
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in supervision must not leave an engine unowned
            log.exception("supervisor_crashed", replica=self._id)
            await self._give_up(f"supervisor error: {exc!r}")

    async def _give_up(self, message: str) -> None:
        self.last_error = message
        await self._kill_engine()
        await self._set_state(State.STATE_FAILED)

    async def _before_retry(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        self.last_error = str(exc) if exc else "engine failed"
        self.restart_count += 1
        await self._set_state(self._not_ready_state(State.STATE_RESTARTING))
        log.warning(
            "replica_restart_backoff",
            replica=self._id,
            attempt=retry_state.attempt_number,
            sleep_seconds=retry_state.upcoming_sleep,
            error=self.last_error,
        )

    async def _run_once(self) -> None:
        """Starts an engine, waits until ready, then watches it until it dies or we stop.

        Raises:
            EngineStartError: the engine did not become ready.
            _EngineDied: the engine died (or stayed unhealthy) after being READY.
        """
        if self._stopping:
            return
        await self._kill_engine()
        plan = self._planner(self._id, self._spec)
        handle = await self._spawner.spawn(plan)
        self._handle = handle
        engine = self._client_factory(plan.client_address)
        self._engine = engine
        self.grpc_address = plan.grpc_address
        self.metrics_url = plan.metrics_url
        log.info(
            "engine_spawned",
            replica=self._id,
            pid=handle.pid,
            address=plan.grpc_address,
            transport=plan.transport,
        )
        await self._wait_ready(handle, engine, plan)
        if self._stopping:
            return
        if plan.engine_core_niceness:
            self._renice_engine_core(handle.pid, plan.engine_core_niceness)
        if plan.engine_autogroup_niceness:
            await self._renice_engine_autogroup(handle.pid, plan.engine_autogroup_niceness)
        self.ready_time = self._clock.now()
        ready_at = self._clock.monotonic()
        await self._set_state(self._not_ready_state(State.STATE_READY))
        reason = await self._watch(handle, engine)
        if self._stopping:
            return
        stable = self._clock.monotonic() - ready_at >= self._config.stable_after_seconds
        raise _EngineDied(reason, stable=stable)

    def _renice_engine_core(self, pid: int, niceness: int) -> None:
        """Gives the engine core below `pid` `niceness` (engine/priority.py). A failure costs
        the engine its priority tuning, not its start: logged, and the replica goes READY."""
        try:
            cores = renice_engine_cores(pid, niceness)
        except OSError as exc:
            log.warning("engine_core_renice_failed", replica=self._id, error=str(exc))
            return
        if not cores:
            log.warning("engine_core_not_found", replica=self._id, pid=pid)
            return
        log.info("engine_core_reniced", replica=self._id, pids=cores, niceness=niceness)

    async def _renice_engine_autogroup(self, pid: int, niceness: int) -> None:
        """Gives the session `pid` leads an autogroup niceness of `niceness`
        (engine/priority.py), retrying while the kernel rate-limits the write. Like the engine
        core's, a failure is logged and the replica still goes READY."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(BlockingIOError),
                stop=stop_after_attempt(5),
                wait=wait_fixed(0.2),
                reraise=True,
            ):
                with attempt:
                    applied = set_autogroup_niceness(pid, niceness)
        except (OSError, ValueError) as exc:
            log.warning("engine_autogroup_renice_failed", replica=self._id, error=str(exc))
            return
        if applied:
            log.info("engine_autogroup_reniced", replica=self._id, pid=pid, niceness=niceness)

    async def _wait_ready(
        self, handle: EngineHandle, engine: EngineClient, plan: LaunchPlan
    ) -> None:
        deadline = self._clock.monotonic() + self._config.startup_timeout_seconds
        while not self._stopping:
            if handle.returncode is not None:
                raise EngineStartError(
                    f"engine exited with code {handle.returncode} while starting "
                    f"(see {plan.log_path})"
                )
            if await engine.healthy():
                return
            if self._clock.monotonic() >= deadline:
                raise EngineStartError(
                    f"engine not healthy after {self._config.startup_timeout_seconds:g} s "
                    f"(see {plan.log_path})"
                )
            await self._clock.sleep(self._config.startup_poll_seconds)

    async def _watch(self, handle: EngineHandle, engine: EngineClient) -> str:
        """Returns why the engine is no longer usable (or "" when stopping)."""
        exited = asyncio.ensure_future(handle.wait())
        try:
            failures = 0
            while not self._stopping:
                sleeper = asyncio.ensure_future(
                    self._clock.sleep(self._config.health_interval_seconds)
                )
                done, _ = await asyncio.wait({exited, sleeper}, return_when=asyncio.FIRST_COMPLETED)
                if exited in done:
                    sleeper.cancel()
                    return f"engine exited with code {exited.result()}"
                if self._stopping:
                    return ""
                if await engine.healthy():
                    failures = 0
                    continue
                failures += 1
                if failures >= self._config.unhealthy_threshold:
                    return f"engine unhealthy for {failures} consecutive checks"
            return ""
        finally:
            if not exited.done():
                exited.cancel()

    async def _kill_engine(self) -> None:
        handle, engine = self._handle, self._engine
        self._handle = None
        self._engine = None
        if engine is not None:
            with contextlib.suppress(Exception):
                await engine.close()
        if handle is not None:
            await handle.stop(self._config.stop_timeout_seconds)
        self._release(self._id)  # the engine's cores (planned before it spawned) go back

    async def drain(self, grace_seconds: float) -> bool:
        """Stops admitting requests (DRAINING) and waits up to `grace_seconds` (clock time)
        for those in flight. Returns True when none is left."""
        if self.state in (State.STATE_STOPPED, State.STATE_FAILED):
            return self.in_flight == 0
        self._draining = True
        await self._set_state(State.STATE_DRAINING)
        deadline = self._clock.monotonic() + grace_seconds
        while self.in_flight and self._clock.monotonic() < deadline:
            # Polling through the clock keeps fake-clock tests instant; 50 ms is well below
            # any grace period.
            await self._clock.sleep(min(0.05, deadline - self._clock.monotonic()))
        return self.in_flight == 0

    async def stop(self, *, force: bool = False, grace_seconds: float | None = None) -> None:
        """Drains (unless `force`), then stops the engine group: SIGTERM, SIGKILL after
        `stop_timeout_seconds`. Ends STOPPED. Idempotent."""
        if self.state == State.STATE_STOPPED and self._handle is None:
            return
        if not force:
            grace = self._config.drain_grace_seconds if grace_seconds is None else grace_seconds
            await self.drain(grace)
        self._stopping = True
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._kill_engine()
        await self._set_state(State.STATE_STOPPED)

    def kill_now(self) -> None:
        """SIGKILLs the engine group synchronously (process exit paths)."""
        if self._handle is not None:
            self._handle.kill()


class ReplicaManager:
    """The replicas of this node (implements `ReplicaDirectory`)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        clock: Clock | None = None,
        spawner: Spawner | None = None,
        client_factory: ClientFactory | None = None,
        planner: Callable[[str, nodeagent_pb2.ReplicaSpec], LaunchPlan] | None = None,
        cores: CpuCorePool | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """`planner` replaces `plan_launch` (tests); `cores` the pool of this node's cores;
        `environ` is the environment engines inherit (an explicit `VLLM_CPU_OMP_THREADS_BIND`
        there is left alone)."""
        self.config = config
        self._clock = clock or SystemClock()
        self._spawner = spawner or ProcessSpawner()
        self._client_factory = client_factory or default_client
        self._planner = planner or self._plan
        self._environ = environ
        self.cores = cores or CpuCorePool.for_this_node(
            cores_per_rank=config.cpu_cores_per_rank, reserved=config.cpu_reserved_cores
        )
        self._replicas: dict[str, Replica] = {}
        self._lock = asyncio.Lock()

    def _plan(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec) -> LaunchPlan:
        cpu = (not has_nvidia_gpu()) if self.config.cpu is None else self.config.cpu
        bind = None
        if cpu and BIND_ENV not in self._environ:
            bind = self.cores.assign(replica_id, max(1, spec.tensor_parallel_size))
        return plan_launch(
            replica_id,
            spec,
            data_dir=self.config.data_dir,
            command=self.config.engine_command,
            host=self.config.host,
            cpu=cpu,
            cpu_bind=bind,
            engine_core_niceness=self.config.cpu_engine_core_niceness,
            engine_autogroup_niceness=self.config.cpu_engine_autogroup_niceness,
        )

    # --- ReplicaDirectory ---------------------------------------------------------------

    def ready_replicas(self, model: str) -> Sequence[Replica]:
        ready = [
            r
            for r in self._replicas.values()
            if r.state == State.STATE_READY
            and model in (r.spec.served_model_name, r.spec.deployment)
        ]
        return sorted(ready, key=lambda r: (r.in_flight, r.replica_id))

    def known_models(self) -> Sequence[nodeagent_pb2.ReplicaSpec]:
        seen: dict[str, nodeagent_pb2.ReplicaSpec] = {}
        for r in sorted(self._replicas.values(), key=lambda r: r.replica_id):
            if r.state in (State.STATE_STOPPED, State.STATE_FAILED):
                continue
            seen.setdefault(r.spec.served_model_name or r.spec.deployment, r.spec)
        return list(seen.values())

    # --- management ---------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica:
        """Raises NotFoundError for an unknown id."""
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise NotFoundError(
                f"replica {replica_id!r} not found on this node", reason="REPLICA_NOT_FOUND"
            ) from None

    def list(self) -> list[Replica]:
        """Every replica, ordered by id."""
        return [self._replicas[k] for k in sorted(self._replicas)]

    async def start(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec) -> Replica:
        """Starts a replica; idempotent: a live replica with the same spec is returned as is.

        A STOPPED or FAILED replica with that id is replaced.

        Raises:
            AlreadyExistsError: a live replica with that id runs a different spec.
            FailedPreconditionError: the spec has no model_source, or names an unknown
                transport.
        """
        if not spec.model_source:
            raise FailedPreconditionError(
                "spec.model_source is required", reason="INVALID_SPEC", param="spec.model_source"
            )
        try:
            resolve_transport(spec)
        except ValueError as exc:
            raise FailedPreconditionError(
                str(exc), reason="INVALID_SPEC", param="spec.transport"
            ) from None
        async with self._lock:
            existing = self._replicas.get(replica_id)
            if existing is not None:
                if existing.state not in (State.STATE_STOPPED, State.STATE_FAILED):
                    if existing.spec == spec:
                        return existing
                    raise AlreadyExistsError(
                        f"replica {replica_id!r} already runs a different spec; stop it first",
                        reason="REPLICA_SPEC_MISMATCH",
                    )
                await existing.stop(force=True)
            replica = Replica(
                replica_id,
                spec,
                config=self.config,
                clock=self._clock,
                spawner=self._spawner,
                client_factory=self._client_factory,
                planner=self._planner,
                release=self.cores.release,
            )
            self._replicas[replica_id] = replica
            replica.start()
            return replica

    async def drain(self, replica_id: str, grace_seconds: float | None = None) -> Replica:
        """Puts a replica into DRAINING and returns at once; in-flight requests keep running."""
        replica = self.get(replica_id)
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        if replica.state in (State.STATE_STOPPED, State.STATE_FAILED):
            raise FailedPreconditionError(
                f"replica {replica_id!r} is {State.Name(replica.state)}",  # type: ignore[arg-type]
                reason="REPLICA_NOT_RUNNING",
            )
        task = asyncio.create_task(replica.drain(grace))
        await asyncio.sleep(0)  # let drain() flip the state before we report it
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return replica

    async def stop(
        self, replica_id: str, *, force: bool = False, grace_seconds: float | None = None
    ) -> Replica:
        """Drains (unless forced) and stops a replica; it stays listed as STOPPED."""
        replica = self.get(replica_id)
        await replica.stop(force=force, grace_seconds=grace_seconds)
        return replica

    async def close(self, grace_seconds: float = 0.0) -> None:
        """Stops every replica (the node-agent is shutting down)."""
        await asyncio.gather(
            *(r.stop(force=grace_seconds <= 0, grace_seconds=grace_seconds) for r in self.list()),
            return_exceptions=True,
        )

    def kill_all(self) -> None:
        """SIGKILLs every engine group now (synchronous)."""
        for replica in self._replicas.values():
            replica.kill_now()
