"""Multi-LoRA on one replica (issue 29): tokens/s with 8 adapters against the base model alone,
adapter load time, and the memory of one replica holding 8 adapters against 8 replicas.

One real replica process (`python -m inferplane.replica` from the node-agent's launch plan,
`inproc`: vLLM's AsyncLLM, fp32, eager, kimi-tiny) with LoRA on (`max_loras` 8, `max_lora_rank`
8) and an allow-listed root holding 8 copies of the fixture adapter (`models/kimi-tiny-lora`,
built by `models/build_lora_fixture.py`) under 8 names: vLLM loads each on its own (own id, own
slot, own prefix-cache salt), as it would 8 fine-tunes. Requests go straight to the replica's
gRPC port with the adapter headers the endpoint picker sets.

1. Load time: after the base model is warm, for each adapter a 1-token request (the first with
   that adapter: vLLM loads it) then the same request again (loaded); the load time is the
   difference, median over the 8.
2. Throughput, `--rounds` interleaved rounds (the order alternates): `--requests` greedy chat
   requests of `--max-tokens` tokens (`ignore_eos`: every request generates the same count) at
   `--concurrency`, once with no adapter and once spread round-robin over the 8 adapters (all
   loaded, `max_loras` 8: no eviction); completion tokens / wall seconds; medians. The ratio is
   LoRA's over the base's on the same replica.
3. Memory, from what the engine reports and allocates: the weights (the safetensors vLLM loads,
   fp32), the KV cache (the engine's own block count, `WatchReplicaState.total_kv_blocks`, times
   its block size and the model's KV bytes per token) and the LoRA slots (vLLM's stacked LoRA
   tensors: `max_loras` x rank x (in + out) per target projection and layer, in the model's
   dtype, vllm/lora/layers) plus vLLM's adapter cache (each loaded adapter's own weights,
   `max_cpu_loras` = 8 of them). One replica with 8 adapters = weights + KV + slots + cache; 8
   replicas (one per fine-tune, merged weights, the same KV budget each) = 8 x (weights + KV).
   Also measured:
   the resident memory of the replica's process tree, LoRA replica vs a second run without LoRA.

Last lines: `lora_tokens_per_s_ratio`, `lora_adapter_load_seconds`,
`lora_memory_ratio_8_adapters_vs_8_replicas`. Run `.venv/bin/python bench/lora.py` (~3-4 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from inferplane.api.inference.v1 import inference_pb2 as pb  # noqa: E402
from inferplane.api.inference.v1 import inference_pb2_grpc  # noqa: E402
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc  # noqa: E402
from inferplane.fixtures import kimi_tiny as kt  # noqa: E402
from inferplane.fixtures import kimi_tiny_lora as kl  # noqa: E402
from inferplane.node_agent.supervisor.process import (  # noqa: E402
    EngineProcess,
    ProcessSpawner,
    plan_launch,
    tree_rss_bytes,
)
from inferplane.replica.testing.pipeline import kimi_tiny_spec  # noqa: E402
from inferplane.wire import chat_request_from_dict  # noqa: E402
from inferplane.wire.headers import ADAPTER, ADAPTER_SOURCE  # noqa: E402

ADAPTERS = 8
KV_CACHE_BYTES = 64 << 20
DTYPE_BYTES = 4  # fp32 weights, KV cache and LoRA slots (vLLM's lora_dtype "auto")


def chat(max_tokens: int) -> pb.CreateChatCompletionRequest:
    body = kt.NO_TOOL.request(temperature=0.0, max_completion_tokens=max_tokens, ignore_eos=True)
    return pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))


class Replica:
    """A replica process started from the node-agent's launch plan, ready (health SERVING)."""

    def __init__(self, process: EngineProcess, address: str, channel: grpc.aio.Channel) -> None:
        self.process = process
        self.address = address
        self.channel = channel
        self.stub = inference_pb2_grpc.InferenceServiceStub(channel)

    @classmethod
    async def start(cls, workdir: Path, name: str, root: Path | None) -> Replica:
        spec = kimi_tiny_spec()
        spec.transport, spec.dtype, spec.kv_cache_bytes = "inproc", "float32", KV_CACHE_BYTES
        if root is not None:
            spec.max_loras, spec.max_lora_rank, spec.lora_root = ADAPTERS, kl.RANK, str(root)
        plan = plan_launch(name, spec, data_dir=workdir / name, cpu=True)
        process = await ProcessSpawner().spawn(plan)
        assert isinstance(process, EngineProcess)
        channel = grpc.aio.insecure_channel(plan.inference_address)
        health = health_pb2_grpc.HealthStub(channel)
        started = time.monotonic()
        while True:
            if process.returncode is not None:
                sys.exit(f"{name} exited:\n{plan.log_path.read_text()[-4000:]}")
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
        print(f"{name}: ready in {time.monotonic() - started:.1f} s", flush=True)
        return cls(process, plan.inference_address, channel)

    async def request(self, adapter: tuple[str, str] | None, max_tokens: int) -> int:
        """One chat completion; returns its completion tokens."""
        metadata = ((ADAPTER, adapter[0]), (ADAPTER_SOURCE, adapter[1])) if adapter else None
        response = await self.stub.CreateChatCompletion(chat(max_tokens), metadata=metadata)
        return response.usage.completion_tokens

    async def kv_report(self) -> tuple[int, int]:
        """(total KV blocks, tokens per block) as the engine reports them."""
        control = replica_pb2_grpc.ReplicaProcessServiceStub(self.channel)
        watch = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest(router_id="bench"))
        try:
            async for update in watch:
                if update.total_kv_blocks and update.block_size:
                    return update.total_kv_blocks, update.block_size
        finally:
            watch.cancel()
        raise RuntimeError("the replica reported no KV cache")

    async def stop(self) -> None:
        await self.channel.close()
        await self.process.stop(20)


async def phase(
    replica: Replica, adapters: list[tuple[str, str] | None], requests: int, concurrency: int,
    max_tokens: int,
) -> float:  # fmt: skip
    """Completion tokens per second of `requests` requests at `concurrency`, request i with
    `adapters[i % len(adapters)]`."""
    queue = list(range(requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            tokens += await replica.request(adapters[i % len(adapters)], max_tokens)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens / (time.perf_counter() - started)


def tensor_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file (its JSON header's offsets)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(
        e["data_offsets"][1] - e["data_offsets"][0]
        for k, e in header.items()
        if k != "__metadata__"
    )


def lora_slot_bytes(config: dict[str, Any], max_loras: int, rank: int) -> int:
    """vLLM's LoRA slots for a Qwen2 model with every projection targeted: per layer and
    projection `max_loras` x rank x (in + out) values (lora_a: rank x in, lora_b: out x rank,
    stacked per slice of qkv_proj / gate_up_proj, which sum to the same)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]  # q, k, v, o
    shapes += [(hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    per_layer = sum(rank * (i + o) for i, o in shapes)
    return config["num_hidden_layers"] * max_loras * per_layer * DTYPE_BYTES


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * DTYPE_BYTES


async def main_async(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    root = workdir / "adapters"
    adapters: list[tuple[str, str]] = []
    for i in range(ADAPTERS):
        shutil.copytree(kl.adapter_path(), root / f"a{i}")
        adapters.append((f"a{i}", str(root / f"a{i}")))
    try:
        replica = await Replica.start(workdir, "lora", root)
        try:
            for _ in range(3):  # warm: first requests pay one-off costs
                await replica.request(None, args.max_tokens)
            cold, warm = [], []
            for adapter in adapters:
                t0 = time.perf_counter()
                await replica.request(adapter, 1)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await replica.request(adapter, 1)
                warm.append(time.perf_counter() - t0)
            loads = [c - w for c, w in zip(cold, warm, strict=True)]
            print(
                "adapter first request ms: " + " ".join(f"{c * 1e3:.0f}" for c in cold)
                + "\nadapter loaded request ms: " + " ".join(f"{w * 1e3:.0f}" for w in warm)
            )  # fmt: skip
            base_rates, lora_rates = [], []
            for r in range(args.rounds):
                order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
                for which in order:
                    names: list[tuple[str, str] | None] = [None] if which == "base" else adapters
                    rate = await phase(
                        replica, names, args.requests, args.concurrency, args.max_tokens
                    )
                    (base_rates if which == "base" else lora_rates).append(rate)
                print(f"round {r + 1}: base {base_rates[-1]:.0f} tok/s, "
                      f"8 adapters {lora_rates[-1]:.0f} tok/s", flush=True)  # fmt: skip
            blocks, block_size = await replica.kv_report()
            lora_rss = tree_rss_bytes(replica.process.pid)
        finally:
            await replica.stop()
        base = await Replica.start(workdir, "base", None)
        try:
            for _ in range(3):
                await base.request(None, args.max_tokens)
            base_rss = tree_rss_bytes(base.process.pid)
        finally:
            await base.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    config = json.loads((kt.model_path() / "config.json").read_text())
    weights = tensor_bytes(kt.model_path() / "model.safetensors")
    # vLLM's adapter cache keeps each loaded adapter's weights (max_cpu_loras = max_loras of
    # them) besides the slots it copies them into (on a GPU: host memory and device memory).
    cache = ADAPTERS * tensor_bytes(kl.adapter_path() / kl.WEIGHTS_FILE)
    kv = blocks * block_size * kv_bytes_per_token(config)
    slots = lora_slot_bytes(config, ADAPTERS, kl.RANK)
    one = weights + kv + slots + cache
    eight = ADAPTERS * (weights + kv)
    base_median, lora_median = statistics.median(base_rates), statistics.median(lora_rates)
    mib = 1 << 20
    print(
        f"\ntokens/s at c={args.concurrency}, {args.max_tokens} tokens, medians of {args.rounds}:"
        f" base {base_median:.0f}, 8 adapters {lora_median:.0f}\n"
        f"adapter load seconds (first minus loaded request): "
        + " ".join(f"{x:.3f}" for x in loads)
        + f"\nengine memory: weights {weights / mib:.2f} MiB, KV cache {kv / mib:.2f} MiB "
        f"({blocks} blocks of {block_size} tokens), LoRA slots {slots / mib:.2f} MiB "
        f"({ADAPTERS} x rank {kl.RANK}), adapter cache {cache / mib:.2f} MiB; "
        f"one replica with 8 adapters {one / mib:.2f} MiB, "
        f"8 replicas {eight / mib:.2f} MiB\n"
        f"process tree RSS: LoRA replica with 8 adapters {lora_rss / mib:.0f} MiB, "
        f"replica without LoRA {base_rss / mib:.0f} MiB; "
        f"rss_ratio_8_adapters_vs_8_replicas: {lora_rss / (ADAPTERS * base_rss):.3f}"
    )
    print(f"lora_tokens_per_s_ratio: {lora_median / base_median:.3f}")
    print(f"lora_adapter_load_seconds: {statistics.median(loads):.3f}")
    print(f"lora_memory_ratio_8_adapters_vs_8_replicas: {one / eight:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=16, help="requests per phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
