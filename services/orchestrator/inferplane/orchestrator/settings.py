"""Settings of the orchestrator service (see `inferplane.runtime.load_settings` for precedence)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inferplane.runtime import ServiceSettings


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OrchestratorSettings(ServiceSettings):
    """Settings of the orchestrator service; defaults suit a local stack on loopback.

    Attributes:
        data_dir: where the SQLite database lives (created when missing; `~` is expanded).
        database_url: SQLAlchemy URL; empty means `sqlite:///<data_dir>/orchestrator.db`.
            PostgreSQL: `postgresql+psycopg://user:password@host:5432/dbname`.
        placement_policy: placement policy name (`best_fit_spread`).
        heartbeat_interval_seconds: how often node-agents are told to heartbeat.
        missed_heartbeats: a node missing this many intervals becomes NotReady.
        sweep_interval_seconds: how often liveness is checked.
        overhead_bytes_per_device: fixed memory margin per replica per device (bytes).
        overhead_fraction: proportional margin on weights + KV per device.
        cpu_usable_memory_fraction: share of a CPU node's host memory replicas may reserve.
        reconcile: run the reconcile loop (start/stop replicas on node-agents, rollouts).
        reconcile_interval_seconds: time between reconcile ticks when nothing changes.
        drain_propagation_seconds: a retired replica is marked draining in the routing table
            this long before DrainReplica (routers must see the table first).
        node_agent_timeout_seconds: deadline of one control call to a node-agent.
        node_agent_observe_timeout_seconds: how long a reconcile tick waits for a node-agent's
            replica list; a silent node then counts as unreachable for that tick instead of
            holding the tick and the routing table (`ReconcileSettings`).
        warmup_timeout_seconds: deadline of one warm-up request (a new engine's first request).
        gate_probe_interval_seconds: the gate sends one probe request this often in its window.
        edge_routers: router instances (`host:port`) the edge's EDS lists; empty: no xDS
            snapshot is published (the ADS service still answers and waits).
        edge_auth_address: the auth service (`host:port`) for ext_authz and the admin API.
        edge_console_address: the web console (`host:port`) the edge routes `/console/` to;
            empty: no console route.
        edge_node_id: Envoy node id of the edge (its bootstrap must use the same).
        edge_listen_host / edge_listen_port: where the edge's listener binds.
        edge_region: the region the edge serves behind the global tier (`EdgeConfig.region`:
            its ready route for the tier, the served-region response header); "": a
            single-cell edge.
        edge_tls_cert_path / edge_tls_key_path: PEM certificate chain and key files (on the
            edge's machine: Envoy reads them) the edge's listener serves HTTPS with; both
            empty: plain HTTP. `inferplane up --tls` issues them from its local CA.
        edge_upstream_tls_dir: the edge's identity folder as Envoy's host sees it (`ca.crt`,
            `edge.crt`, `edge.key`): the clusters it pushes speak mutual TLS to the services;
            empty: plaintext (development only).
        edge_telemetry_address: the telemetry service (`host:port`) the edge streams the
            access log of routed requests to (the edge overhead metric); empty: no such log.
        edge_telemetry_internal_token: telemetry's `internal_token`, which the edge presents
            on that stream; "" = telemetry admits the edge by its certificate (mutual TLS)
            or as a loopback caller.
        leader_id: this orchestrator's id in the leader lease ("" = `hostname:pid`); unique
            among the orchestrators sharing the database.
        leader_lease_seconds: the lease duration d: a standby takes over from a leader whose
            lease it has not seen renewed for d seconds (`leadership.py`).
        leader_renew_seconds: the renew interval r (< d): the leader renews, and standbys
            read the lease, every r seconds. A new leader within d + r of the leader's death.
        autoscale: run the autoscaler (leader only; it touches only deployments with
            `autoscaling.enabled`; services/orchestrator/README.md, "Autoscaling").
        autoscale_interval_seconds: time between autoscaler ticks (a router's renewal that
            reports a request held for a cold start wakes it at once).
        autoscale_grace_seconds: requests queued at a router, or waiting in an engine, count
            as pressure (one replica more) once they waited this long.
        autoscale_ttft_window_seconds / autoscale_ttft_interval_seconds: TTFT p99 is read
            from telemetry over this window, at most this often per deployment (only for
            profiles with `ttft_slo_seconds`).
        telemetry_address: the telemetry service (`host:port`) the autoscaler reads TTFT p99
            from (`QueryLatency`), and a release's canary its revisions' figures; "" =
            `edge_telemetry_address`; both empty: no TTFT signal, and a canary cannot be
            judged (it rolls back).
        lora_root: the folder every LoRA adapter's source must lie in (`catalog/adapters.py`;
            `~` expanded, symlinks resolved); sent to LoRA replicas as `ReplicaSpec.lora_root`
            (the same path on the nodes). "" = `<data_dir>/lora`; the local stack passes its
            `models/` folder.
        benchmark_edge_url / benchmark_api_key_file: the performance gate's way in (issue 30,
            `release/performance.py`): the edge's OpenAI base URL and a file holding an API
            key with the `inference` and `admin` scopes (read at each run); either empty: no
            performance gate (a profile asking for it fails its release).
        benchmark_ca_path: the CA bundle of an https edge with a private CA ("" = the
            system's).
        benchmark_reports_dir: where the gate stores each run's report (environment and
            GuideLLM's JSON); "" = `<data_dir>/bench-reports`.
    """

    port: int = 50053
    data_dir: Path = Path("~/.local/share/inferplane")
    database_url: str = ""
    placement_policy: str = "best_fit_spread"
    heartbeat_interval_seconds: float = 10.0
    missed_heartbeats: int = 3
    sweep_interval_seconds: float = 5.0
    overhead_bytes_per_device: int = 2 * 2**30
    overhead_fraction: float = 0.05
    cpu_usable_memory_fraction: float = 0.8
    reconcile: bool = True
    reconcile_interval_seconds: float = 1.0
    drain_propagation_seconds: float = 1.0
    node_agent_timeout_seconds: float = 30.0
    node_agent_observe_timeout_seconds: float = 5.0
    warmup_timeout_seconds: float = 60.0
    gate_probe_interval_seconds: float = 1.0
    edge_routers: tuple[str, ...] = ()
    edge_auth_address: str = ""
    edge_console_address: str = ""
    edge_node_id: str = "inferplane-edge"
    edge_listen_host: str = "127.0.0.1"
    edge_listen_port: int = 8080
    edge_region: str = ""
    edge_tls_cert_path: str = ""
    edge_tls_key_path: str = ""
    edge_upstream_tls_dir: str = ""
    edge_telemetry_address: str = ""
    edge_telemetry_internal_token: str = dataclasses.field(default="", repr=False)
    leader_id: str = ""
    leader_lease_seconds: float = 10.0
    leader_renew_seconds: float = 3.0
    autoscale: bool = True
    autoscale_interval_seconds: float = 2.0
    autoscale_grace_seconds: float = 2.0
    autoscale_ttft_window_seconds: float = 60.0
    autoscale_ttft_interval_seconds: float = 15.0
    telemetry_address: str = ""
    lora_root: str = ""
    benchmark_edge_url: str = ""
    benchmark_api_key_file: str = ""
    benchmark_ca_path: str = ""
    benchmark_reports_dir: str = ""

    @property
    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def resolved_lora_root(self) -> str:
        return self.lora_root or str(self.resolved_data_dir / "lora")

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.resolved_data_dir / 'orchestrator.db'}"
