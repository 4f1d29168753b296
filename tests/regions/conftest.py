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
from inferplane.localstack.regions import layout_host_names

HOME, OTHER = "a", "b"


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts.fresh(layout_host_names((HOME, OTHER)))
    try:
        made.create()
    except NamespaceError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.delete()
