"""The local stack: every service, one node-agent, the kimi-tiny deployment, and Envoy, all
run on the control plane.

`Stack` is what `inferplane up` runs and what the end-to-end tests start once per session.
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
5. Envoy from the minimal ADS bootstrap: LIVE once the orchestrator pushed its config, and
   ready once its replicas cluster holds every routable replica process (the endpoint
   picker's lists name them; DESIGN.md, data path v2).

Layout of the data directory::

    <data_dir>/up.lock            held (flock) while a stack runs: a second `up` refuses
    <data_dir>/stack.json         ports and pids, for `inferplane status`
    <data_dir>/logs/<name>.log    each component's output (mode 0600, as every log here)
    <data_dir>/pki/               with `tls`: the local CA (`ca.crt`, `ca.key`) and the edge's
                                  certificate (`edge.crt`, `edge.key`); keys 0600
    <data_dir>/<name>/            each component's own state (auth and orchestrator databases,
                                  engine logs...); the orchestrator's catalogue survives an `up`
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import ssl
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.cli._process import ManagedProcess
from inferplane.cli._prometheus import engine_sd_file
from inferplane.edge import REPLICAS_CLUSTER, EnvoyProcess, EnvoyStartError, render_ads_bootstrap
from inferplane.fixtures import embed_tiny, kimi_tiny, whisper_tiny
from inferplane.runtime import AlreadyExistsError, ConfigError, InferplaneError
from inferplane.runtime.identity import ADMIN, EDGE, IDENTITIES, PeerSecurity
from inferplane.runtime.pki import LocalCA
from inferplane.runtime.ports import free_port, port_is_free
from inferplane.sdk import Client

Progress = Callable[[str], None]

MODEL_NAME = "kimi-tiny"
EMBED_MODEL_NAME = embed_tiny.SERVED_MODEL_NAME
SPEECH_MODEL_NAME = whisper_tiny.SERVED_MODEL_NAME
NODE_NAME = "local"
EDGE_NODE_ID = "inferplane-edge"
# The orchestrator stops before the node-agent: it must not restart replicas whose engines
# are going down with their node-agent.
_STOP_ORDER = ("console", "router", "telemetry", "orchestrator", "node_agent", "auth")
# The services with one process each; more routers and node-agents follow as `router_2`,
# `node_agent_2`... (`StackConfig.routers`, `StackConfig.nodes`).
_SERVICES = ("auth", "router", "orchestrator", "node_agent", "telemetry")
EDGE_PROCESS = "edge"


class StackError(Exception):
    """The stack could not start; the message names the component and shows its log tail."""


def service_of(process: str) -> str:
    """The service a stack process runs: `router_2` → `router`, `node_agent` → `node_agent`."""
    base, _, index = process.rpartition("_")
    return base if base and index.isdigit() else process


@dataclasses.dataclass(frozen=True, slots=True)
class StackHost:
    """A host a stack process runs on: a Linux network namespace (made by the caller, e.g.
    `ip netns add`) and the address the process binds there and its peers dial.

    The stack starts such a process under `ip netns exec NETNS` (needs root) with `--host
    ADDRESS` (the edge: its listener and admin API on ADDRESS), and its certificates carry
    every host's address, since most peers verify the address they dial. A process without a
    host runs on 127.0.0.1 in the caller's own namespace. Used by tests/multihost.
    """

    netns: str
    address: str

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class _HostedEnvoy(EnvoyProcess):
    """Envoy started inside a `StackHost`'s network namespace."""

    def __init__(self, bootstrap: str, *, host: StackHost, **kwargs: Any) -> None:
        super().__init__(bootstrap, **kwargs)
        self.host = host

    def command(self) -> list[str]:
        return self.host.wrap(super().command())


@dataclasses.dataclass(frozen=True, slots=True)
class StackConfig:
    """Where the stack lives and listens. Service ports are `grpc_base_port + 0..4`.

    Attributes:
        transport: the engine transport of the kimi-tiny deployment's replica process
            (`inproc`: vLLM's AsyncLLM in the replica process; `http-completions`: a vLLM HTTP
            server child, `/v1/completions` with token ids; `grpc`: a `vllm serve --grpc`
            child, its token-level `Generate`).
        startup_timeout_seconds: how long the first replica may take to become ready and
            routable (also each engine's start-up timeout in the node-agent).
        warmup_timeout_seconds: the orchestrator's deadline for a new replica's warm-up request.
        engine_env: extra environment of the node-agent, inherited by its engines (e.g.
            `VLLM_CPU_OMP_THREADS_BIND`; vLLM's CPU default pins every engine to core 0).
        replicas: replicas of the kimi-tiny deployment; start-up waits until all are routable.
        routing_policy: the deployment's routing policy ("" = the orchestrator's default).
        max_num_seqs: the profile's concurrent sequences per replica (also the router's
            per-replica admission cap).
        stream_interval: the profile's generated tokens per streamed chunk at least (vLLM's
            `--stream-interval`; 0 or 1: every token).
        constrain_tool_choice_auto: the profile's option of that name (`tool_choice: "auto"`
            decoded under the tool-call structural tag), on as in the catalogue's default.
        service_args: extra command-line flags per service name (a key of `ports`), e.g.
            `{"router": ("--queue-timeout-seconds", "1")}`.
        tls: the edge serves HTTPS with a certificate for localhost / 127.0.0.1 issued from
            the local CA in `<data_dir>/pki` (created once, then reused; clients trust
            `ca_path`); the leaf is valid `tls_cert_days` and re-issued at each start once a
            third of that is left.
        embeddings: also serve the embed-tiny embedding model (`EMBED_MODEL_NAME`, one replica,
            `inproc`) beside kimi-tiny.
        speech: also serve the whisper-tiny speech-to-text model (`SPEECH_MODEL_NAME`, one
            replica, `inproc`: vLLM's speech serving in the replica process).
        chat: serve kimi-tiny (off only for benchmarks of the other models alone).
        plaintext: the services talk plaintext gRPC without identities (development only);
            by default every service, Envoy toward them, and the stack's own admin calls use
            mutual TLS with certificates from the same local CA (`<data_dir>/pki`: `edge`,
            `auth`, `router`, `orchestrator`, `node-agent`, `telemetry`, `admin`), each valid
            `tls_cert_days` and re-issued at start once a third of that is left.
        nodes: one node-agent per node name (process `node_agent`, then `node_agent_2`...,
            each with its own data directory `node-agent[-<node>]`); start-up waits until
            all have registered.
        routers: router processes (`router`, `router_2`...), all in the edge's EDS;
            `service_args["router"]` applies to each, as a service's args apply to all its
            processes.
        hosts: process name (a key of `ports`, or `EDGE_PROCESS` for Envoy) → the
            `StackHost` (network namespace and address) it runs on; absent: 127.0.0.1 here.
        console_port: the web console's port on 127.0.0.1 (`services/console`; HTTPS with
            client certificates unless `plaintext`); 0: a free port chosen at start
            (`Stack.console_port`). Browsers reach it through the edge at `console_url`.
    """

    data_dir: Path
    http_port: int = 8080
    grpc_base_port: int = 50051
    metrics_base_port: int = 50151
    envoy_admin_port: int = 9901
    model_path: Path = dataclasses.field(default_factory=lambda: kimi_tiny.model_path())
    transport: str = "inproc"
    startup_timeout_seconds: float = 300.0
    warmup_timeout_seconds: float = 120.0
    engine_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    replicas: int = 1
    routing_policy: str = ""
    max_num_seqs: int = 16
    stream_interval: int = 0
    constrain_tool_choice_auto: bool = True
    service_args: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    tls: bool = False
    tls_cert_days: int = 30
    plaintext: bool = False
    embeddings: bool = False
    speech: bool = False
    chat: bool = True
    nodes: tuple[str, ...] = (NODE_NAME,)
    routers: int = 1
    hosts: Mapping[str, StackHost] = dataclasses.field(default_factory=dict)
    console_port: int = 0

    @property
    def ports(self) -> dict[str, int]:
        """Each process's gRPC port: the five services at `grpc_base_port + 0..4`, then any
        further routers and node-agents (`router_2`..., `node_agent_2`...)."""
        names = list(_SERVICES)
        names += [f"router_{k}" for k in range(2, self.routers + 1)]
        names += [f"node_agent_{k}" for k in range(2, len(self.nodes) + 1)]
        return {name: self.grpc_base_port + i for i, name in enumerate(names)}

    @property
    def node_agents(self) -> dict[str, str]:
        """Node-agent process name → the node it runs (`nodes`, in order)."""
        return {
            ("node_agent" if k == 1 else f"node_agent_{k}"): node
            for k, node in enumerate(self.nodes, start=1)
        }

    @property
    def router_names(self) -> list[str]:
        """The router processes: `router`, `router_2`..."""
        return ["router", *(f"router_{k}" for k in range(2, self.routers + 1))]

    def host_address(self, name: str) -> str:
        """The address process `name` (a key of `ports`, or `EDGE_PROCESS`) binds and is
        dialled at: its `hosts` entry's, else 127.0.0.1."""
        host = self.hosts.get(name)
        return host.address if host is not None else "127.0.0.1"

    @property
    def metrics_ports(self) -> dict[str, int]:
        return {name: self.metrics_base_port + i for i, name in enumerate(self.ports)}

    @property
    def base_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host_address(EDGE_PROCESS)}:{self.http_port}/v1"

    @property
    def console_url(self) -> str:
        """The web console's URL, through the edge."""
        return self.base_url.removesuffix("/v1") + "/console/"

    @property
    def pki_dir(self) -> Path:
        return self.data_dir / "pki"

    @property
    def security(self) -> PeerSecurity:
        """The admin identity the stack (and `inferplane status`) calls the services with."""
        return (
            PeerSecurity.plaintext(ADMIN) if self.plaintext else PeerSecurity(self.pki_dir, ADMIN)
        )

    @property
    def ca_path(self) -> Path | None:
        """The CA certificate clients must trust (`tls`), else None."""
        return LocalCA(self.pki_dir).cert_path if self.tls else None

    def address(self, name: str) -> str:
        """`host:port` of process `name` (a key of `ports`): 127.0.0.1 unless `hosts` names
        its host."""
        return f"{self.host_address(name)}:{self.ports[name]}"


def kimi_tiny_deployment(config: StackConfig) -> orchestrator_pb2.Deployment:
    """The kimi-tiny deployment the stack creates: `config.replicas` CPU replicas (`engine:
    vllm-cpu`, fp32), the Kimi K2 parsers, `config.transport`, `config.routing_policy`,
    `config.max_num_seqs`, `config.stream_interval`, `config.constrain_tool_choice_auto`, one
    surge replica per rollout.

    Sizing numbers (layers, KV heads, head dim) come from the model's `config.json`, the
    parameter count from its `MANIFEST.json` (else the fp32 weights file size / 4 bytes).

    Raises:
        StackError: the model folder has no readable `config.json`.
    """
    model = config.model_path
    try:
        arch = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StackError(f"cannot read the fixture model's config.json in {model}: {exc}") from exc
    heads = int(arch["num_attention_heads"])
    parameters = 0
    with contextlib.suppress(OSError, ValueError, KeyError):
        parameters = int(json.loads((model / "MANIFEST.json").read_text())["parameters"])
    if not parameters:
        parameters = (model / "model.safetensors").stat().st_size // 4
    return orchestrator_pb2.Deployment(
        replicas=config.replicas,
        owned_by="inferplane",
        routing_policy=config.routing_policy,
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=parameters,
            num_layers=int(arch["num_hidden_layers"]),
            num_kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(arch.get("head_dim") or int(arch["hidden_size"]) // heads),
            max_model_len=2048,
            # The router caps in-flight requests per replica at this; the default 16 lets the
            # edge benchmark's concurrency-16 level run unqueued.
            max_num_seqs=config.max_num_seqs,
            reasoning_parser="kimi_k2",
            tool_parser="kimi_k2",
            transport=config.transport,
            stream_interval=config.stream_interval,
            constrain_tool_choice_auto=config.constrain_tool_choice_auto,
        ),
        rollout=orchestrator_pb2.RolloutStrategy(max_surge=1, drain_grace_period_seconds=30),
    )


def embed_tiny_deployment() -> orchestrator_pb2.Deployment:
    """The embed-tiny deployment (`config.embeddings`): one CPU replica of the fixture
    embedding model, task "embed", `inproc` (vLLM's pooling runner), least-load routing."""
    model = embed_tiny.model_path()
    manifest: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((model / "MANIFEST.json").read_text())
    return orchestrator_pb2.Deployment(
        replicas=1,
        owned_by="inferplane",
        routing_policy="least_load",
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=int(manifest.get("parameters") or 0) or 1,
            max_model_len=embed_tiny.MAX_MODEL_LEN,
            max_num_seqs=16,
            transport="inproc",
            task="embed",
        ),
    )


def whisper_tiny_deployment() -> orchestrator_pb2.Deployment:
    """The whisper-tiny deployment (`config.speech`): one CPU replica of the fixture speech
    model, task "transcribe", `inproc`, float32, least-load routing; placement sizes its
    decoder's KV cache (Whisper's decoder layers and heads, 448 positions)."""
    model = whisper_tiny.model_path()
    manifest: dict[str, Any] = {}
    arch: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((model / "MANIFEST.json").read_text())
        arch = json.loads((model / "config.json").read_text())
    heads = int(arch.get("decoder_attention_heads") or 1)
    return orchestrator_pb2.Deployment(
        replicas=1,
        owned_by="inferplane",
        routing_policy="least_load",
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=int(manifest.get("parameters") or 0) or 1,
            num_layers=int(arch.get("decoder_layers") or 1),
            num_kv_heads=heads,
            head_dim=int(arch.get("d_model") or heads) // heads,
            max_model_len=whisper_tiny.MAX_MODEL_LEN,
            max_num_seqs=16,
            transport="inproc",
            task="transcribe",
        ),
    )


@dataclasses.dataclass(slots=True)
class Stack:
    """Starts and stops the components in dependency order."""

    config: StackConfig
    processes: dict[str, ManagedProcess] = dataclasses.field(default_factory=dict)
    edge: EnvoyProcess | None = None
    admin_key: str = ""
    console_port: int = 0  # the web console's port (`StackConfig.console_port`, or chosen)
    _lock: IO[str] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, progress: Progress = lambda _msg: None) -> None:
        """Starts everything; returns once the model answers through the router and Envoy is
        LIVE with the configuration the orchestrator pushed.

        Raises:
            StackError: a stack already runs in this data directory, a component exited or
                was not healthy in time, the orchestrator refused the deployment, or the
                replica failed / was not routable within `startup_timeout_seconds`.
        """
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self.console_port = cfg.console_port or free_port()
        try:
            self._start_services(progress)
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

    def _service(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        cfg = self.config
        service = service_of(name)
        host = cfg.hosts.get(name)
        argv = [
            sys.executable,
            "-m",
            f"inferplane.{service}",
            "--port",
            str(cfg.ports[name]),
            "--metrics-port",
            str(cfg.metrics_ports[name]),
            *(["--host", host.address] if host is not None else []),
            "--no-json-logs",
            *(["--plaintext"] if cfg.plaintext else ["--tls-dir", str(cfg.pki_dir.resolve())]),
            *args,
            *cfg.service_args.get(service, ()),
        ]
        if host is not None:
            argv = host.wrap(argv)
        proc = ManagedProcess(
            name,
            argv,
            log_path=cfg.data_dir / "logs" / f"{name}.log",
            env={**os.environ, **(env or {})},
        )
        proc.start()
        self.processes[name] = proc

    def _edge_tls_args(self, progress: Progress) -> list[str]:
        """The local CA (created or reused) and every identity's certificate (unless
        `plaintext`); then the orchestrator's edge flags: its upstream identity folder and,
        with `tls`, the edge's HTTPS certificate (the `edge` one: localhost / 127.0.0.1)."""
        cfg = self.config
        if not cfg.tls and cfg.plaintext:
            return []
        hosted = sorted({host.address for host in cfg.hosts.values()})
        try:
            ca = LocalCA.ensure(cfg.pki_dir)
            leaves = {
                name: ca.issue(
                    name,
                    # The identity itself too: peers dialled by address are checked by it.
                    dns_names=("localhost", name),
                    # And every host's address (`hosts`): most peers check what they dial.
                    ip_addresses=("127.0.0.1", "::1", *hosted),
                    days=cfg.tls_cert_days,
                )
                for name in ((EDGE,) if cfg.plaintext else IDENTITIES)
            }
        except (OSError, ValueError) as exc:
            raise StackError(f"cannot create certificates in {cfg.pki_dir}: {exc}") from exc
        edge = leaves[EDGE]
        progress(f"certificates valid until {edge.not_after:%Y-%m-%d}; CA {ca.cert_path}")
        args = [] if cfg.plaintext else ["--edge-upstream-tls-dir", str(cfg.pki_dir.resolve())]
        if cfg.tls:
            args += [
                "--edge-tls-cert-path",
                str(edge.cert_path.resolve()),
                "--edge-tls-key-path",
                str(edge.key_path.resolve()),
            ]
        return args

    def _start_services(self, progress: Progress) -> None:
        cfg = self.config
        data = cfg.data_dir
        tls_args = self._edge_tls_args(progress)
        progress("starting the orchestrator (catalogue, placement, routing table, xDS)")
        self._service(
            "orchestrator",
            *tls_args,
            "--data-dir",
            str(data / "orchestrator"),
            "--edge-routers",
            ",".join(cfg.address(r) for r in cfg.router_names),
            "--edge-auth-address",
            cfg.address("auth"),
            "--edge-console-address",
            f"127.0.0.1:{self.console_port}",
            "--edge-listen-host",
            cfg.host_address(EDGE_PROCESS),
            "--edge-listen-port",
            str(cfg.http_port),
            "--edge-node-id",
            EDGE_NODE_ID,
            "--warmup-timeout-seconds",
            str(cfg.warmup_timeout_seconds),
            # Its open streams (heartbeats, table watches) would hold the default 10 s grace.
            "--grace-period-seconds",
            "2",
        )
        # Node-agents and routers connect to it at once (their retries back off).
        self._wait_healthy("orchestrator", progress)
        progress("starting auth, the node-agent and the router")
        self._service("auth", "--data-dir", str(data / "auth"))
        for agent, node in cfg.node_agents.items():
            self._service(
                agent,
                "--data-dir",
                str(data / ("node-agent" if agent == "node_agent" else f"node-agent-{node}")),
                "--node-name",
                node,
                "--orchestrator-address",
                cfg.address("orchestrator"),
                "--telemetry-address",
                cfg.address("telemetry"),
                "--engine-startup-timeout-seconds",
                str(cfg.startup_timeout_seconds),
                env=dict(cfg.engine_env),
            )
        # Usage goes to auth (token limits, concurrency slots) and one record per request to
        # telemetry; both sinks buffer until their service is up (telemetry starts last).
        for router in cfg.router_names:
            self._service(
                router,
                "--orchestrator-address",
                cfg.address("orchestrator"),
                "--auth-address",
                cfg.address("auth"),
                "--telemetry-address",
                cfg.address("telemetry"),
                # Usage reports wait there while auth is away, and across a router restart.
                "--usage-spool-path",
                str(data / router.replace("_", "-") / "usage-spool.db"),
            )
        for name in ("auth", *cfg.node_agents, *cfg.router_names):
            self._wait_healthy(name, progress)
        key_file = data / "auth" / "bootstrap-admin-key"
        self.admin_key = key_file.read_text().strip() if key_file.exists() else ""

    def deployments(self) -> dict[str, tuple[orchestrator_pb2.Deployment, int]]:
        """The deployments this stack serves, by name, with the replicas each must have."""
        cfg = self.config
        wanted = {}
        if cfg.chat:
            wanted[MODEL_NAME] = (kimi_tiny_deployment(cfg), cfg.replicas)
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

    def _start_edge(self, progress: Progress) -> None:
        cfg = self.config
        host = cfg.hosts.get(EDGE_PROCESS)
        if host is None and not port_is_free(cfg.envoy_admin_port):
            # Drawn when the stack was configured, minutes ago; a replica's or an engine's port
            # drawn from the same range since may hold it. Only the stack uses Envoy's admin
            # port (the orchestrator never sees it): draw another rather than fail.
            self.config = cfg = dataclasses.replace(cfg, envoy_admin_port=free_port())
            progress(f"Envoy's admin port was taken meanwhile; using {cfg.envoy_admin_port}")
        progress("starting the Envoy edge (configured by the orchestrator over ADS)")
        admin_host = cfg.host_address(EDGE_PROCESS)
        bootstrap = render_ads_bootstrap(
            cfg.address("orchestrator"),
            node_id=EDGE_NODE_ID,
            admin_host=admin_host,
            admin_port=cfg.envoy_admin_port,
            upstream_tls_dir="" if cfg.plaintext else str(cfg.pki_dir.resolve()),
        )
        where: dict[str, Any] = {
            "data_dir": cfg.data_dir / "envoy",
            "admin_url": f"http://{admin_host}:{cfg.envoy_admin_port}",
        }
        self.edge = (
            EnvoyProcess(bootstrap, **where)
            if host is None
            else _HostedEnvoy(bootstrap, host=host, **where)
        )
        try:
            self.edge.start()
        except EnvoyStartError as exc:
            raise StackError(str(exc)) from exc

    def _wait_edge_routes(
        self, endpoints: Sequence[orchestrator_pb2.RouteEndpoint], progress: Progress
    ) -> None:
        """Waits until Envoy's replicas cluster holds every routable replica process (pushed by
        EDS from the routing table), so the first request can be sent where it is picked."""
        assert self.edge is not None
        wanted = {e.address for e in endpoints}
        deadline = time.monotonic() + 60
        while True:
            self._raise_if_dead()
            with contextlib.suppress(OSError):
                if wanted <= self.edge.cluster_hosts(REPLICAS_CLUSTER):
                    progress(f"edge is ready on {self.config.base_url}")
                    return
            if time.monotonic() > deadline:
                raise StackError(
                    f"Envoy's replicas cluster did not list {sorted(wanted)} in 60 s; "
                    f"see {self.edge.log_path}"
                )
            time.sleep(0.2)

    def _start_console(self, progress: Progress) -> None:
        """The web console (`python -m inferplane.console`), acting for its signed-in users'
        keys at auth and presenting the operator identity; waits for its health page."""
        cfg = self.config
        progress("starting the web console")
        security = [] if cfg.plaintext else ["--tls-dir", str(cfg.pki_dir.resolve())]
        edge_ca = ["--edge-ca-path", str(cfg.ca_path)] if cfg.ca_path else []
        argv = [
            sys.executable,
            "-m",
            "inferplane.console",
            "--port",
            str(self.console_port),
            "--no-json-logs",
            *(["--plaintext"] if cfg.plaintext else security),
            "--auth-address",
            cfg.address("auth"),
            "--orchestrator-address",
            cfg.address("orchestrator"),
            "--telemetry-address",
            cfg.address("telemetry"),
            "--edge-url",
            cfg.base_url.removesuffix("/v1"),
            *edge_ca,
            *cfg.service_args.get("console", ()),
        ]
        proc = ManagedProcess("console", argv, log_path=cfg.data_dir / "logs" / "console.log")
        proc.start()
        self.processes["console"] = proc
        context = None
        if not cfg.plaintext:
            # The console asks every client for a certificate of the CA (only the edge has one
            # besides operators): the check presents the admin identity's.
            sec = cfg.security
            context = ssl.create_default_context(cafile=str(sec.ca_path))
            context.check_hostname = False
            context.load_cert_chain(str(sec.cert_path), str(sec.key_path))
        scheme = "http" if context is None else "https"
        url = f"{scheme}://127.0.0.1:{self.console_port}/console/healthz"
        deadline = time.monotonic() + 60
        while True:
            if proc.exited() is not None:
                raise StackError(f"console exited at start-up:\n{proc.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"console did not answer {url} within 60 s:\n{proc.log_tail()}")
            time.sleep(0.2)

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

    def _wait_healthy(self, name: str, progress: Progress) -> None:
        address = self.config.address(name)
        deadline = time.monotonic() + 60
        with self.config.security.channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                code = self.processes[name].exited()
                if code is not None:
                    raise StackError(
                        f"{name} exited with code {code}:\n{self.processes[name].log_tail()}"
                    )
                with contextlib.suppress(grpc.RpcError):
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        progress(f"{name} is healthy on {address}")
                        return
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{name} did not become healthy in 60 s:\n{self.processes[name].log_tail()}"
                    )
                time.sleep(0.2)

    def _raise_if_dead(self) -> None:
        dead = self.dead_component()
        if dead:
            raise StackError(dead)

    def dead_component(self) -> str:
        """A sentence naming a component that exited on its own, or "" when all run."""
        for name, proc in self.processes.items():
            code = proc.exited()
            if code is not None:
                return f"{name} exited with code {code}:\n{proc.log_tail()}"
        if self.edge is not None and not self.edge.running:
            return f"envoy exited; see {self.edge.log_path}"
        return ""

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
