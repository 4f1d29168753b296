"""The fault switch, for tests only: a replica that fails a share of its live requests as an
engine failure would, so that a release's canary can be made worse than the stable revision
(issue 30's acceptance: "a canary whose error rate is forced up is rolled back automatically").

It cannot fire in production: it is armed only when the replica process runs with
`FAULTS_ENV` set to "1" (the local stack passes it to its node-agents through
`StackConfig.engine_env`, which they hand to their replica processes; nothing else sets it),
and then only for a replica whose model folder (`ReplicaSpec.model_source`, a local folder)
holds the marker file `FAULT_MARKER`. A model folder is part of the profile, so the marker
picks one revision: the test copies the fixture model's folder, adds the marker and releases
a profile whose `model_source` is the copy; the stable revision's folder has no marker.

The marker is JSON: `{"error_rate": 0.5}`, the share (0 < x <= 1) of live requests that fail,
spread evenly (request n fails when floor(n·x) grows: 0.5 fails every second request, 0.1
every tenth), so a test's counts are exact rather than random.

Only live requests fail: those an endpoint picker routed (they carry
`inferplane.wire.headers.PICKER`). Direct callers (the orchestrator's warm-up probe, the
conformance gate's requests inside the replica) never do, so the revision reaches its canary
stage and fails there. The failure is INTERNAL (HTTP 500) with code `engine_failed` before any
output, in the API's error shape: Envoy does not retry it (its retry policy retries UNAVAILABLE
only), so the client, the picker's report, the replica's record and the canary's error rate all
see it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.runtime import ConfigError, InternalError

log = structlog.get_logger("inferplane.replica.faults")

FAULTS_ENV = "INFERPLANE_TEST_FAULTS"
"""Environment variable that arms the switch ("1"); only the test stack sets it."""
FAULT_MARKER = "inferplane-test-fault.json"
"""The marker file in a model folder: `{"error_rate": x}`, 0 < x <= 1."""
FAULT_CODE = "engine_failed"
"""The OpenAI error code of an injected failure (an engine failure's)."""


class FaultSwitch:
    """Fails `error_rate` of the live requests it is asked about, evenly spread.

    Args:
        error_rate: the share of live requests that fail, 0 < x <= 1.
        source: where the setting came from (the marker's path), named in the error.

    Raises:
        ConfigError: `error_rate` outside (0, 1].
    """

    def __init__(self, error_rate: float, source: str) -> None:
        if not 0.0 < error_rate <= 1.0:
            raise ConfigError(f"{source}: error_rate must be within (0, 1], got {error_rate!r}")
        self.error_rate = error_rate
        self.source = source
        self.live_requests = 0
        self.failed = 0

    def strike(self, live: bool) -> None:
        """Called once per admitted request; `live`: an endpoint picker routed it.

        Raises:
            InternalError: this live request is one of the share that fails (code
                engine_failed, HTTP 500).
        """
        if not live:
            return
        self.live_requests += 1
        due = math.floor(self.live_requests * self.error_rate + 1e-9)
        if due <= self.failed:
            return
        self.failed = due
        raise InternalError(
            "the engine failed: injected by the test fault switch "
            f"({FAULT_MARKER}, error_rate {self.error_rate})",
            reason="ENGINE_FAILED",
            code=FAULT_CODE,
        )


def fault_switch(
    spec: nodeagent_pb2.ReplicaSpec, environ: Mapping[str, str] = os.environ
) -> FaultSwitch | None:
    """The replica's fault switch, or None (always None unless `FAULTS_ENV` is "1" and the
    spec's model folder holds `FAULT_MARKER`).

    Raises:
        ConfigError: the marker exists but is not `{"error_rate": x}` with 0 < x <= 1.
    """
    if environ.get(FAULTS_ENV) != "1" or not spec.model_source:
        return None
    marker = Path(spec.model_source) / FAULT_MARKER
    if not marker.is_file():
        return None
    try:
        settings = json.loads(marker.read_text())
        rate = float(settings["error_rate"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f'{marker}: expected {{"error_rate": x}}: {exc}') from exc
    switch = FaultSwitch(rate, str(marker))
    log.warning("test_fault_switch_armed", marker=str(marker), error_rate=rate)
    return switch
