"""Two regions on Linux network namespaces (issue 31 part 3).

Topology (one run; `inferplane.localstack.netns` makes the namespaces)::

    root namespace (the test: the client side)              10.77.N.1
    <run>-actl: region a's orchestrator, auth, router, telemetry, edge   .2
    <run>-aw:   region a's node-agent and its replica process            .3
    <run>-bctl: region b's control host                                  .4
    <run>-bw:   region b's worker                                        .5
    <run>-glb:  the global tier's Envoy                                  .6

Cutting a region pulls both its cables. Needs root and iproute2's `ip`; without them the module
skips, saying which.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferplane.localstack.netns import Hosts, NamespaceError, namespaces_unavailable

HOME, OTHER = "a", "b"


def control_of(region: str) -> str:
    return f"{region}ctl"


def worker_of(region: str) -> str:
    return f"{region}w"


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    names = (*tuple(h for r in (HOME, OTHER) for h in (control_of(r), worker_of(r))), "glb")
    made = Hosts.fresh(names)
    try:
        made.create()
    except NamespaceError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.delete()
