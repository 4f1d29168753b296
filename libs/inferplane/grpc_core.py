"""gRPC core defaults for inferplane's service processes (no gRPC import here).

gRPC's C core reads `GRPC_EXPERIMENTS` once, when `grpc` is first imported; setting it later
has no effect. Each service's `__main__` therefore calls `use_service_defaults()` before it
imports anything that imports `grpc`.

The default turns off two of gRPC's experiments, `event_engine_client` and
`event_engine_listener` (on by default in grpcio 1.85). With them on, every message a
grpc.aio stream carries passes through the EventEngine's thread pool before it reaches the
completion queue that the event loop's poller reads. The router, which relays each token twice
(node-agent → router → Envoy), then sleeps and wakes ~1.7 times per relayed message instead
of ~0.9, and spends ~15 % more CPU per request (bench/README.md, "gRPC's EventEngine").
An operator's own `GRPC_EXPERIMENTS` is kept as it is. Child processes inherit the variable,
the engines of a node-agent included.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
SERVICE_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def use_service_defaults(
    environ: MutableMapping[str, str] = os.environ,
    modules: Mapping[str, object] = sys.modules,
) -> None:
    """Sets `GRPC_EXPERIMENTS` to `SERVICE_EXPERIMENTS` unless it is set already.

    Raises RuntimeError when it would set the variable but `grpc` is already imported in this
    process (the setting would silently do nothing): an entry point that imports gRPC first is
    a bug.
    """
    if EXPERIMENTS_ENV in environ:
        return
    if "grpc" in modules:
        raise RuntimeError(
            f"grpc was imported before {EXPERIMENTS_ENV} was set: call "
            "use_service_defaults() before importing anything that imports grpc"
        )
    environ[EXPERIMENTS_ENV] = SERVICE_EXPERIMENTS
