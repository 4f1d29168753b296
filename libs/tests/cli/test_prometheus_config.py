"""deploy/prometheus/prometheus.yml stays the one Prometheus configuration: its targets are
the local stack's default ports, and the rendering for a stack on other ports moves only the
targets."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from inferplane.localstack import StackConfig, engine_sd_file, render_prometheus_config
from inferplane.runtime import ConfigError

PROMETHEUS_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"


def _template() -> dict[str, object]:
    return dict(yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text()))


def _render(config: StackConfig, **kwargs: object) -> dict[str, object]:
    return render_prometheus_config(
        _template(),
        metrics_ports=config.metrics_ports,
        envoy_admin_port=config.envoy_admin_port,
        engine_sd_file=engine_sd_file(config.data_dir),
        rules_dir=PROMETHEUS_DIR,
        **kwargs,  # type: ignore[arg-type]
    )


def _targets(config: dict[str, object]) -> dict[tuple[str, str], list[str]]:
    return {
        (job["job_name"], group.get("labels", {}).get("service", "")): group["targets"]
        for job in config["scrape_configs"]  # type: ignore[attr-defined]
        for group in job.get("static_configs", [])
    }


def test_the_deploy_config_targets_the_local_stacks_default_ports(tmp_path: Path) -> None:
    """A changed default port in StackConfig (or a typo in deploy/) fails here."""
    template = _template()
    rendered = _render(StackConfig(data_dir=tmp_path))
    assert _targets(rendered) == _targets(template)
    assert len(_targets(template)) == 6  # five services and Envoy


def test_other_ports_move_the_targets_and_nothing_else(tmp_path: Path) -> None:
    config = StackConfig(
        data_dir=tmp_path, grpc_base_port=41000, metrics_base_port=42000, envoy_admin_port=43000
    )
    rendered = _render(config, scrape_interval="1s")
    targets = _targets(rendered)
    assert targets[("inferplane", "auth")] == ["127.0.0.1:42000"]
    assert targets[("inferplane", "node-agent")] == ["127.0.0.1:42003"]
    assert targets[("inferplane", "telemetry")] == ["127.0.0.1:42004"]
    assert targets[("envoy", "edge")] == ["127.0.0.1:43000"]
    jobs = {j["job_name"]: j for j in rendered["scrape_configs"]}  # type: ignore[attr-defined]
    assert jobs["engines"]["file_sd_configs"] == [
        {"files": [str(tmp_path / "prometheus" / "engines.json")]}
    ]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert rendered["global"] == {  # type: ignore[comparison-overlap]
        **_template()["global"],  # type: ignore[dict-item]
        "scrape_interval": "1s",
        "evaluation_interval": "1s",
    }
    assert rendered["rule_files"] == [str(PROMETHEUS_DIR / "inferplane.rules.yml")]
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package (scripts/test.sh installs it)
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(rendered))
        result = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_an_unknown_service_label_is_an_error(tmp_path: Path) -> None:
    template = _template()
    template["scrape_configs"][0]["static_configs"][0]["labels"]["service"] = "gateway"  # type: ignore[index]
    with pytest.raises(ConfigError, match="'gateway' is not one of auth, node_agent"):
        render_prometheus_config(
            template,
            metrics_ports=StackConfig(data_dir=tmp_path).metrics_ports,
            envoy_admin_port=9901,
            engine_sd_file=tmp_path / "e.json",
            rules_dir=PROMETHEUS_DIR,
        )
