"""The engine mode per transport: the engine command line a replica process gets for
`http-completions` (vLLM's HTTP server, loopback, its own `/metrics`) against `grpc`, and the
supervisor running a real replica process (inferplane.testing.fake_replica) whose engine child
is testing/fake_http_engine.py: ready once the engine answers, tokens through HttpEngineClient
at the engine address, loopback-only engine listeners, nothing left after stop."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.supervisor.manager import (
    ReplicaManager,
    SupervisorConfig,
)
from inferplane.node_agent.supervisor.process import (
    is_loopback,
    listening_addresses,
    plan_launch,
    tree_pids,
)
from inferplane.replica.engines.base import SamplingParams
from inferplane.replica.engines.http_client import HttpEngineClient
from inferplane.replica_contract import DEFAULT_TRANSPORT, TRANSPORTS
from inferplane.runtime import FailedPreconditionError
from inferplane.runtime.processes.ports import LOWEST_PORT, ephemeral_range

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(60)]

FAKE_HTTP = (sys.executable, "-m", "inferplane.testing.fake_http_engine")
FAKE_REPLICA = (sys.executable, "-m", "inferplane.testing.fake_replica")


def spec(transport: str) -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(
        served_model_name="kimi-tiny", model_source="/models/kimi-tiny", transport=transport
    )


def vllm_args(argv: tuple[str, ...]) -> list[str]:
    """vLLM's arguments: after the engine command's own `--` (the second one)."""
    cut = len(argv) - 1 - argv[::-1].index("--")
    return list(argv[cut + 1 :])


def launcher_opts(argv: tuple[str, ...]) -> list[str]:
    """The launcher's options: between the replica's `--` and the engine command's."""
    first = argv.index("--")
    return list(argv[first + 1 : first + 1 + argv[first + 1 :].index("--")])


def test_http_plan_runs_vllms_http_server_on_loopback(tmp_path: Path) -> None:
    plan = plan_launch("r1", spec("http-completions"), data_dir=tmp_path, cpu=True)
    args = vllm_args(plan.argv)
    assert args[:2] == ["serve", "/models/kimi-tiny"] and "--grpc" not in args
    assert args[args.index("--host") + 1] == "127.0.0.1"
    port = args[args.index("--port") + 1]
    assert plan.engine_address == f"127.0.0.1:{port}"
    # The HTTP server's own /metrics, on the same port (the launcher serves none), is what
    # the replica process fetches and serves with its own series on its metrics port.
    engine_metrics = plan.argv[plan.argv.index("--engine-metrics-url") + 1]
    assert engine_metrics == f"http://127.0.0.1:{port}/metrics"
    assert "--metrics-port" not in launcher_opts(plan.argv)
    replica_port = plan.argv[plan.argv.index("--metrics-port") + 1]
    assert plan.metrics_url == f"http://127.0.0.1:{replica_port}/metrics" != engine_metrics
    assert "--enable-prompt-tokens-details" in args  # cached tokens in usage
    assert plan.transport == "http-completions"


def test_grpc_plan_is_unchanged(tmp_path: Path) -> None:
    plan = plan_launch("r1", spec("grpc"), data_dir=tmp_path, cpu=True)
    args = vllm_args(plan.argv)
    opts = launcher_opts(plan.argv)
    assert "--grpc" in args and "--enable-prompt-tokens-details" not in args
    metrics_port = opts[opts.index("--metrics-port") + 1]
    engine_metrics = plan.argv[plan.argv.index("--engine-metrics-url") + 1]
    assert engine_metrics == f"http://127.0.0.1:{metrics_port}/metrics"
    replica_port = plan.argv[plan.argv.index("--metrics-port") + 1]
    assert plan.metrics_url == f"http://127.0.0.1:{replica_port}/metrics"
    assert plan.engine_address == f"127.0.0.1:{args[args.index('--port') + 1]}"


@pytest.mark.parametrize("transport", ["grpc", "http-completions"])
def test_engine_ports_lie_below_the_ephemeral_range(tmp_path: Path, transport: str) -> None:
    """The engine's ports are chosen like every other server port of the platform
    (inferplane.runtime.processes.ports), never by binding port 0: an ephemeral port can be
    taken by any
    outgoing connection before the engine binds it."""
    low, _high = ephemeral_range()
    for _ in range(10):
        plan = plan_launch("r1", spec(transport), data_dir=tmp_path, cpu=True)
        ports = {int(plan.engine_address.rsplit(":", 1)[1])}
        ports.add(int(plan.inference_address.rsplit(":", 1)[1]))
        ports.add(int(plan.metrics_url.split(":")[2].split("/")[0]))
        assert all(LOWEST_PORT <= port < low for port in ports), ports


@pytest.mark.parametrize("transport", ["grpc", "http-completions"])
def test_a_stream_interval_reaches_the_engine_on_either_transport(
    tmp_path: Path, transport: str
) -> None:
    """The profile's stream_interval becomes vLLM's `--stream-interval` (its front end then
    sends one increment per N tokens); 0 and 1 leave the flag out (vLLM's default, 1)."""
    with_interval = spec(transport)
    with_interval.stream_interval = 4
    args = vllm_args(plan_launch("r1", with_interval, data_dir=tmp_path, cpu=True).argv)
    assert args[args.index("--stream-interval") + 1] == "4"
    with_interval.stream_interval = 1
    args = vllm_args(plan_launch("r1", with_interval, data_dir=tmp_path, cpu=True).argv)
    assert "--stream-interval" not in args


def test_an_empty_transport_means_the_default(tmp_path: Path) -> None:
    assert DEFAULT_TRANSPORT in TRANSPORTS
    plan = plan_launch("r1", spec(""), data_dir=tmp_path, cpu=True)
    assert plan.transport == DEFAULT_TRANSPORT


@pytest.mark.anyio
async def test_an_unknown_transport_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    manager = ReplicaManager(SupervisorConfig(data_dir=tmp_path, cpu=True))
    with pytest.raises(FailedPreconditionError, match="grpc, http-completions"):
        await manager.start("r1", spec("websocket"))
    assert manager.list() == []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_http_engine_supervised_ready_generates_and_listens_on_loopback_only(
    tmp_path: Path,
) -> None:
    """Invariant: a replica on the HTTP transport spawns its engine from the plan's engine
    command line, and every socket the engine's process tree listens on is a loopback one
    (the API and `/metrics`)."""
    manager = ReplicaManager(
        SupervisorConfig(
            data_dir=tmp_path,
            replica_command=FAKE_REPLICA,
            engine_command=(*FAKE_HTTP, "--spawn-child"),
            startup_timeout_seconds=20,
            startup_poll_seconds=0.1,
            health_interval_seconds=0.2,
            cpu=True,
        )
    )
    replica = await manager.start("r1", spec("http-completions"))
    try:
        await replica.wait_for_state(State.STATE_READY, timeout=20)
        engine = HttpEngineClient(f"http://{replica.engine_address}")
        try:
            outs = [o async for o in engine.generate("q", [7, 8], SamplingParams(max_tokens=3))]
        finally:
            await engine.close()
        assert [t for o in outs for t in o.token_ids] == [9, 10, 11]
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 3

        metrics = urllib.request.urlopen(replica.metrics_url, timeout=5).read().decode()
        assert "vllm:num_requests_running" in metrics  # the engine's, through the replica's
        assert "inferplane_replica_" in metrics  # the replica process's own

        pids = tree_pids(replica.pid)
        # The replica process and its group's reaper; the engine (leading its own group),
        # its reaper and its child.
        assert len(pids) == 5, pids
        listening = listening_addresses(pids)
        ports = {port for _addr, port in listening}
        assert int(replica.engine_address.rsplit(":", 1)[1]) in ports
        assert int(replica.inference_address.rsplit(":", 1)[1]) in ports
        assert all(is_loopback(addr) for addr, _port in listening), listening
    finally:
        await manager.close()
    assert replica.state == State.STATE_STOPPED
    assert not [p for p in pids if Path(f"/proc/{p}").exists() and _running(p)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
