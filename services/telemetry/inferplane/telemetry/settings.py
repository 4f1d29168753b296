"""Settings of the telemetry service (see `inferplane.runtime.load_settings` for precedence)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from inferplane.runtime import ConfigError, ServiceSettings
from inferplane.telemetry.domain import DriftPolicy, SloTargets, Sources
from inferplane.telemetry.engines import EngineTarget
from inferplane.telemetry.metrics import LabelCaps


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TelemetrySettings(ServiceSettings):
    """Settings of the telemetry service; defaults suit a local stack on loopback.

    Attributes:
        metrics_port: /metrics of this service (request metrics + engine metrics); 0 (the
            default, like every service) disables it. The local stack's convention is the gRPC
            port + 100 (50155), which `inferplane top` and deploy/prometheus expect.
        max_records: samples kept in memory in all (the exact-percentile window store).
        retention_seconds: samples older than this are dropped (≥ the drift window, 1 h).
        max_itl_gaps: inter-token gaps kept per record (evenly thinned beyond).
        request_source / tool_call_source: which record source feeds request/latency/token
            numbers and which feeds tool-call/marker numbers ("" = any; see `domain.Sources`).
        max_models, max_deployments_per_model, max_tenants_per_deployment, max_error_codes:
            label caps; further distinct values are exposed as "other".
        engine_targets: static replicas' metrics endpoints,
            `deployment/replica=http://host:port/metrics` (comma-separated in the environment or
            a flag), for setups without an orchestrator; scraped besides the discovered ones.
        orchestrator_address: `host:port` of the orchestrator; when set, every replica its
            routing table lists (with the metrics URL its node-agent reports) is scraped, and
            the list follows the table (rolling releases, scaling).
        engine_sd_file: when set, a Prometheus `file_sd` JSON file rewritten with the current
            engine targets (labels `deployment`, `replica`), for deploy/prometheus's `engines`
            job.
        engine_scrape_interval_seconds, engine_window_seconds: scrape period and the window
            over which preemption and prefix-cache rates are computed.
        evaluation_interval_seconds: how often alert rules run (drift baseline points too).
        slo_window_seconds: window of the SLO rules (latency, error rate, validity, load).
        drift_threshold, drift_window_seconds, drift_baseline_seconds, drift_min_samples:
            see `domain.DriftPolicy`.
        slo_ttft_p99_seconds, slo_itl_p99_seconds, slo_max_error_rate,
        slo_min_tool_call_validity, slo_normal_load_requests_per_second, slo_min_requests:
            default SLO targets for every deployment (see `domain.SloTargets`).
        slo_overrides: per-deployment targets (config file only), e.g.
            `{kimi-k2: {ttft_p99_seconds: 1.5, max_error_rate: 0.005}}`.
        internal_token: when set, the edge's access log (the edge overhead metric) is
            accepted only with this token (`x-inferplane-internal-token`); "" accepts the
            edge's certificate (mutual TLS) or a loopback caller.
    """

    port: int = 50055
    max_records: int = 100_000
    retention_seconds: float = 3900.0
    max_itl_gaps: int = 128
    request_source: str = "router"
    tool_call_source: str = "replica"
    max_models: int = 50
    max_deployments_per_model: int = 20
    max_tenants_per_deployment: int = 20
    max_error_codes: int = 10
    engine_targets: tuple[str, ...] = ()
    orchestrator_address: str = ""
    engine_sd_file: str = ""
    engine_scrape_interval_seconds: float = 5.0
    engine_window_seconds: float = 300.0
    evaluation_interval_seconds: float = 60.0
    slo_window_seconds: float = 300.0
    drift_threshold: float = 0.10
    drift_window_seconds: float = 3600.0
    drift_baseline_seconds: float = 6 * 3600.0
    drift_min_samples: int = 50
    slo_ttft_p99_seconds: float = 2.0
    slo_itl_p99_seconds: float = 0.2
    slo_max_error_rate: float = 0.01
    slo_min_tool_call_validity: float = 0.99
    slo_normal_load_requests_per_second: float = 0.0
    slo_min_requests: int = 20
    slo_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    internal_token: str = dataclasses.field(default="", repr=False)

    @property
    def sources(self) -> Sources:
        return Sources(request=self.request_source, tool_call=self.tool_call_source)

    @property
    def label_caps(self) -> LabelCaps:
        return LabelCaps(
            models=self.max_models,
            deployments_per_model=self.max_deployments_per_model,
            tenants_per_deployment=self.max_tenants_per_deployment,
            error_codes=self.max_error_codes,
        )

    @property
    def drift_policy(self) -> DriftPolicy:
        return DriftPolicy(
            current_window_seconds=self.drift_window_seconds,
            baseline_window_seconds=self.drift_baseline_seconds,
            threshold=self.drift_threshold,
            min_samples=self.drift_min_samples,
        )

    @property
    def default_slo(self) -> SloTargets:
        return SloTargets(
            ttft_p99_seconds=self.slo_ttft_p99_seconds,
            itl_p99_seconds=self.slo_itl_p99_seconds,
            max_error_rate=self.slo_max_error_rate,
            min_tool_call_validity=self.slo_min_tool_call_validity,
            normal_load_requests_per_second=self.slo_normal_load_requests_per_second,
            min_requests=self.slo_min_requests,
        )

    def slo_table(self) -> dict[str, SloTargets]:
        """Per-deployment targets: the defaults with each override applied.

        Raises:
            ConfigError: an override is not a mapping, names an unknown target, or is not a
                number.
        """
        known = SloTargets.field_names()
        table: dict[str, SloTargets] = {}
        for deployment, override in dict(self.slo_overrides).items():
            if not isinstance(override, Mapping):
                raise ConfigError(f"slo_overrides.{deployment}: expected a mapping of targets")
            unknown = sorted(set(override) - set(known))
            if unknown:
                raise ConfigError(
                    f"slo_overrides.{deployment}: unknown targets {', '.join(unknown)}; "
                    f"known: {', '.join(known)}"
                )
            try:
                values = {
                    k: int(v) if k == "min_requests" else float(v) for k, v in override.items()
                }
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"slo_overrides.{deployment}: {exc}") from exc
            table[deployment] = dataclasses.replace(self.default_slo, **values)
        return table

    def parsed_engine_targets(self) -> list[EngineTarget]:
        """`engine_targets` parsed. Raises ConfigError on a malformed entry."""
        return [EngineTarget.parse(spec) for spec in self.engine_targets]
