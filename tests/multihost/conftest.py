"""Hosts made of Linux network namespaces, and the platform spread over them (issue 20).

Topology (one run; `inferplane.localstack.netns` makes the namespaces)::

    root namespace (the test: the client side)        10.77.N.1  ─┐
    <run>-net: a bridge, nothing else                              ├─ bridge
    <run>-ctl: orchestrator, auth, router ×2, telemetry, Envoy 10.77.N.2  ─┤
    <run>-w1:  node-agent "w1" and its replica processes       10.77.N.3  ─┤
    <run>-w2:  node-agent "w2" and its replica processes       10.77.N.4  ─┘

Services bind their host's address only, so the hosts reach each other through the bridge and
nothing else. `Hosts.cut(host)` pulls the host's cable; `Hosts.restore(host)` plugs it back.

Needs root and iproute2's `ip`; without them (or when the kernel refuses a namespace) the
module skips, saying which.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferplane.localstack.netns import Hosts, NamespaceError, namespaces_unavailable

CONTROL = "ctl"
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts.fresh((CONTROL, *WORKERS))
    try:
        made.create()
    except NamespaceError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.delete()
