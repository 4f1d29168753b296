"""What a local stack is made of and where it listens: the fixture models' served names, the
process names (`service_of`), `StackHost` (a network namespace and address a process runs in)
and `StackConfig` (ports, data directory, the deployments' options, TLS, hosts).

Process names: one per service (`auth`, `router`, `orchestrator`, `node_agent`, `telemetry`,
`console`), further routers and node-agents as `router_2`, `node_agent_2`..., and Envoy as
`EDGE_PROCESS`. gRPC ports are `grpc_base_port + i` in `StackConfig.ports`' order, metrics
ports `metrics_base_port + i` in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from inferplane.fixtures import embed_tiny, kimi_tiny, qwen3_tiny, whisper_tiny
from inferplane.runtime.security.identity import ADMIN, PeerSecurity
from inferplane.runtime.security.pki import LocalCA
from inferplane.runtime.tracing import DEFAULT_SAMPLING_RATIO

Progress = Callable[[str], None]

MODEL_NAME = kimi_tiny.SERVED_MODEL_NAME
QWEN3_MODEL_NAME = qwen3_tiny.SERVED_MODEL_NAME
EMBED_MODEL_NAME = embed_tiny.SERVED_MODEL_NAME
SPEECH_MODEL_NAME = whisper_tiny.SERVED_MODEL_NAME
NODE_NAME = "local"
EDGE_NODE_ID = "inferplane-edge"
# The services with one process each; more routers and node-agents follow as `router_2`,
# `node_agent_2`... (`StackConfig.routers`, `StackConfig.nodes`).
SERVICES = ("auth", "router", "orchestrator", "node_agent", "telemetry")
EDGE_PROCESS = "edge"


#: The kimi-tiny deployment's sampling defaults under `inferplane up` (`StackConfig.
#: sampling_defaults`): coding agents send no sampling fields (Claude Code none at all), and at
#: the neutral defaults the fixture, far outside its trained prompts, loops until the agent's
#: token cap; with this penalty its answers end (docs/agents.md). A request's own value wins.
UP_SAMPLING_DEFAULTS: Mapping[str, float | int] = {"repetition_penalty": 1.3}


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
        sampling_defaults: the kimi-tiny profile's sampling defaults (parameter → value, names
            of `inferplane.nodeagent.v1.SamplingDefaults`: vLLM's
            `--override-generation-config`), which a request that omits a parameter gets;
            empty (the default): none, the model's generation_config and the engine's neutral
            values decide. `inferplane up` sets `UP_SAMPLING_DEFAULTS`.
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
        qwen3: also serve qwen3-tiny (`QWEN3_MODEL_NAME`, one `inproc` replica), the Qwen3 chat
            family beside kimi-tiny's Kimi K2 (`inferplane up` turns it on).
        max_model_len: the chat deployments' context length in tokens (prompt + completion),
            kimi-tiny's and qwen3-tiny's alike; at most the models' position limit
            (`kimi_tiny.MAX_POSITIONS`, 131,072). The default, the whole limit, holds a coding
            agent's prompt; it costs an engine no start-up time, and memory only through the
            KV budget (`expected_context_tokens`; vLLM prefills in chunks;
            docs/long-context.md).
        expected_context_tokens: tokens per sequence kimi-tiny's KV budget is sized for (the
            profile's `expected_context_tokens`): placement's budget is `max_num_seqs` × this
            × 1 KiB (kimi-tiny's fp32 KV), passed to vLLM in bytes
            (`--kv-cache-memory-bytes`). 0: `min(max_model_len, 65,536)`, 1 GiB at the
            defaults (16 sequences). Small values make a KV cache that fills (the KV-fit
            admission test); the budget never drops below one `max_model_len` sequence
            (the orchestrator's sizing floor, vLLM's start-up check).
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
        fake_engine_token_delay: above 0, every node-agent runs the fake vLLM HTTP engine
            (`inferplane.testing.fake_http_engine`: one token every this many seconds per
            request, deterministic tokens, no model computation) as the engine of its
            `http-completions` replicas, in place of vLLM; the kimi-tiny deployment must then
            use `transport="http-completions"` (its replica process still renders and
            tokenizes with the fixture's tokenizer). A replica's rate is then fixed:
            `max_num_seqs` streams (the router's cap) of one token per delay each. For
            benchmarks and tests of the control plane (autoscaling, cold starts) that two
            cores cannot show with real engines; 0 (the default): vLLM.
        max_loras / max_lora_rank: the kimi-tiny profile's LoRA settings (issue 29: adapters it
            may hold at once, their largest rank; 0 / 0, the default: LoRA off). Adapters are
            then created through the orchestrator's API (`CreateAdapter`) from folders under
            `lora_root`.
        lora_root: the orchestrator's allow-listed adapter root (`--lora-root`); None: the
            repository's `models/` folder, where the fixture adapter `kimi-tiny-lora` lives.
        otlp_traces_endpoint: an OpenTelemetry collector (OTLP/gRPC `host:port`) every
            service, each replica process (through its node-agent) and the edge (through the
            orchestrator) export their spans to, at `trace_sampling_ratio` (0..1) of the traces
            they start; "" (the default): no tracing (docs/tracing.md).
        region: the region this stack is (a cell behind the global tier, docs/regions.md);
            its edge serves it (passed to the orchestrator as `--edge-region`:
            `EdgeConfig.region`, the edge's ready route `regions.REGION_READY_PATH` and its
            `x-inferplane-region` header); "" (the default): a single-cell stack.
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
    sampling_defaults: Mapping[str, float | int] = dataclasses.field(default_factory=dict)
    service_args: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    tls: bool = False
    tls_cert_days: int = 30
    plaintext: bool = False
    embeddings: bool = False
    speech: bool = False
    chat: bool = True
    qwen3: bool = False
    max_model_len: int = kimi_tiny.MAX_MODEL_LEN
    expected_context_tokens: int = 0
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_root: Path | None = None
    nodes: tuple[str, ...] = (NODE_NAME,)
    routers: int = 1
    hosts: Mapping[str, StackHost] = dataclasses.field(default_factory=dict)
    console_port: int = 0
    otlp_traces_endpoint: str = ""
    trace_sampling_ratio: float = DEFAULT_SAMPLING_RATIO
    fake_engine_token_delay: float = 0.0
    region: str = ""

    @property
    def ports(self) -> dict[str, int]:
        """Each process's gRPC port: the five services at `grpc_base_port + 0..4`, then any
        further routers and node-agents (`router_2`..., `node_agent_2`...)."""
        names = list(SERVICES)
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
