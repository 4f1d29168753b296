"""The real replica process (`--transport inproc`, vLLM on kimi-tiny) streams its engine's state
(`WatchReplicaState`, issue 29): the first update is a snapshot with the engine's block size
and KV block count and `kv_events` on; after a prompt of more than two full blocks (vLLM's CPU
backend: 128 tokens per block) is served, the stream carries the blocks vLLM stored, as
`inferplane.kvblocks.chain` of the prompt's token ids: vLLM's own KV events, from its ZeroMQ
publisher on loopback, decoded against its classes (in-process) or as plain msgpack (a child
engine), translated by the replica. `inproc` runs by default; `http-completions` (vLLM's HTTP
server as the replica's child, its KV event arguments appended by the replica, its numbers
from its `/metrics`) is marked `scenario`. Prints the start-up time and how long after the
request the blocks arrived."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane import kvblocks
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.testing.pipeline import kimi_tiny_ids, kimi_tiny_spec
from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port
from inferplane.wire import completion_request_from_dict

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TEXT = (
    "The river runs north past the old mill, where the miller's daughter counts sacks of "
    "flour every morning before the market opens and the carts arrive from the valley. "
)


def _prompt(tokens: int) -> list[int]:
    ids: list[int] = []
    n = 0
    while len(ids) < tokens:
        ids += kimi_tiny_ids(f"{n}. {TEXT}")
        n += 1
    return ids[:tokens]


@pytest.mark.parametrize(
    "transport", ["inproc", pytest.param("http-completions", marks=pytest.mark.scenario)]
)
def test_a_replica_streams_the_kv_blocks_vllm_stored_by_content_hash(
    tmp_path: Path, transport: str
) -> None:
    spec = kimi_tiny_spec()
    spec.model_source = str(kt.model_path())
    spec.dtype = "float32"
    spec.max_num_seqs = 8
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json_format.MessageToJson(spec))
    port = free_port()
    log_path = tmp_path / "replica.log"
    argv = [
        sys.executable, "-m", "inferplane.replica",
        "--replica-id", "state-1",
        "--spec-file", str(spec_file),
        "--port", str(port),
        "--transport", transport,
        "--device", "cpu",
        "--kv-cache-bytes", str(64 << 20),
        "--cache-root", str(tmp_path / "cache"),
        "--startup-timeout-seconds", "150",
        "--plaintext",
    ]  # fmt: skip
    if transport != "inproc":
        engine_port = free_port()
        argv += [
            "--engine-address", f"127.0.0.1:{engine_port}",
            "--engine-metrics-url", f"http://127.0.0.1:{engine_port}/metrics",
            "--",
            sys.executable, "-m", "inferplane.replica.engines.launcher",
            "--kv-cache-bytes", str(64 << 20), "--device", "cpu",
            "--cache-root", str(tmp_path / "cache"),
            "--", "serve", spec.model_source, "--host", "127.0.0.1", "--port", str(engine_port),
            "--served-model-name", kt.SERVED_MODEL_NAME, "--dtype", "float32",
            "--max-model-len", str(spec.max_model_len or 8192), "--max-num-seqs", "8",
            "--enforce-eager",
        ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        asyncio.run(_scenario(proc, port, inproc=transport == "inproc"))
    except BaseException:
        print(log_path.read_text()[-6000:])
        raise
    finally:
        procguard.kill_group(proc.pid)
        proc.wait(10)


async def _scenario(proc: subprocess.Popen[bytes], port: int, *, inproc: bool) -> None:
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert proc.poll() is None, "the replica exited during start-up"
            assert time.monotonic() - started < 150, "not ready in 150 s"
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            except grpc.aio.AioRpcError:
                status = None
            await asyncio.sleep(0.5)
        print(f"replica_ready_seconds: {time.monotonic() - started:.1f}")

        control = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
        watch = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest(router_id="e2e"))
        first = await asyncio.wait_for(watch.read(), 10)
        assert (first.sequence, first.reset) == (1, True)
        # A child engine's events count from its first batch; its numbers from its /metrics.
        assert first.kv_events == inproc
        sequence, numbers = 1, first
        while not numbers.total_kv_blocks:
            numbers = await asyncio.wait_for(watch.read(), 10)
            sequence = numbers.sequence
        assert numbers.block_size == 128
        assert numbers.free_kv_blocks == numbers.total_kv_blocks
        print(f"total_kv_blocks: {numbers.total_kv_blocks}")

        prompt = _prompt(2 * 128 + 60)  # two full blocks and a partial one
        expected = kvblocks.chain(prompt, 128)
        assert len(expected) == 2
        request = completion_request_from_dict(
            {"model": kt.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        )
        inference = inference_pb2_grpc.InferenceServiceStub(channel)
        sent = time.monotonic()
        await inference.CreateCompletion(pb.CreateCompletionRequest(request=request), timeout=60)

        stored: list[int] = []
        while len(stored) < len(expected):
            update = await asyncio.wait_for(watch.read(), 10)
            assert update.sequence == sequence + 1, "a gap in the stream's sequence"
            sequence = update.sequence
            assert not update.reset
            assert update.kv_events or not update.stored
            for block_set in update.stored:
                assert block_set.adapter == ""
                stored += block_set.hashes
        print(f"blocks_streamed_after_request_seconds: {time.monotonic() - sent:.2f}")
        assert stored == expected
        assert update.preemptions_total == 0

        # The same prompt again is a prefix-cache hit: nothing new is stored; a new watcher's
        # snapshot holds the blocks.
        await inference.CreateCompletion(pb.CreateCompletionRequest(request=request), timeout=60)
        late = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest(router_id="late"))
        snapshot = await asyncio.wait_for(late.read(), 10)
        assert snapshot.reset
        assert [h for s in snapshot.stored for h in s.hashes] == expected
        late.cancel()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            update = await asyncio.wait_for(watch.read(), 3)
            assert not update.stored, "a prefix-cache hit was reported as new blocks"
        assert update.running_requests == 0 and update.in_flight_requests == 0
        watch.cancel()
