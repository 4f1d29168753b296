"""deploy/prometheus/prometheus.yml, pointed at a local stack on other ports.

The file in deploy/ is the one source of truth (jobs, labels, rules); it targets the local
stack's default ports. `render_prometheus_config` keeps every job and label and only moves the
targets: each `inferplane` service target to that service's metrics port (by its `service`
label), Envoy to the admin port, the `engines` job to the stack's `file_sd` file (which
telemetry rewrites from the orchestrator's routing table), rule files to absolute paths.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferplane.runtime import ConfigError

ENGINE_SD_FILE = Path("prometheus") / "engines.json"
"""Where in a stack's data directory telemetry writes the engines' `file_sd` targets."""


def engine_sd_file(data_dir: Path) -> Path:
    """The stack's engine `file_sd` file (`<data_dir>/prometheus/engines.json`)."""
    return data_dir / ENGINE_SD_FILE


def render_prometheus_config(
    template: Mapping[str, Any],
    *,
    metrics_ports: Mapping[str, int],
    envoy_admin_port: int,
    engine_sd_file: Path,
    rules_dir: Path,
    scrape_interval: str | None = None,
) -> dict[str, Any]:
    """`template` (deploy/prometheus/prometheus.yml, parsed) for a stack on loopback.

    Args:
        metrics_ports: metrics port by service (`StackConfig.metrics_ports`: auth, router,
            orchestrator, node_agent, telemetry); the template's `service` labels use
            `node-agent`.
        rules_dir: the folder relative rule files are found in (the template's).
        scrape_interval: overrides the global scrape and evaluation intervals (e.g. "1s").

    Raises:
        ConfigError: a service target whose `service` label names no known service, or a
            template without the `inferplane`, `engines` and `envoy` jobs.
    """
    config = copy.deepcopy(dict(template))
    if scrape_interval:
        config.setdefault("global", {})
        config["global"]["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
    config["rule_files"] = [str(rules_dir / f) for f in config.get("rule_files", [])]
    jobs = {job["job_name"]: job for job in config.get("scrape_configs", [])}
    missing = {"inferplane", "engines", "envoy"} - set(jobs)
    if missing:
        raise ConfigError(f"the Prometheus template has no job {', '.join(sorted(missing))}")
    for group in jobs["inferplane"].get("static_configs", []):
        service = str(group.get("labels", {}).get("service", ""))
        port = metrics_ports.get(service.replace("-", "_"))
        if port is None:
            raise ConfigError(
                f"the Prometheus template's service {service!r} is not one of "
                f"{', '.join(sorted(metrics_ports))}"
            )
        group["targets"] = [f"127.0.0.1:{port}"]
    for group in jobs["envoy"].get("static_configs", []):
        group["targets"] = [f"127.0.0.1:{envoy_admin_port}"]
    engines = jobs["engines"]
    engines.pop("static_configs", None)
    engines["file_sd_configs"] = [{"files": [str(engine_sd_file)]}]
    return config
