"""Engine targets follow the orchestrator's routing table (issue 7: after a rolling release
telemetry scrapes the new replicas and forgets the old ones), static targets stay, and the
Prometheus `file_sd` file says the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.telemetry.app import build_components
from inferplane.telemetry.discovery import file_sd_groups, targets_from_table
from inferplane.telemetry.engines import EngineScraper, EngineTarget
from inferplane.telemetry.settings import TelemetrySettings
from inferplane.testing.clock import FakeClock

from .test_engines import Pages, vllm_text

STATIC = "legacy/legacy-0=http://10.0.0.9:8000/metrics"


def _endpoint(replica: str, *, draining: bool = False, url: str | None = None) -> Any:
    return opb.RouteEndpoint(
        replica_id=replica,
        address="127.0.0.1:50054",
        draining=draining,
        metrics_url=f"http://127.0.0.1:9100/{replica}/metrics" if url is None else url,
    )


def _table(version: str, *endpoints: Any, aliases: Sequence[str] = ()) -> Any:
    return opb.WatchRoutingTableResponse(
        version=version,
        routes=[
            opb.ModelRoute(model=model, deployment="kimi-tiny", endpoints=list(endpoints))
            for model in ("kimi-tiny", *aliases)
        ],
    )


class FakeTargetSource:
    """A routing table source driven by the test: `push(table)` plays one stream message."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[Sequence[EngineTarget]], None]] = []
        self.started = self.stopped = False

    def subscribe(self, listener: Callable[[Sequence[EngineTarget]], None]) -> None:
        self.listeners.append(listener)
        listener(())

    def push(self, table: Any) -> None:
        for listener in self.listeners:
            listener(targets_from_table(table))

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


def test_targets_from_the_table_fold_aliases_keep_draining_and_skip_unknown_urls() -> None:
    table = _table(
        "v1",
        _endpoint("kimi-tiny-0-aaaa", draining=True),
        _endpoint("kimi-tiny-0-bbbb"),
        _endpoint("kimi-tiny-1-bbbb", url=""),  # a node-agent that reports no metrics URL
        aliases=("tiny",),
    )
    assert targets_from_table(table) == (
        EngineTarget(
            "kimi-tiny", "kimi-tiny-0-aaaa", "http://127.0.0.1:9100/kimi-tiny-0-aaaa/metrics"
        ),
        EngineTarget(
            "kimi-tiny", "kimi-tiny-0-bbbb", "http://127.0.0.1:9100/kimi-tiny-0-bbbb/metrics"
        ),
    )


def test_file_sd_groups_carry_labels_path_and_scheme() -> None:
    groups = file_sd_groups(
        [
            EngineTarget("kimi", "kimi-0", "http://10.0.0.7:50071/metrics"),
            EngineTarget("kimi", "kimi-1", "https://10.0.0.8:443/engines/1/metrics"),
        ]
    )
    assert groups == [
        {"targets": ["10.0.0.7:50071"], "labels": {"deployment": "kimi", "replica": "kimi-0"}},
        {
            "targets": ["10.0.0.8:443"],
            "labels": {
                "deployment": "kimi",
                "replica": "kimi-1",
                "__metrics_path__": "/engines/1/metrics",
                "__scheme__": "https",
            },
        },
    ]


def test_a_rolling_release_moves_the_scraped_replicas(clock: FakeClock, tmp_path: Path) -> None:
    """Old replica → old + new (old draining) → new alone: the scrape targets, the engine
    series on /metrics and the file_sd file follow each table; the static target stays."""
    pages = Pages()
    source = FakeTargetSource()
    sd_file = tmp_path / "prometheus" / "engines.json"
    settings = TelemetrySettings(
        engine_targets=(STATIC,), engine_sd_file=str(sd_file), json_logs=False
    )
    components = build_components(
        settings, clock=clock, fetch=pages, run_loops=False, target_source=source
    )
    scraper = components.scraper
    old, new = "kimi-tiny-0-aaaa", "kimi-tiny-0-bbbb"
    for replica in (old, new):
        pages.pages[f"http://127.0.0.1:9100/{replica}/metrics"] = vllm_text(
            kv=0.25, running=1, waiting=0, preemptions=0, queries=10, hits=5
        )
    pages.pages["http://10.0.0.9:8000/metrics"] = ConnectionRefusedError("down")

    def scraped() -> dict[tuple[str, str], float]:
        asyncio.run(scraper.scrape_once())
        clock.advance(5)
        registry = CollectorRegistry()
        registry.register(scraper)  # type: ignore[arg-type]
        (family,) = [f for f in registry.collect() if f.name == "inferplane_engine_up"]
        return {(s.labels["deployment"], s.labels["replica"]): s.value for s in family.samples}

    def in_sd_file() -> set[tuple[str, str]]:
        groups = json.loads(sd_file.read_text())
        return {(g["labels"]["deployment"], g["labels"]["replica"]) for g in groups}

    assert scraped() == {("legacy", "legacy-0"): 0.0}  # before the first table
    source.push(_table("v1", _endpoint(old)))
    assert scraped() == {("legacy", "legacy-0"): 0.0, ("kimi-tiny", old): 1.0}
    source.push(_table("v2", _endpoint(old, draining=True), _endpoint(new)))
    assert scraped() == {
        ("legacy", "legacy-0"): 0.0,
        ("kimi-tiny", old): 1.0,
        ("kimi-tiny", new): 1.0,
    }
    stats = scraper.stats("kimi-tiny")
    assert stats is not None and (stats.replicas, stats.replicas_up) == (2, 2)
    source.push(_table("v3", _endpoint(new)))
    # The old replica's series leave at once, before the next scrape.
    registry = CollectorRegistry()
    registry.register(scraper)  # type: ignore[arg-type]
    assert (
        registry.get_sample_value(
            "inferplane_engine_up", {"deployment": "kimi-tiny", "replica": old}
        )
        is None
    )
    assert scraped() == {("legacy", "legacy-0"): 0.0, ("kimi-tiny", new): 1.0}
    assert [t.replica for t in scraper.targets] == ["legacy-0", new]
    stats = scraper.stats("kimi-tiny")
    assert stats is not None and stats.replicas == 1
    assert in_sd_file() == {("legacy", "legacy-0"), ("kimi-tiny", new)}


def test_a_table_change_during_a_scrape_attributes_nothing_to_the_wrong_replica(
    clock: FakeClock,
) -> None:
    """A scrape in flight when the table replaces r0 by r1 records r0's page for nobody: not
    for r1 (never scraped yet), not for r0 (gone)."""
    r0, r1 = (
        EngineTarget("kimi-tiny", "r0", "http://r0"),
        EngineTarget("kimi-tiny", "r1", "http://r1"),
    )
    release = asyncio.Event()

    async def slow_fetch(url: str) -> str:
        await release.wait()
        return vllm_text(kv=0.5, running=3, waiting=0, preemptions=0, queries=0, hits=0)

    scraper = EngineScraper([r0], slow_fetch, clock)

    async def scenario() -> None:
        scrape = asyncio.create_task(scraper.scrape_once())
        await asyncio.sleep(0)
        scraper.set_targets([r1])
        release.set()
        await scrape

    asyncio.run(scenario())
    stats = scraper.stats("kimi-tiny")
    assert stats is not None and (stats.replicas, stats.replicas_up, stats.running) == (1, 0, 0)
    assert all(not family.samples for family in scraper.collect() if "engine" in family.name)


class FakeRoutingService(orchestrator_pb2_grpc.RoutingServiceServicer):  # type: ignore[misc]
    """Plays the given tables on the first stream, then holds it open."""

    def __init__(self, tables: list[Any]) -> None:
        self.tables = tables
        self.release = asyncio.Event()

    async def WatchRoutingTable(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for table in self.tables:
            yield table
        await self.release.wait()


def test_with_an_orchestrator_address_the_routing_table_is_watched_over_grpc(
    clock: FakeClock,
) -> None:
    """The production wiring: `orchestrator_address` → `RoutingTableWatch` → scrape targets."""

    async def scenario() -> None:
        fake = FakeRoutingService([_table("v1", _endpoint("kimi-tiny-0-aaaa"))])
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        settings = TelemetrySettings(orchestrator_address=f"127.0.0.1:{port}", json_logs=False)
        components = build_components(settings, clock=clock, fetch=Pages(), run_loops=False)
        await components.start()
        try:
            for _ in range(500):
                if components.scraper.targets:
                    break
                await asyncio.sleep(0.01)
            assert [(t.deployment, t.replica) for t in components.scraper.targets] == [
                ("kimi-tiny", "kimi-tiny-0-aaaa")
            ]
        finally:
            fake.release.set()
            await components.stop()
            await server.stop(0)

    asyncio.run(scenario())
