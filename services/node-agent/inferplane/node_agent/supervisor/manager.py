"""`ReplicaManager`: the replicas of this node, by id. It refuses a spec before anything
starts (no model, an unknown task or transport, embeddings or speech on a transport without
them, an engine this node has not installed, an engine argument outside that engine version's
allow-list), plans each launch (`process.plan_launch` with the selected engine's interpreter,
`engines.EngineCatalog`, and this node's cores, `cpus.CpuCorePool`) and hands each replica to
its supervision (`handle.Replica`)."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Mapping

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_args import KV_CACHE_DTYPES, EngineArgError, check_engine_args
from inferplane.engine_features import SPECULATIVE_METHODS, FeatureError, check_spec_features
from inferplane.node_agent.supervisor.control import ClientFactory, ReplicaProcessClient
from inferplane.node_agent.supervisor.cpus import BIND_ENV, CpuCorePool, thread_environment
from inferplane.node_agent.supervisor.engines import EngineCatalog, discover_engines
from inferplane.node_agent.supervisor.handle import Replica, State, SupervisorConfig
from inferplane.node_agent.supervisor.process import (
    LaunchPlan,
    ProcessSpawner,
    Spawner,
    plan_launch,
)
from inferplane.replica_contract import (
    LAUNCHER_MODULE,
    REPLICA_MODULE,
    has_nvidia_gpu,
    lora_args,
    replica_task,
    resolve_transport,
    with_enum_fields,
)
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    NotFoundError,
)
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.node_agent.supervisor")


class ReplicaManager:
    """The replicas of this node, by id."""

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
        engines: EngineCatalog | None = None,
    ) -> None:
        """`client_factory` replaces `ReplicaProcessClient` and `planner` `plan_launch`
        (tests); `cores` is the pool of this node's cores; `environ` is the environment replica
        processes inherit (an explicit `VLLM_CPU_OMP_THREADS_BIND` or `OMP_WAIT_POLICY` there
        is left alone); `engines` the engines this node offers (default: this interpreter's
        only)."""
        self.config = config
        self.cpu = (not has_nvidia_gpu()) if config.cpu is None else config.cpu
        self.engines = engines or EngineCatalog(discover_engines((), cpu=self.cpu))
        self._clock = clock or SystemClock()
        self._spawner = spawner or ProcessSpawner()
        self._client_factory = client_factory or functools.partial(
            ReplicaProcessClient, security=config.security
        )
        self._planner = planner or self._plan
        self._environ = environ
        self.cores = cores or CpuCorePool.for_this_node(
            cores_per_rank=config.cpu_cores_per_rank, reserved=config.cpu_reserved_cores
        )
        self._replicas: dict[str, Replica] = {}
        self._lock = asyncio.Lock()
        #: This node's capabilities (set by the wiring: `NodeAgentParts.capabilities`); a start
        #: whose KV cache dtype or speculative method it lacks is refused (issue 30).
        self.capabilities: Callable[[], nodeagent_pb2.NodeCapabilities] | None = None

    def _plan(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec) -> LaunchPlan:
        cpu = self.cpu
        bind = None
        if cpu and BIND_ENV not in self._environ:
            bind = self.cores.assign(replica_id, max(1, spec.tensor_parallel_size))
        # The default engine runs the configured commands; another one runs our replica
        # process and launcher in its own interpreter (its environment has its vLLM).
        engine = self.engines.select(spec)
        command, engine_command = self.config.replica_command, self.config.engine_command
        if not engine.default:
            command = (engine.python, "-m", REPLICA_MODULE)
            engine_command = (engine.python, "-m", LAUNCHER_MODULE)
        return plan_launch(
            replica_id,
            spec,
            data_dir=self.config.data_dir,
            command=command,
            engine_command=engine_command,
            options=self.config.replica,
            host=self.config.host,
            replica_host=self.config.replica_host,
            advertise_host=self.config.replica_advertise_host,
            cpu=cpu,
            cpu_env=thread_environment(bind, self._environ) if cpu else None,
            engine_core_niceness=self.config.cpu_engine_core_niceness,
            engine_autogroup_niceness=self.config.cpu_engine_autogroup_niceness,
        )

    # --- management ---------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica:
        """Raises NotFoundError for an unknown id."""
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise NotFoundError(
                f"replica {replica_id!r} not found on this node", reason="REPLICA_NOT_FOUND"
            ) from None

    def _check_features(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec) -> None:
        """FAILED_PRECONDITION naming `spec.kv_cache_dtype` or `spec.speculative.<field>` for
        settings out of their rules or that this node's `capabilities` do not list
        (`inferplane.engine_features.check_spec_features`); without a capabilities source
        (a bare manager) the rules only."""
        caps = self.capabilities() if self.capabilities is not None else None
        kv_dtypes = caps.kv_cache_dtypes if caps is not None else KV_CACHE_DTYPES
        methods = caps.speculative_methods if caps is not None else SPECULATIVE_METHODS
        try:
            check_spec_features(spec, kv_dtypes, methods)
        except FeatureError as exc:
            log.warning("replica_refused", replica_id=replica_id, field=exc.field)
            raise FailedPreconditionError(
                str(exc), reason="UNSUPPORTED_FEATURE", param=exc.field
            ) from None

    def list(self) -> list[Replica]:
        """Every replica, ordered by id."""
        return [self._replicas[k] for k in sorted(self._replicas)]

    async def start(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec) -> Replica:
        """Starts a replica; idempotent: a live replica with the same spec is returned as is.

        A STOPPED or FAILED replica with that id is replaced.

        Raises:
            AlreadyExistsError: a live replica with that id runs a different spec.
            FailedPreconditionError: the spec has no model_source, names an unknown task or
                transport, asks for embeddings on the `grpc` transport (which has none), an
                engine kind or version this node has not installed (`spec.engine`,
                `spec.engine_version`: `EngineCatalog.select`), or has an engine argument
                outside that engine version's allow-list (`inferplane.engine_args`).
        """
        if not spec.model_source:
            raise FailedPreconditionError(
                "spec.model_source is required", reason="INVALID_SPEC", param="spec.model_source"
            )
        try:
            # The enum fields win over the deprecated strings (which the replica reads).
            spec = with_enum_fields(spec)
        except ValueError as exc:
            raise FailedPreconditionError(str(exc), reason="INVALID_SPEC", param="spec") from None
        try:
            replica_task(spec)
        except ValueError as exc:
            raise FailedPreconditionError(
                str(exc), reason="INVALID_SPEC", param="spec.task"
            ) from None
        try:
            resolve_transport(spec)  # also: an `embed` spec on a transport without embeddings
        except ValueError as exc:
            raise FailedPreconditionError(
                str(exc), reason="INVALID_SPEC", param="spec.transport"
            ) from None
        try:
            lora_args(spec)  # LoRA (issue 29): max_loras 0..8, a rank among vLLM's
        except ValueError as exc:
            raise FailedPreconditionError(
                str(exc), reason="INVALID_SPEC", param="spec.max_loras"
            ) from None
        engine = self.engines.select(spec)  # FAILED_PRECONDITION naming the field
        self._check_features(replica_id, spec)  # issue 30: KV cache dtype, speculation
        try:
            # The orchestrator checked the profile already; this node runs only what the
            # allow-list of the engine it runs allows, whoever sent the spec (issue 18).
            check_engine_args(spec.extra_engine_args, engine.version)
        except EngineArgError as exc:
            log.warning("replica_refused", replica_id=replica_id, flag=exc.flag)
            raise FailedPreconditionError(
                str(exc), reason="INVALID_SPEC", param="spec.extra_engine_args"
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
        """Puts a replica into DRAINING and returns at once; in-flight requests keep running
        and the drain (`Replica.drain`) keeps polling the replica's load for `grace_seconds`.

        Raises:
            NotFoundError: an unknown id.
            FailedPreconditionError: the replica is STOPPED or FAILED.
        """
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
        """SIGKILLs every replica process group now (synchronous)."""
        for replica in self._replicas.values():
            replica.kill_now()
