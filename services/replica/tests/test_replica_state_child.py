"""A child engine's state (`engines/child_state.py`): vLLM's Prometheus lines read into
`EngineStats`, and a real replica process on `http-completions` whose child is the fake vLLM
HTTP server with a KV cache model (vLLM's `--num-gpu-blocks-override` / `--block-size`):
`WatchReplicaState` reports its block size and blocks, and a second request that does not fit
waits in the engine's queue, as KV-fit admission tests need it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.app import ReplicaProcess, build_host
from inferplane.replica.engines.child_state import ChildEngineState, stats_from_metrics
from inferplane.replica.engines.engine_stats import EngineStats
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.settings import parse_args
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_spec
from inferplane.runtime.processes.ports import free_port
from inferplane.wire import completion_request_from_dict

# As vLLM 0.32's /metrics writes them (abridged; histograms and other series are skipped).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="kimi-tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="kimi-tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="kimi-tiny"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="kimi-tiny"} 7.0
vllm:num_preemptions_created{engine="0",model_name="kimi-tiny"} 1.7e+09
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="kimi-tiny"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="513"} 1.0
"""


def test_vllms_metrics_give_the_engines_numbers() -> None:
    assert stats_from_metrics(VLLM_METRICS) == EngineStats(
        block_size=128,
        total_kv_blocks=512,  # less the null block
        free_kv_blocks=384,
        running_requests=3,
        waiting_requests=2,
        preemptions_total=7,
    )
    assert stats_from_metrics("vllm:num_requests_running 1\n").running_requests == 1
    assert stats_from_metrics("garbage\n") == EngineStats()


def test_kv_events_are_asked_of_an_engine_with_a_metrics_endpoint_only() -> None:
    argv = ["launcher", "--", "serve", "m"]
    without = ChildEngineState("", kv_events=True)
    assert without.engine_argv(argv) == argv
    pooled = ChildEngineState("http://127.0.0.1:1/metrics", kv_events=True)
    assert pooled.engine_argv([*argv, "--runner", "pooling"]) == [*argv, "--runner", "pooling"]
    state = ChildEngineState("http://127.0.0.1:1/metrics", kv_events=True)
    extended = state.engine_argv(argv)
    assert extended[: len(argv)] == argv
    assert extended[len(argv) : len(argv) + 2] == ["--enable-prefix-caching", "--kv-events-config"]
    assert '"endpoint": "tcp://127.0.0.1:' in extended[-1]
    assert state.kv_blocks is None  # nothing received yet
    asyncio.run(state.close())


def test_a_replica_on_the_fake_http_engine_reports_its_kv_cache(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json_format.MessageToJson(kimi_tiny_spec()))
    engine_port = free_port()
    settings = parse_args(
        [
            "--replica-id", "c1",
            "--spec-file", str(spec_file),
            "--port", "0",
            "--transport", "http-completions",
            "--engine-address", f"127.0.0.1:{engine_port}",
            "--engine-metrics-url", f"http://127.0.0.1:{engine_port}/metrics",
            "--plaintext",
            "--",
            sys.executable, "-m", "inferplane.testing.fake_http_engine", "--token-delay", "0.05",
            "--", "serve", "kimi-tiny", "--host", "127.0.0.1", "--port", str(engine_port),
            "--num-gpu-blocks-override", "6", "--block-size", "4",
        ]
    )  # fmt: skip

    async def scenario() -> None:
        host, _metrics = build_host(settings)
        assets = ModelAssetsCache()
        assets.put(kimi_tiny_assets(), "kimi_k2")
        process = ReplicaProcess(settings, host, assets=assets)
        stop = asyncio.Event()
        running = asyncio.ensure_future(process.run(stop))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{process.port}") as channel:
                control = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
                request = replica_pb2.GetReplicaLoadRequest()
                async with asyncio.timeout(20):
                    while not (await control.GetReplicaLoad(request)).engine_ready:
                        await asyncio.sleep(0.05)
                watch = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest())
                async with asyncio.timeout(10):
                    while (update := await watch.read()).total_kv_blocks == 0:
                        pass
                assert (update.block_size, update.total_kv_blocks) == (4, 6)
                assert update.free_kv_blocks == 6 and not update.kv_events
                # 13 prompt tokens + 8: 6 blocks at the end; the second waits for the first.
                body = {"model": "kimi-tiny", "prompt": list(range(1, 14)), "max_tokens": 8}
                inference = inference_pb2_grpc.InferenceServiceStub(channel)
                completion = completion_request_from_dict(body)
                calls = [
                    inference.CreateCompletion(pb.CreateCompletionRequest(request=completion))
                    for _ in range(2)
                ]
                async with asyncio.timeout(10):
                    while not (update := await watch.read()).waiting_requests:
                        pass
                assert update.running_requests == 1 and update.free_kv_blocks < 4
                for call in calls:
                    await call
                async with asyncio.timeout(10):
                    while (update := await watch.read()).free_kv_blocks != 6:
                        pass
                assert (update.running_requests, update.waiting_requests) == (0, 0)
                watch.cancel()
        finally:
            stop.set()
            assert await asyncio.wait_for(running, 30) == 0

    asyncio.run(scenario())
