"""The local stack's life cycle: every service, the node-agent(s), the fixture deployments
(kimi-tiny; embed-tiny and whisper-tiny when asked) and Envoy, all run on this machine.

`Stack` is what `inferplane up` runs and what the end-to-end tests and benches start.
Start-up order (each step waits for the previous one):

1. the orchestrator, with the edge (xDS) flags: Envoy's listener and clusters, the router
   instances as EDS endpoints, the auth service for ext_authz;
2. auth, the node-agent (registers with the orchestrator, starts no replica on its own) and
   the router (follows the orchestrator's routing table), all healthy;
3. the node registers, then `DeploymentService.CreateDeployment` (or `UpdateDeployment` when the
   data directory already holds it) for kimi-tiny: one CPU replica (`StackConfig.replicas`);
   the reconcile loop starts it on the node-agent, warms it up and adds it to the routing table;
4. telemetry, following the orchestrator's routing table for the engines to scrape (and
   writing them to `<data_dir>/prometheus/engines.json` for Prometheus's file_sd);
5. the web console (`python -m inferplane.console`), once its health page answers;
6. Envoy from the minimal ADS bootstrap: LIVE once the orchestrator pushed its config, and
   ready once its replicas cluster holds every routable replica process. The endpoint picker
   (the router, over ext_proc) answers each request with an ordered list of replica processes
   and Envoy's override_host load balancing sends it to the first; a pick naming a host the
   cluster does not hold yet (not yet pushed by EDS) would fall back to round robin;
7. the routers admitting on their shares of the replicas' caps (`_admitting.py`): an
   orchestrator on a new database grants no share for the router lease + 1 s (16 s) after it
   starts, and a first request sent before would wait out the router's queue and get a 429.

Layout of the data directory::

    <data_dir>/up.lock            held (flock) while a stack runs: a second `up` refuses
    <data_dir>/stack.json         ports and pids, for `inferplane status`
    <data_dir>/logs/<name>.log    each component's output (mode 0600, as every log here)
    <data_dir>/pki/               the local CA (`ca.crt`, `ca.key`) and each identity's
                                  certificate (`<identity>.crt`, `.key`: edge, auth, router,
                                  orchestrator, node-agent, telemetry, admin); keys 0600; with
                                  `plaintext` only the edge's, and only with `tls`
    <data_dir>/<name>/            each component's own state (auth and orchestrator databases,
                                  engine logs...); the orchestrator's catalogue survives an `up`
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import IO, Any

import grpc

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.localstack._admitting import RouterCaps, admission_gap, parse_router_caps
from inferplane.localstack._config import (
    EMBED_MODEL_NAME,
    MODEL_NAME,
    QWEN3_MODEL_NAME,
    SPEECH_MODEL_NAME,
    Progress,
    StackConfig,
    StackError,
    service_of,
)
from inferplane.localstack._deployments import (
    embed_tiny_deployment,
    kimi_tiny_deployment,
    qwen3_tiny_deployment,
    whisper_tiny_deployment,
)
from inferplane.localstack._launch import Launcher, benchmark_key_file
from inferplane.localstack._prometheus import engine_sd_file
from inferplane.runtime import AlreadyExistsError, ConfigError, InferplaneError
from inferplane.runtime.processes.ports import free_port
from inferplane.sdk import Client

# The orchestrator stops before the node-agent: it must not restart replicas whose engines
# are going down with their node-agent.
_STOP_ORDER = ("console", "router", "telemetry", "orchestrator", "node_agent", "auth")
#: How long the routers may take to admit on their shares once the replicas are routable:
#: the orchestrator's start-up wait (16 s) and a renewal (3 s), with room for a busy machine.
ADMITTING_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass(slots=True)
class Stack(Launcher):
    """Starts and stops the components in dependency order (the module's docstring), and
    answers questions about the running stack (serving replicas, API keys).

    Its attributes are `Launcher`'s (`config`, `processes`, `edge`, `admin_key`,
    `console_port`) and, while it runs, the held `<data_dir>/up.lock`.
    """

    _lock: IO[str] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, progress: Progress = lambda _msg: None) -> None:
        """Starts everything; returns once Envoy is LIVE with the configuration the
        orchestrator pushed, lists every routable replica, and the routers admit requests to
        them (their leases and the whole of each replica's cap granted).

        Raises:
            StackError: a stack already runs in this data directory, a component exited or
                was not healthy in time, the orchestrator refused the deployment, or the
                replica failed / was not routable within `startup_timeout_seconds`, or the
                routers were not granted the replicas' caps within 60 s.
        """
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self.console_port = cfg.console_port or free_port()
        try:
            self._start_services(progress)
            self._ensure_benchmark_key()
            self._ensure_deployment(progress)
            endpoints = self._wait_routable(progress)
            # Telemetry scrapes the replicas the routing table lists (the metrics URLs their
            # node-agent reports), so a rolling release moves its targets.
            progress("starting telemetry")
            self._service(
                "telemetry",
                "--orchestrator-address",
                self.config.address("orchestrator"),
                "--engine-sd-file",
                str(engine_sd_file(self.config.data_dir)),
            )
            self._wait_healthy("telemetry", progress)
            self._start_console(progress)
            self._start_edge(progress)
            self._wait_edge_routes(endpoints, progress)
            self._wait_admitting(endpoints, progress)
            self._write_state()
        except BaseException:
            self.stop()
            raise

    def stop(self, progress: Progress = lambda _msg: None) -> None:
        """Stops every component: the edge, the router and telemetry, the orchestrator (so it
        restarts nothing), the node-agent with its engines, auth."""
        if self.edge is not None:
            progress("stopping envoy")
            self.edge.stop()
            self.edge = None
        order = [n for s in _STOP_ORDER for n in self.processes if service_of(n) == s]
        order += [n for n in reversed(self.processes) if n not in order]
        for name in order:
            progress(f"stopping {name}")
            self.processes[name].stop()
        self.processes.clear()
        with contextlib.suppress(OSError):
            (self.config.data_dir / "stack.json").unlink()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- steps -------------------------------------------------------------------------------

    def _take_lock(self) -> None:
        path = self.config.data_dir / "up.lock"
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            state = self.config.data_dir / "stack.json"
            where = ""
            with contextlib.suppress(OSError, ValueError):
                where = f" (endpoint {json.loads(state.read_text())['base_url']})"
            raise StackError(
                f"a stack is already running from {self.config.data_dir}{where}; stop it first "
                "(Ctrl-C in its terminal) or pass another --data-dir and ports"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._lock = handle

    def _write_state(self) -> None:
        cfg = self.config
        state = {
            "base_url": cfg.base_url,
            "console_url": cfg.console_url,
            "ca_path": str(cfg.ca_path or ""),
            "tls_dir": "" if cfg.plaintext else str(cfg.pki_dir.resolve()),
            "ports": cfg.ports,
            "http_port": cfg.http_port,
            "envoy_admin_port": cfg.envoy_admin_port,
            "deployment": MODEL_NAME,
            "pids": {n: p.pid for n, p in self.processes.items()},
        }
        (cfg.data_dir / "stack.json").write_text(json.dumps(state, indent=2))

    def deployments(self) -> dict[str, tuple[orchestrator_pb2.Deployment, int]]:
        """The deployments this stack serves, by name, with the replicas each must have."""
        cfg = self.config
        wanted = {}
        if cfg.chat:
            wanted[MODEL_NAME] = (kimi_tiny_deployment(cfg), cfg.replicas)
        if cfg.qwen3:
            wanted[QWEN3_MODEL_NAME] = (qwen3_tiny_deployment(cfg), 1)
        if cfg.embeddings:
            wanted[EMBED_MODEL_NAME] = (embed_tiny_deployment(), 1)
        if cfg.speech:
            wanted[SPEECH_MODEL_NAME] = (whisper_tiny_deployment(), 1)
        return wanted

    def _ensure_deployment(self, progress: Progress) -> None:
        """Waits for the node to register, then creates each deployment (or, when a previous
        run left it in the catalogue, updates it to this configuration)."""
        with self._client(orchestrator=self.config.address("orchestrator")) as client:
            deadline = time.monotonic() + 60
            while True:
                self._raise_if_dead()
                listed = []
                with contextlib.suppress(InferplaneError):  # a busy machine: ask again
                    listed = list(client.nodes.list(timeout=5))
                ready = {n.status.node: n for n in listed if n.condition == "Ready"}
                if all(name in ready for name in self.config.nodes):
                    for name in self.config.nodes:
                        node = ready[name]
                        gib = node.status.memory_bytes / 2**30
                        progress(
                            f"node {name} registered ({node.status.cpu_count} CPUs, "
                            f"{gib:.0f} GiB, {len(node.status.gpus)} GPUs)"
                        )
                    break
                if time.monotonic() > deadline:
                    agent, node_name = next(
                        (a, n) for a, n in self.config.node_agents.items() if n not in ready
                    )
                    raise StackError(
                        f"the node-agent of {node_name} did not register with the orchestrator "
                        "in 60 s:\n" + self.processes[agent].log_tail()
                    )
                time.sleep(0.2)
            for name, (deployment, _replicas) in self.deployments().items():
                self._create_or_update(client, name, deployment, progress)

    def _client(self, *, orchestrator: str) -> Client:
        """The SDK client (the operators' way to call the platform) on this stack's identity."""
        return Client(orchestrator=orchestrator, security=self.config.security, timeout=10)

    @staticmethod
    def _create_or_update(
        client: Client, name: str, deployment: orchestrator_pb2.Deployment, progress: Progress
    ) -> None:
        try:
            try:
                client.deployments.create(name, deployment)
                progress(f"deployment {name} created")
            except AlreadyExistsError:
                deployment.name = f"deployments/{name}"
                client.deployments.update(deployment)  # every updatable field
                progress(f"deployment {name} found in the catalogue and updated")
        except InferplaneError as exc:
            raise StackError(
                f"the orchestrator refused the {name} deployment: {exc.reason} {exc.message}"
            ) from exc

    def _wait_routable(self, progress: Progress) -> list[orchestrator_pb2.RouteEndpoint]:
        """Reports each deployment's phase and its replicas' states until the routing table
        lists the wanted number of serving replicas (READY and warmed up) of every deployment;
        returns their endpoints."""
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout_seconds
        shown: set[str] = set()
        wanted = {name: replicas for name, (_d, replicas) in self.deployments().items()}

        def show(line: str) -> None:
            if line not in shown:
                shown.add(line)
                progress(line)

        with contextlib.ExitStack() as channels:
            client = channels.enter_context(self._client(orchestrator=cfg.address("orchestrator")))
            agents = [
                nodeagent_pb2_grpc.NodeAgentServiceStub(
                    channels.enter_context(self.config.security.channel(cfg.address(name)))
                )
                for name in cfg.node_agents
            ]
            statuses = {name: orchestrator_pb2.DeploymentStatus(phase="unknown") for name in wanted}
            while True:
                self._raise_if_dead()
                endpoints: dict[str, list[orchestrator_pb2.RouteEndpoint]] = {}
                try:
                    for name in wanted:
                        statuses[name] = client.deployments.get(name, timeout=5).status
                        endpoints[name] = self.serving_endpoints(name)
                    replicas = [
                        replica
                        for agent in agents
                        for replica in agent.ListReplicas(
                            nodeagent_pb2.ListReplicasRequest(), timeout=5
                        ).replicas
                    ]
                except grpc.RpcError as exc:  # a busy machine: ask again until the deadline
                    show(f"waiting for an answer ({exc.code().name})")
                    replicas, endpoints = [], {}
                except InferplaneError as exc:
                    show(f"waiting for an answer ({exc.reason})")
                    replicas, endpoints = [], {}
                for name, status in statuses.items():
                    show(f"deployment {name}: {status.phase} ({status.message})")
                for replica in replicas:
                    rid = replica.name.removeprefix("replicas/")
                    state = nodeagent_pb2.Replica.State.Name(replica.state)
                    show(f"replica {rid}: {state.removeprefix('STATE_').lower()}")
                    if replica.state == nodeagent_pb2.Replica.STATE_FAILED:
                        raise StackError(
                            f"the engine of {rid} failed to start: {replica.last_error}"
                        )
                for serving in endpoints.values():
                    for endpoint in serving:
                        show(f"replica {endpoint.replica_id} is in the routing table")
                if endpoints and all(len(endpoints[n]) >= k for n, k in wanted.items()):
                    return [e for serving in endpoints.values() for e in serving]
                if time.monotonic() > deadline:
                    counts = ", ".join(
                        f"{len(endpoints.get(n, []))} of {k} {n} ({statuses[n].phase}: "
                        f"{statuses[n].message})"
                        for n, k in wanted.items()
                    )
                    raise StackError(
                        f"replicas routable after {cfg.startup_timeout_seconds:.0f} s: {counts}; "
                        f"logs in {cfg.data_dir / 'logs'}"
                    )
                time.sleep(0.5)

    def _wait_admitting(
        self, endpoints: Sequence[orchestrator_pb2.RouteEndpoint], progress: Progress
    ) -> None:
        """Waits until every router that shares caps holds its lease and the routers' shares
        of each capped replica add up to its cap (`_admitting.admission_gap`), reading their
        `/metrics`. An orchestrator that adopted no grants gives none for 16 s after it
        started leading (services/router/README.md, "Shared caps"), so this ends at most
        that long after the orchestrator started, plus a lease renewal (3 s).

        Raises:
            StackError: a component exited, or the routers still did not admit after 60 s.
        """
        cfg = self.config
        deadline = time.monotonic() + ADMITTING_TIMEOUT_SECONDS
        shown = ""
        while True:
            self._raise_if_dead()
            routers: dict[str, RouterCaps] = {}
            gap = ""
            for name in cfg.router_names:
                url = f"http://{cfg.host_address(name)}:{cfg.metrics_ports[name]}/metrics"
                try:
                    with urllib.request.urlopen(url, timeout=2) as answer:
                        routers[name] = parse_router_caps(answer.read().decode())
                except (OSError, ValueError) as exc:  # a busy machine: ask again
                    gap = f"{name}'s metrics at {url} did not answer ({exc})"
                    break
            gap = gap or admission_gap(routers, endpoints)
            if not gap:
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"the routers did not admit requests within "
                    f"{ADMITTING_TIMEOUT_SECONDS:.0f} s: {gap}; logs in {cfg.data_dir / 'logs'}"
                )
            if gap != shown:
                shown = gap
                progress(f"waiting for the routers to admit: {gap}")
            time.sleep(0.25)

    # -- helpers for users of a running stack ------------------------------------------------

    def serving_endpoints(self, model: str = MODEL_NAME) -> list[orchestrator_pb2.RouteEndpoint]:
        """The replicas of `model` (kimi-tiny by default) the routing table lists as serving
        (not draining), read from the orchestrator's `WatchRoutingTable` (its first message is
        the whole table).

        Raises:
            grpc.RpcError: the orchestrator did not answer within 5 s.
        """
        with self.config.security.channel(self.config.address("orchestrator")) as channel:
            call = orchestrator_pb2_grpc.RoutingServiceStub(channel).WatchRoutingTable(
                orchestrator_pb2.WatchRoutingTableRequest(models=[model]), timeout=5
            )
            try:
                table = next(iter(call))
            finally:
                call.cancel()  # type: ignore[no-untyped-call]
        return [e for r in table.routes if r.model == model for e in r.endpoints if not e.draining]

    def serving_replica(self) -> nodeagent_pb2.Replica:
        """The node-agent's view (id, state, engine pid, metrics URL, spec...) of the first
        serving kimi-tiny replica. Replica ids carry the revision: look them up, never assume.

        Raises:
            StackError: no replica is serving. grpc.RpcError: a service did not answer.
        """
        endpoints = self.serving_endpoints()
        if not endpoints:
            raise StackError(f"no {MODEL_NAME} replica is serving")
        return self.replica(endpoints[0].replica_id)

    def replica(self, replica_id: str) -> nodeagent_pb2.Replica:
        """The node-agent's view of replica `replica_id`.

        Raises:
            grpc.RpcError: NOT_FOUND when no node-agent knows the id, or a node-agent did not
                answer.
        """
        agents = list(self.config.node_agents)
        for agent in agents:
            with self.config.security.channel(self.config.address(agent)) as channel:
                try:
                    return (
                        nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
                        .GetReplica(
                            nodeagent_pb2.GetReplicaRequest(name=f"replicas/{replica_id}"),
                            timeout=5,
                        )
                        .replica
                    )
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND or agent == agents[-1]:
                        raise
        raise AssertionError("unreachable: config.nodes is never empty")

    def _ensure_benchmark_key(self) -> None:
        """The performance gate's operator key (scopes inference and admin: the edge honours
        its revision pin), created once and kept in `benchmark_key_file` (0600), which the
        orchestrator reads when a release runs the gate."""
        path = benchmark_key_file(self.config.data_dir)
        if path.exists() or not self.admin_key:
            return
        secret = self.create_api_key("performance gate", scopes=("inference", "admin"))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(secret + "\n")

    def create_api_key(
        self, display_name: str = "local", scopes: tuple[str, ...] = ("inference",), **fields: Any
    ) -> str:
        """Creates a key through ApiKeyService with the bootstrap admin key; returns its secret."""
        if not self.admin_key:
            raise ConfigError("no bootstrap admin key was found in the auth data directory")
        key = auth_pb2.ApiKey(
            display_name=display_name, tenant="local", scopes=list(scopes), **fields
        )
        with Client(
            auth=self.config.address("auth"),
            security=self.config.security,
            admin_key=self.admin_key,
            timeout=10,
        ) as client:
            return client.keys.create(key).secret


@contextlib.contextmanager
def running_stack(config: StackConfig, progress: Progress = lambda _m: None) -> Iterator[Stack]:
    """Starts a stack and stops it when the block ends, however it ends."""
    stack = Stack(config)
    stack.start(progress)
    try:
        yield stack
    finally:
        stack.stop()
