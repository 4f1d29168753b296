"""The composition root: settings parsing (targets, SLO overrides) and the background loops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from inferplane.runtime import ConfigError, load_settings
from inferplane.telemetry.app import build_components
from inferplane.telemetry.settings import TelemetrySettings
from inferplane.testing.clock import FakeClock

from .conftest import record


def test_settings_from_file_env_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "t.yaml"
    config.write_text(
        "telemetry:\n"
        "  slo_ttft_p99_seconds: 3\n"
        "  slo_overrides: {kimi-k2: {ttft_p99_seconds: 1.5, min_requests: 5}}\n"
    )
    env = {"INFERPLANE_TELEMETRY_ENGINE_TARGETS": "a/a-0=http://h:1/metrics,b/b-0=http://h:2/m"}
    s = load_settings(
        TelemetrySettings,
        service="telemetry",
        argv=["--config", str(config), "--max-tenants-per-deployment", "7", "--plaintext"],
        environ=env,
    )
    assert [t.replica for t in s.parsed_engine_targets()] == ["a-0", "b-0"]
    assert s.label_caps.tenants_per_deployment == 7
    table = s.slo_table()
    assert (table["kimi-k2"].ttft_p99_seconds, table["kimi-k2"].min_requests) == (1.5, 5)
    assert table["kimi-k2"].itl_p99_seconds == s.default_slo.itl_p99_seconds
    assert s.default_slo.ttft_p99_seconds == 3.0


def test_bad_settings_fail_at_build_time() -> None:
    with pytest.raises(ConfigError, match="unknown targets ttft"):
        build_components(TelemetrySettings(slo_overrides={"d": {"ttft": 1}}))
    with pytest.raises(ConfigError, match="deployment/replica="):
        build_components(TelemetrySettings(engine_targets=("nope",)))


def test_background_loops_scrape_and_evaluate_on_the_injected_clock(clock: FakeClock) -> None:
    """start() runs the scrape and evaluation loops on the injected sleep; stop() ends them."""
    pages = {"http://e/metrics": "vllm:num_preemptions_total 1\n"}

    async def fetch(url: str) -> str:
        return pages[url]

    async def main() -> None:
        settings = TelemetrySettings(
            engine_targets=("d/d-0=http://e/metrics",), evaluation_interval_seconds=60
        )
        c = build_components(settings, clock=clock, fetch=fetch, sleep=clock.sleep)
        c.ingestor.ingest(
            [record(deployment="d", error_code="x", finished_at=clock.time()) for _ in range(30)]
        )
        await c.start()
        for _ in range(20):
            await asyncio.sleep(0)
        await c.stop()
        stats = c.scraper.stats("d")
        assert stats is not None and stats.replicas_up == 1
        kinds = {a.kind for a in c.evaluator.book.alerts(include_resolved=True, now=clock.time())}
        assert "error_rate" in kinds

    asyncio.run(main())
