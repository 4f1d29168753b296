"""Starting and watching a local stack's processes: each service's command line
(`python -m inferplane.<service>` with its ports, identity and peers), the local CA and every
identity's certificate, the web console, Envoy from the ADS bootstrap, and the waits between
them (gRPC health, the console's health page, Envoy's replicas cluster). `Stack` builds its
life cycle on these steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import ssl
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.edge import REPLICAS_CLUSTER, EnvoyProcess, EnvoyStartError, render_ads_bootstrap
from inferplane.fixtures._fixtures import MODELS_DIR
from inferplane.localstack._config import (
    EDGE_NODE_ID,
    EDGE_PROCESS,
    Progress,
    StackConfig,
    StackError,
    service_of,
)
from inferplane.localstack._process import HostedEnvoy, ManagedProcess
from inferplane.runtime.processes.ports import free_port, port_is_free
from inferplane.runtime.security.identity import EDGE, IDENTITIES
from inferplane.runtime.security.pki import LocalCA

#: Auth's pepper file in its data directory (`inferplane.auth.settings.PEPPER_FILE`).
AUTH_PEPPER_FILE = "auth-pepper"


def ensure_auth_pepper(auth_dir: Path) -> Path:
    """`<auth_dir>/auth-pepper`, made once as auth would make it (64 hex characters, mode
    0600, the folder 0700) when missing: auth reads it from its data directory, the routers
    get its path (`--auth-pepper-file`). An existing file is kept (the keys are hashed with
    it)."""
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = auth_dir / AUTH_PEPPER_FILE
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def benchmark_key_file(data_dir: Path) -> Path:
    """Where the stack keeps the performance gate's operator key (scopes inference and admin;
    mode 0600), which the orchestrator reads at each gate run."""
    return data_dir / "orchestrator" / "benchmark-api-key"


@dataclasses.dataclass(slots=True)
class Launcher:
    """A stack's processes and how each starts and is waited for (`Stack` adds the order,
    the deployments and the queries).

    Attributes:
        config: the stack's configuration (`_start_edge` may replace `envoy_admin_port`).
        processes: process name → its `ManagedProcess`, in start order.
        edge: Envoy once started, else None.
        admin_key: auth's bootstrap admin key, read from `<data_dir>/auth` once auth started.
        console_port: the web console's port (`StackConfig.console_port`, or one chosen).
    """

    config: StackConfig
    processes: dict[str, ManagedProcess] = dataclasses.field(default_factory=dict)
    edge: EnvoyProcess | None = None
    admin_key: str = ""
    console_port: int = 0

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
            *_tracing_args(cfg),
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
            # The edge's access log of routed requests: the edge overhead metric.
            "--edge-telemetry-address",
            cfg.address("telemetry"),
            "--edge-listen-host",
            cfg.host_address(EDGE_PROCESS),
            "--edge-listen-port",
            str(cfg.http_port),
            "--edge-node-id",
            EDGE_NODE_ID,
            *(["--edge-region", cfg.region] if cfg.region else []),
            "--warmup-timeout-seconds",
            str(cfg.warmup_timeout_seconds),
            # LoRA adapters' sources must lie here (the fixture adapter is in models/).
            "--lora-root",
            str(cfg.lora_root or MODELS_DIR),
            # Its open streams (heartbeats, table watches) would hold the default 10 s grace.
            "--grace-period-seconds",
            "2",
            # The performance gate's way in (issue 30): the edge, with an operator key the
            # stack writes once auth is up (`Stack._ensure_benchmark_key`).
            "--benchmark-edge-url",
            cfg.base_url,
            "--benchmark-api-key-file",
            str(benchmark_key_file(data).resolve()),
            *(["--benchmark-ca-path", str(cfg.ca_path.resolve())] if cfg.ca_path else []),
        )
        # Node-agents and routers connect to it at once (their retries back off).
        self._wait_healthy("orchestrator", progress)
        progress("starting auth, the node-agent and the router")
        # One pepper for auth and every router: auth hashes keys with it, the routers hash a
        # request's key with it to find it in the key table auth streams them.
        pepper_file = ensure_auth_pepper(data / "auth")
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
                # The replicas store the Responses API's stored responses in auth.
                "--response-store-address",
                cfg.address("auth"),
                "--engine-startup-timeout-seconds",
                str(cfg.startup_timeout_seconds),
                *_fake_engine_args(cfg),
                *_engine_env_args(),
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
                "--auth-pepper-file",
                str(pepper_file.resolve()),
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
            else HostedEnvoy(bootstrap, host=host, **where)
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


def _fake_engine_args(cfg: StackConfig) -> list[str]:
    """The node-agent's `--engine-command` running the fake vLLM HTTP engine at
    `cfg.fake_engine_token_delay` seconds per token (none when 0): the engine its
    `http-completions` replicas spawn (the node-agent splits the list at commas).

    Raises:
        StackError: a fake engine was asked for with a chat transport other than
            `http-completions` (the one transport the fake serves).
    """
    if cfg.fake_engine_token_delay <= 0:
        return []
    if cfg.chat and cfg.transport != "http-completions":
        raise StackError(
            f"fake_engine_token_delay needs transport 'http-completions' (got {cfg.transport!r}):"
            " the fake engine is vLLM's HTTP server only"
        )
    command = (
        sys.executable, "-m", "inferplane.testing.fake_http_engine",
        "--token-delay", f"{cfg.fake_engine_token_delay:g}",
    )  # fmt: skip
    return ["--engine-command", ",".join(command)]


def _engine_env_args() -> list[str]:
    """The node-agent's `--engine-envs`: every engine environment setup built beside the
    default one (`.venv-engines/<name>`, from engines/<name>.lock: engines/README.md), so a
    profile's `engine_version` can select it; none when there is none."""
    root = MODELS_DIR.parent / ".venv-engines"
    envs = sorted(env for env in root.glob("*") if (env / "bin" / "python").is_file())
    return ["--engine-envs", ",".join(str(env) for env in envs)] if envs else []


def _tracing_args(cfg: StackConfig) -> list[str]:
    """Every service's tracing flags (`ServiceSettings.otlp_traces_endpoint` and
    `trace_sampling_ratio`): the node-agent passes them on to its replica processes, the
    orchestrator to the edge; none when `cfg.otlp_traces_endpoint` is ""."""
    if not cfg.otlp_traces_endpoint:
        return []
    return [
        "--otlp-traces-endpoint",
        cfg.otlp_traces_endpoint,
        "--trace-sampling-ratio",
        f"{cfg.trace_sampling_ratio:g}",
    ]
