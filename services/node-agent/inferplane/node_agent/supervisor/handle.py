"""`Replica`, the supervision of one replica process (the manager, `manager.py`, holds one per
replica id), and `SupervisorConfig`: it starts the process, health-checks it, restarts it with
exponential backoff, drains and stops it. Data path v2 (issue 16): each replica process
serves InferenceService on its own port (`Replica.inference_address`); no token passes through
the node-agent.

Lifecycle of a replica (states are `nodeagent.v1.Replica.State`):

    STARTING ──ready──► READY ──process died / unhealthy──► RESTARTING ──ready──► READY
        │                 │                                     │
        │              drain()                     start attempts exhausted
        ▼                 ▼                                     ▼
   (fails: RESTARTING) DRAINING ──stop()──► STOPPED           FAILED

A start attempt succeeds when the replica process's gRPC health says SERVING (it does once its
engine is ready: `ReplicaProcessClient.healthy`) within `startup_timeout_seconds`. Once READY,
the health loop reads `GetReplicaLoad` every `health_interval_seconds`: requests in flight for
the node's reports, and liveness (`unhealthy_threshold` failed or engine-not-ready answers in a
row replace the process; gRPC health cannot serve here, it turns NOT_SERVING while draining).
Failed attempts are retried by tenacity with exponential backoff, at most `max_start_attempts`
in a row; a replica that was READY for `stable_after_seconds` earns a fresh budget when it
dies (so a crash-looping replica ends FAILED, a long-lived one restarts). Time is read and
slept only through the injected `Clock`, so tests run the backoff instantly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from collections.abc import Callable
from pathlib import Path

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

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.node_agent.supervisor.control import (
    ClientFactory,
    ReplicaControl,
    ReplicaControlError,
)
from inferplane.node_agent.supervisor.priority import renice_engine_cores, set_autogroup_niceness
from inferplane.node_agent.supervisor.process import (
    LAUNCHER_COMMAND,
    REPLICA_COMMAND,
    EngineHandle,
    LaunchPlan,
    Spawner,
    session_leaders,
)
from inferplane.replica_contract import (
    DEFAULT_FLAGS,
    ReplicaFlags,
)
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.node_agent.supervisor")

State = nodeagent_pb2.Replica.State


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """Supervision knobs; seconds unless named otherwise.

    Backoff before restart attempt n (n ≥ 1) is min(backoff_initial · 2^(n-1), backoff_max)
    (tenacity `wait_exponential`). `replica_command` starts a replica process,
    `engine_command` is the engine its `http-completions` / `grpc` replicas spawn (plan_launch).
    Replica processes bind `replica_host` and are reported at `replica_advertise_host`
    (empty: `replica_host`); engines and metrics bind `host` (loopback). `replica` holds the
    flags every replica process gets (`ReplicaFlags`; `plan_launch` fills in the per-replica
    ones). `drain_poll_seconds` is how often a drain reads the
    replica's load. `cpu` None: probe for an NVIDIA GPU. On a CPU node each engine rank gets
    `cpu_cores_per_rank` cores of its own, out of the node's cores less the
    `cpu_reserved_cores` lowest (cpus.py; fewer when fewer are free, `nobind` when not
    even one per rank is), and once ready its engine core runs at niceness
    `cpu_engine_core_niceness` and the autogroups of the replica process's session and of its
    engine child's at `cpu_engine_autogroup_niceness` (0: left as they are; priority.py).
    """

    data_dir: Path
    replica_command: tuple[str, ...] = REPLICA_COMMAND
    engine_command: tuple[str, ...] = LAUNCHER_COMMAND
    replica: ReplicaFlags = DEFAULT_FLAGS
    host: str = "127.0.0.1"
    replica_host: str = "127.0.0.1"
    replica_advertise_host: str = ""
    startup_timeout_seconds: float = DEFAULT_FLAGS.startup_timeout_seconds
    health_interval_seconds: float = 2.0
    startup_poll_seconds: float = 0.5
    unhealthy_threshold: int = 3
    max_start_attempts: int = 5
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    stable_after_seconds: float = 300.0
    stop_timeout_seconds: float = 15.0
    drain_grace_seconds: float = 30.0
    drain_poll_seconds: float = 0.25
    cpu: bool | None = None
    cpu_cores_per_rank: int = 2
    cpu_reserved_cores: int = 1
    cpu_engine_core_niceness: int = 19
    cpu_engine_autogroup_niceness: int = 10
    security: PeerSecurity = dataclasses.field(default_factory=PeerSecurity.plaintext)


class ReplicaStartError(Exception):
    """One start attempt failed (exited, timed out, or never became healthy)."""


class _ReplicaDied(Exception):
    """A READY replica died; `stable` when it had been READY long enough to earn a new budget."""

    def __init__(self, message: str, *, stable: bool) -> None:
        super().__init__(message)
        self.stable = stable


def _worth_retrying(exc: BaseException) -> bool:
    # A stable run that died leaves the retry loop and starts a fresh one (a new budget).
    return isinstance(exc, ReplicaStartError) or (isinstance(exc, _ReplicaDied) and not exc.stable)


class Replica:
    """One replica process on this node, supervised.

    `inference_address`, `metrics_url` and `pid` describe the current process (set at spawn);
    `in_flight` is the replica process's last reported count of requests in flight
    (`GetReplicaLoad`, polled by the health loop and while draining).
    """

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
        self.inference_address = ""
        # What the current replica process runs, as it reports once ready (issue 30).
        self.artifacts: replica_pb2.ReplicaArtifacts | None = None
        self.engine_address = ""
        self._control: ReplicaControl | None = None
        self._drain_sent = False  # StartReplicaDrain answered by the current process
        self._handle: EngineHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._draining = False
        self._state_changed = asyncio.Condition()

    @property
    def replica_id(self) -> str:
        """The replica id (`replicas/{replica_id}`)."""
        return self._id

    @property
    def spec(self) -> nodeagent_pb2.ReplicaSpec:
        """What the replica runs."""
        return self._spec

    @property
    def control(self) -> ReplicaControl | None:
        """The connection to the current replica process (None when none runs)."""
        return self._control

    # --- observation --------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The replica process's pid (its process group's id), 0 when none runs."""
        handle = self._handle
        return handle.pid if handle is not None and handle.returncode is None else 0

    def to_proto(self) -> nodeagent_pb2.Replica:
        """The replica as `nodeagent.v1.Replica`: `inference_address` is the replica process's
        own (empty while none runs), `engine_pid` the replica process's pid (its group holds
        the engine), `in_flight_requests` the last polled load."""
        running = bool(self.pid)
        msg = nodeagent_pb2.Replica(
            name=f"replicas/{self._id}",
            spec=self._spec,
            state=self.state,  # type: ignore[arg-type]
            inference_address=self.inference_address if running else "",
            engine_pid=self.pid,
            restart_count=self.restart_count,
            last_error=self.last_error,
            in_flight_requests=self.in_flight,
            metrics_url=self.metrics_url if running else "",
        )
        if running and self.artifacts is not None:
            msg.artifacts.CopyFrom(self.artifacts)
        if self.start_time is not None:
            msg.start_time.FromDatetime(self.start_time)
        if self.ready_time is not None:
            msg.ready_time.FromDatetime(self.ready_time)
        return msg

    def _not_ready_state(self, state: int) -> int:
        # Once draining, a replica that (re)starts must not take new requests again.
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
                except _ReplicaDied as died:
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
                except ReplicaStartError as exc:
                    if self._stopping:
                        return
                    await self._give_up(str(exc))
                    return
                return  # _run_once returned: stopping
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in supervision must not leave a process unowned
            log.exception("supervisor_crashed", replica=self._id)
            await self._give_up(f"supervisor error: {exc!r}")

    async def _give_up(self, message: str) -> None:
        self.last_error = message
        await self._kill_process()
        await self._set_state(State.STATE_FAILED)

    async def _before_retry(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        self.last_error = str(exc) if exc else "replica process failed"
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
        """Starts a replica process, waits until it is ready, then watches it until it dies
        or we stop.

        Raises:
            ReplicaStartError: the replica process did not become ready.
            _ReplicaDied: the replica process died (or stayed unhealthy) after being READY.
        """
        if self._stopping:
            return
        await self._kill_process()
        plan = self._planner(self._id, self._spec)
        handle = await self._spawner.spawn(plan)
        self._handle = handle
        control = self._client_factory(plan.inference_address)
        self._control = control
        self._drain_sent = False
        self.in_flight = 0
        self.inference_address = plan.inference_address
        self.artifacts = None
        self.engine_address = plan.engine_address
        self.metrics_url = plan.metrics_url
        log.info(
            "replica_spawned",
            replica=self._id,
            pid=handle.pid,
            address=plan.inference_address,
            engine_address=plan.engine_address or None,
            transport=plan.transport,
        )
        await self._wait_ready(handle, control, plan)
        if self._stopping:
            return
        if self._draining:
            # Drained before this process came up: it must not admit what Envoy still sends.
            await self._send_drain(control)
        if plan.engine_core_niceness:
            self._renice_engine_core(handle.pid, plan.engine_core_niceness)
        if plan.engine_autogroup_niceness:
            # The replica's own session (its front; for inproc also vLLM's engine core and
            # workers) and its engine child's, which leads a session of its own.
            for leader in session_leaders(handle.pid):
                await self._renice_engine_autogroup(leader, plan.engine_autogroup_niceness)
        self.ready_time = self._clock.now()
        ready_at = self._clock.monotonic()
        await self._set_state(self._not_ready_state(State.STATE_READY))
        reason = await self._watch(handle, control)
        if self._stopping:
            return
        stable = self._clock.monotonic() - ready_at >= self._config.stable_after_seconds
        raise _ReplicaDied(reason, stable=stable)

    def _renice_engine_core(self, pid: int, niceness: int) -> None:
        """Gives the engine core below `pid` `niceness` (supervisor/priority.py). A failure costs
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
        (supervisor/priority.py), retrying while the kernel rate-limits the write. Like the engine
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
        self, handle: EngineHandle, control: ReplicaControl, plan: LaunchPlan
    ) -> None:
        deadline = self._clock.monotonic() + self._config.startup_timeout_seconds
        while not self._stopping:
            if handle.returncode is not None:
                raise ReplicaStartError(
                    f"replica process exited with code {handle.returncode} while starting "
                    f"(see {plan.log_path})"
                )
            if await control.healthy():
                return
            if self._clock.monotonic() >= deadline:
                raise ReplicaStartError(
                    f"replica process not healthy after "
                    f"{self._config.startup_timeout_seconds:g} s (see {plan.log_path})"
                )
            await self._clock.sleep(self._config.startup_poll_seconds)

    async def _watch(self, handle: EngineHandle, control: ReplicaControl) -> str:
        """Polls the replica's load every health interval; returns why the replica process
        is no longer usable (or "" when stopping)."""
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
                    return f"replica process exited with code {exited.result()}"
                if self._stopping:
                    return ""
                if await self._poll_load(control):
                    failures = 0
                    continue
                failures += 1
                if failures >= self._config.unhealthy_threshold:
                    return f"replica process unhealthy for {failures} consecutive checks"
            return ""
        finally:
            if not exited.done():
                exited.cancel()

    async def _poll_load(self, control: ReplicaControl) -> bool:
        """Reads the load into `in_flight` (and re-sends a drain that did not get through);
        True when the replica process answered with its engine ready, or draining requests
        still in flight after its engine died (streams it moved to sibling replicas, issue 31:
        it exits once they ended, and is restarted then)."""
        if self._draining and not self._drain_sent:
            await self._send_drain(control)
        try:
            load = await control.load()
        except ReplicaControlError as exc:
            log.warning("replica_load_failed", replica=self._id, error=str(exc))
            return False
        if control is self._control:  # not a process that was replaced meanwhile
            self.in_flight = load.in_flight_requests
            if load.artifacts is not None:
                self.artifacts = load.artifacts
        return load.engine_ready or (load.draining and load.in_flight_requests > 0)

    async def _send_drain(self, control: ReplicaControl) -> None:
        try:
            in_flight = await control.start_drain()
        except ReplicaControlError as exc:
            # Retried at the next poll; meanwhile the replica may still admit requests.
            log.warning("replica_drain_failed", replica=self._id, error=str(exc))
            return
        if control is self._control:
            self._drain_sent = True
            self.in_flight = in_flight

    async def _kill_process(self) -> None:
        handle, control = self._handle, self._control
        self._handle = None
        self._control = None
        if control is not None:
            with contextlib.suppress(Exception):
                await control.close()
        if handle is not None:
            await handle.stop(self._config.stop_timeout_seconds)
        self.in_flight = 0
        self._release(self._id)  # the engine's cores (planned before it spawned) go back

    async def drain(self, grace_seconds: float) -> bool:
        """Stops admitting requests: DRAINING here, `StartReplicaDrain` on the replica process
        (which turns its health NOT_SERVING and refuses new requests); then polls its load
        every `drain_poll_seconds` until no request is in flight or `grace_seconds` (clock
        time) have passed. Returns True when none is left. A replica process that is not up
        yet is drained once it is."""
        if self.state in (State.STATE_STOPPED, State.STATE_FAILED):
            return self.in_flight == 0
        self._draining = True
        await self._set_state(State.STATE_DRAINING)
        deadline = self._clock.monotonic() + grace_seconds
        while True:
            control = self._control
            if control is None:  # no process (restarting): nothing in flight
                self.in_flight = 0
                return True
            await self._poll_load(control)
            remaining = deadline - self._clock.monotonic()
            if not self.in_flight or remaining <= 0:
                return self.in_flight == 0
            await self._clock.sleep(min(self._config.drain_poll_seconds, remaining))

    async def stop(self, *, force: bool = False, grace_seconds: float | None = None) -> None:
        """Drains (unless `force`), then stops the replica process's group: SIGTERM (the
        replica process drains for its own `--drain-grace-seconds` and exits), SIGKILL after
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
        await self._kill_process()
        await self._set_state(State.STATE_STOPPED)

    def kill_now(self) -> None:
        """SIGKILLs the replica process group synchronously (process exit paths)."""
        if self._handle is not None:
            self._handle.kill()
