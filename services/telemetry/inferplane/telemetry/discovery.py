"""Which engines to scrape: the static targets from settings plus every replica the
orchestrator's routing table lists, followed as the table changes (rolling releases add and
remove replicas); optionally mirrored to a Prometheus `file_sd` file so a real Prometheus
scrapes the same engines with the same labels."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.telemetry.engines import EngineTarget

log = structlog.get_logger("inferplane.telemetry")


def targets_from_table(message: opb.WatchRoutingTableResponse) -> tuple[EngineTarget, ...]:
    """One target per (deployment, replica) whose endpoint has a metrics URL, in table order.

    Draining replicas are included (their engines still run and finish in-flight requests);
    a replica leaves when the orchestrator removes it from the table, i.e. once it stopped.
    A deployment with aliases appears once per model name in the table: it is counted once.
    """
    targets: dict[tuple[str, str], EngineTarget] = {}
    for route in message.routes:
        deployment = route.deployment or route.model
        for endpoint in route.endpoints:
            key = (deployment, endpoint.replica_id)
            if endpoint.metrics_url and key not in targets:
                targets[key] = EngineTarget(deployment, endpoint.replica_id, endpoint.metrics_url)
    return tuple(targets.values())


def file_sd_groups(targets: Sequence[EngineTarget]) -> list[dict[str, Any]]:
    """Prometheus `file_sd` target groups: one per replica, labelled `deployment` and
    `replica` like telemetry's own engine series, with the URL's path and scheme."""
    groups = []
    for target in targets:
        url = urllib.parse.urlsplit(target.url)
        labels = {"deployment": target.deployment, "replica": target.replica}
        if url.path and url.path != "/metrics":
            labels["__metrics_path__"] = url.path
        if url.scheme != "http":
            labels["__scheme__"] = url.scheme
        groups.append({"targets": [url.netloc], "labels": labels})
    return groups


def write_file_sd(path: Path, targets: Sequence[EngineTarget]) -> None:
    """Replaces `path` atomically (write beside it, then rename), so Prometheus never reads
    a half-written file.

    Raises:
        OSError: the folder is not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(file_sd_groups(targets), handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class TargetSink(Protocol):
    def set_targets(self, targets: Sequence[EngineTarget]) -> None: ...


class EngineDiscovery:
    """Feeds `sink.set_targets(static + watched)` and keeps the `file_sd` file (when
    `sd_file` is set) in step; subscribe `update` to a `RoutingTableWatch` of targets."""

    def __init__(
        self,
        sink: TargetSink,
        static: Sequence[EngineTarget] = (),
        *,
        sd_file: Path | None = None,
    ) -> None:
        self._sink = sink
        self._static = tuple(static)
        self._sd_file = sd_file
        self._current: tuple[EngineTarget, ...] | None = None
        self.update(())

    def update(self, watched: Sequence[EngineTarget]) -> None:
        targets = tuple(dict.fromkeys((*self._static, *watched)))
        if targets == self._current:
            return
        self._sink.set_targets(targets)
        self._current = targets
        log.info("engine_targets", targets=[f"{t.deployment}/{t.replica}" for t in targets])
        if self._sd_file is not None:
            try:
                write_file_sd(self._sd_file, targets)
            except OSError as exc:  # Prometheus keeps its last file; telemetry goes on
                log.warning("engine_file_sd_not_written", path=str(self._sd_file), error=str(exc))


class TargetSource(Protocol):
    """Engine targets that change over time (`RoutingTableWatch[tuple[EngineTarget, ...]]`
    in production, a small fake in tests)."""

    def subscribe(self, listener: Callable[[Sequence[EngineTarget]], None]) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
