"""Settings of the router (see `inferplane.runtime.load_settings` for precedence)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inferplane.runtime import ConfigError, ServiceSettings


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(ServiceSettings):
    """Settings of the router; defaults suit a local stack on loopback.

    The routing table comes from the orchestrator's `RoutingService.WatchRoutingTable` at
    `orchestrator_address` when set (host:port; several orchestrators on one database
    comma-separated: the router's watch and lease follow the leader among them), else from
    `routes_file`, a static YAML table::

        models:
          - model: kimi-tiny
            owned_by: inferplane
            max_model_len: 2048
            routing_policy: prefix_affinity   # optional; default_policy when absent
            tokenizer: models/kimi-tiny       # optional; what precise_prefix tokenizes with
            endpoints:
              - {address: 127.0.0.1:50054, replica_id: kimi-tiny-0, max_concurrency: 8}

    Attributes:
        default_policy: routing policy of routes that name none (round_robin, least_load,
            power_of_two, prefix_affinity, precise_prefix, session_affinity).
        load_factor: c of consistent hashing with bounded loads (> 1; 1.25 is the paper's
            recommended trade-off between affinity and balance).
        default_max_concurrency: per-replica cap when the route gives none (requests).
        queue_timeout_seconds: longest wait for a slot before 429.
        max_queue_per_deployment: waiting requests per deployment before immediate 429s;
            one API key may hold about weight / (1 + weight) of it alone, less when others
            wait (fair share, services/router/README.md).
        retry_after_seconds: the Retry-After of an overload 429.
        cold_start_retry_after_seconds: the Retry-After of the 503 `deployment_cold_start`
            (a request held for a deployment at zero past its route's cold-start budget).
        max_cold_start_budget_seconds: the longest a request is held for a deployment at zero,
            whatever its route's budget says: the picker extends Envoy's message timer once,
            so keep it ≤ the edge's `picker_max_message_timeout_s` (180 s) minus
            `picker_timeout_margin_seconds`.
        breaker_failures / breaker_open_seconds: consecutive failures that open a replica's
            circuit breaker, and how long it stays open before one probe.
        prefix_block_bytes / prefix_max_blocks: prefix-affinity hashing granularity (bytes of
            serialized request per block, ~4 bytes a token) and the most blocks hashed.
        orchestrator_backoff_seconds / orchestrator_max_backoff_seconds: reconnect backoff of
            the routing-table watch (exponential, full jitter).
        shared_caps: with `orchestrator_address`, take this router's share of each replica's
            cap from the orchestrator and admit on it only under a lease (issue 20: N routers
            never admit more than a replica's cap together; services/router/README.md). Off:
            this router enforces whole caps alone, which is right only for a single router.
        router_id: this router's id towards the orchestrator ("" = `host name:port`, kept
            across restarts in place; two live routers must never share one).
        auth_address: auth (host:port): its `KeyTableService`, whose key table the picker
            authenticates requests with (`inferplane.router.key_source`; needs auth's pepper,
            below), and its `UsageService`: every keyed request's usage is written to the
            usage outbox when the request is concluded and delivered there in batches, off
            the request path (the usage ledger, token limits). Empty: no key table (it stays
            empty and never received) and usage logged only.
        auth_internal_token: sent as `x-inferplane-internal-token` (auth's `internal_token`;
            leave empty when auth accepts loopback callers).
        auth_pepper / auth_pepper_file: auth's pepper (at least 16 bytes; the file holds it
            as auth's `<data_dir>/auth-pepper` does), which the picker hashes a request's key
            with to look it up in the key table auth streams (`inferplane.router.key_source`,
            from `auth_address`). Required with `auth_address` (one of the two): the router
            never makes one up, since no key would ever match.
        key_table_heartbeat_seconds: the heartbeat interval asked of auth's key table watch.
        key_table_stale_seconds: how old the key table may get (no update from auth) before
            keys it does not know are refused with 503 `auth_unavailable` instead of 401.
        key_limit_window_seconds: the length of the per-key rate windows the picker enforces
            (`keylimits.KeyLimiter`; 60: limits are per minute; shorter only for tests that
            must see a window reset, like auth's `rate_window_seconds`).
        usage_buffer_capacity / usage_batch_size: usage reports waiting to be written to the
            outbox at most (without `usage_spool_path`: held in all), and sent per call.
        usage_flush_interval_seconds: the outbox appends (one fsync) at most this often, and
            a report waits at most this long before it is appended (seconds).
        usage_spool_path: the usage outbox's SQLite file (`inferplane.runtime.delivery.outbox`):
            every concluded request's report is written there before it is acknowledged and
            waits there while auth (or its database) is away, and across a restart of this
            router: nothing is dropped for an outage or a crash. Empty: memory only (a crash
            loses what auth does not have yet; beyond `usage_buffer_capacity` the newest are
            dropped and counted).
        telemetry_address: the telemetry service (host:port). Set: one request record per
            request (source "router"). Empty: no records.
        picker_fallbacks: endpoints the endpoint picker (`envoy.service.ext_proc.v3`
            ExternalProcessor, data path v2) lists after the primary, which Envoy tries in
            order when the primary fails before its first response byte; 0 = primary only.
        picker_keepalive_seconds: how long a request may wait in the admission queue before
            the picker extends Envoy's ext_proc message timer (`override_message_timeout`);
            must stay below the edge's ext_proc `message_timeout` (1 s).
        picker_timeout_margin_seconds: added to the remaining queue wait in that extension;
            the edge's ext_proc `max_message_timeout` must be at least
            `queue_timeout_seconds` + this margin, or Envoy ignores the extension.
        outcome_address: `host:port` where replicas reach this router's `OutcomeService` to
            report how the requests it picked ended ("" = `host:port`; set it when replicas
            must use another name or address, e.g. a pod IP).
        outcome_wait_seconds: how long a request whose trailers never reached the picker
            waits for its replica's report before it is recorded as aborted.
        gateway_port: a second endpoint-picker listener for conformant gateways (Gateway API
            Inference Extension: the InferencePool's `endpointPickerRef`), 0 = off. It takes
            the client's OpenAI request (`/v1/...`, JSON, buffered or FULL_DUPLEX_STREAMED)
            and answers `x-gateway-destination-endpoint` (picker.GatewayMode). Server TLS
            with this router's certificate and NO client certificate (a gateway's proxy has
            none; a NetworkPolicy restricts the port), plaintext when the router is.
        gateway_node_port: the node-local Envoy's port on every node (the pool's
            `targetPorts`): the gateway's destination is `<replica host>:gateway_node_port`.
        replica_state_watch: follow every replica's `WatchReplicaState` stream (engine
            state and KV events: `replica_watch.py`; one stream per replica): "auto" (on when
            the table comes from the orchestrator), "on" or "off". Off: no engine states,
            `precise_prefix` always uses its approximate table.
        replica_state_idle_seconds: a replica's state stream quiet this long is reopened (the
            replica heartbeats every second).
        kv_fit: admission by predicted KV fit (`kvfit.py`, services/router/README.md "KV-fit
            admission"): a request goes only to a replica whose engine reports room in its KV
            cache for its prompt + max_tokens, else it waits (then 429 `kv_cache_full`); off:
            the slot caps alone. Needs the replica state watch (without a fresh report a
            replica is admitted on by slots).
        kv_fit_default_output_tokens: a chat request without max_tokens reserves at most this
            many output tokens (else the rest of its context).
        kv_fit_report_lag_seconds: a request admitted less than this before an engine's report
            counts as not reflected by it (its whole size stays reserved).
        kv_fit_candidates: replicas after the policy's choice a KV-fit decision may try.
        kv_fit_bytes_per_token: bytes per token of the prompt estimate of a request the router
            did not tokenize (4: English prose in large BPE vocabularies; the fixture
            kimi-tiny's small vocabulary makes 1.5-2).
        kv_index_max_entries: (KV block, replica) pairs the router's KV index holds at most
            (~460 bytes each, measured); past it, the least recently stored or matched block goes.
        precise_prefix_max_tokens: prompt tokens the router tokenizes and hashes at most per
            request for `precise_prefix` (whole blocks of them).
        tokenizer_cache_size: tokenizers (one per model folder) kept loaded at most.
    """

    port: int = 50052
    routes_file: str = ""
    orchestrator_address: str = ""
    default_policy: str = "least_load"
    load_factor: float = 1.25
    default_max_concurrency: int = 64
    queue_timeout_seconds: float = 5.0
    max_queue_per_deployment: int = 1024
    retry_after_seconds: float = 1.0
    cold_start_retry_after_seconds: float = 10.0
    max_cold_start_budget_seconds: float = 175.0
    breaker_failures: int = 5
    breaker_open_seconds: float = 5.0
    prefix_block_bytes: int = 256
    prefix_max_blocks: int = 128
    orchestrator_backoff_seconds: float = 0.5
    orchestrator_max_backoff_seconds: float = 15.0
    shared_caps: bool = True
    router_id: str = ""
    auth_address: str = ""
    auth_internal_token: str = dataclasses.field(default="", repr=False)
    auth_pepper: str = dataclasses.field(default="", repr=False)
    auth_pepper_file: str = ""
    key_table_heartbeat_seconds: float = 1.0
    key_table_stale_seconds: float = 5.0
    key_limit_window_seconds: int = 60
    usage_buffer_capacity: int = 10_000
    usage_batch_size: int = 256
    usage_flush_interval_seconds: float = 0.005
    usage_spool_path: str = ""
    telemetry_address: str = ""
    picker_fallbacks: int = 2
    picker_keepalive_seconds: float = 0.25
    picker_timeout_margin_seconds: float = 1.0
    outcome_address: str = ""
    outcome_wait_seconds: float = 5.0
    gateway_port: int = 0
    gateway_node_port: int = 8000
    replica_state_watch: str = "auto"
    replica_state_idle_seconds: float = 3.0
    kv_index_max_entries: int = 2_000_000
    kv_fit: bool = True
    kv_fit_default_output_tokens: int = 4096
    kv_fit_report_lag_seconds: float = 0.25
    kv_fit_candidates: int = 4
    kv_fit_bytes_per_token: float = 4.0
    precise_prefix_max_tokens: int = 32_768
    tokenizer_cache_size: int = 4

    def watches_replica_state(self) -> bool:
        """Whether the replica state watch runs (`replica_state_watch`).

        Raises:
            ConfigError: a value other than auto, on and off.
        """
        value = self.replica_state_watch
        if value not in ("auto", "on", "off"):
            raise ConfigError(f"replica_state_watch must be auto, on or off, not {value!r}")
        return value == "on" or (value == "auto" and bool(self.orchestrator_address))


def resolve_auth_pepper(settings: RouterSettings) -> bytes | None:
    """Auth's pepper from `auth_pepper` or `auth_pepper_file` (read as auth reads its
    `auth-pepper` file: the text, stripped), or None when neither is set. Never generated.

    Raises:
        ConfigError: both set, an unreadable file, or a pepper shorter than 16 bytes.
    """
    if settings.auth_pepper and settings.auth_pepper_file:
        raise ConfigError("set one of 'auth_pepper' and 'auth_pepper_file', not both")
    if settings.auth_pepper:
        pepper = settings.auth_pepper
        where = "setting 'auth_pepper'"
    elif settings.auth_pepper_file:
        path = Path(settings.auth_pepper_file).expanduser()
        try:
            pepper = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read auth_pepper_file {path}: {exc}") from exc
        where = f"auth_pepper_file {path}"
    else:
        return None
    if len(pepper.encode()) < 16:
        raise ConfigError(f"{where} must hold at least 16 bytes (auth's pepper)")
    return pepper.encode()
