"""What the edge adds: streaming chat straight to the node-agent vs through Envoy + ext_authz +
router, on the same engine, interleaved in one run.

    .venv/bin/python bench/edge_overhead.py [--requests 64] [--max-tokens 64] [--levels 1,16]
                                            [--stream-interval N]

Starts the local stack (kimi-tiny on the CPU engine) in a temporary directory, then for
concurrency 1 and 16 runs the same streaming chat requests (a) over gRPC to the node-agent's
`StreamChatCompletion`, over gRPC to the router (what the router hop adds) and (b) over HTTP/SSE
through Envoy, alternating rounds so that machine noise hits every path alike. TTFT is measured
to the first chunk carrying generated text (reasoning, content or a tool call), ITL as the gaps
between such chunks (per chunk: several tokens apart with a stream interval), tokens/s from the
usage in the last chunk. Prints a table, then the last lines `added_ttft_p50_ms: X` and
`added_ttft_p99_ms: Y` at concurrency 16.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.cli._stack import Stack, StackConfig
from inferplane.runtime.ports import free_port, free_port_run
from inferplane.testing import kimi_tiny
from inferplane.wire import chat_request_from_dict


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int
    e2e: float


@dataclass
class PathStats:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0

    def pct(self, values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000

    def row(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.samples]
        gaps = [g for s in self.samples for g in s.gaps]
        tokens = sum(s.tokens for s in self.samples)
        return {
            "ttft_p50": self.pct(ttft, 50),
            "ttft_p99": self.pct(ttft, 99),
            "itl_p50": self.pct(gaps, 50) if gaps else 0.0,
            "itl_p99": self.pct(gaps, 99) if gaps else 0.0,
            "tok_s": tokens / self.wall if self.wall else 0.0,
        }


def _request(max_tokens: int) -> dict[str, object]:
    # Usage in the last chunk: generated tokens are counted from it, not from chunks (with a
    # stream interval a chunk carries several tokens).
    return kimi_tiny.NO_TOOL.request(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )


def _has_text(delta: dict[str, object]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def _grpc_one(
    stub: inference_pb2_grpc.InferenceServiceStub,
    body: dict[str, object],
    metadata: tuple[tuple[str, str], ...],
) -> Sample:
    request = pb.StreamChatCompletionRequest(request=chat_request_from_dict(body))
    start = time.perf_counter()
    marks: list[float] = []
    tokens = 0
    async for chunk in stub.StreamChatCompletion(request, metadata=metadata):
        if chunk.HasField("usage"):
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            d = chunk.choices[0].delta
            if d.content or d.reasoning_content or d.tool_calls:
                marks.append(time.perf_counter())
    return Sample(
        marks[0] - start,
        [b - a for a, b in itertools.pairwise(marks)],
        tokens,
        time.perf_counter() - start,
    )


async def _http_one(
    client: httpx.AsyncClient, url: str, key: str, body: dict[str, object]
) -> Sample:
    start = time.perf_counter()
    marks: list[float] = []
    tokens = 0
    async with client.stream(
        "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and _has_text(chunk["choices"][0]["delta"]):
                marks.append(time.perf_counter())
    return Sample(
        marks[0] - start,
        [b - a for a, b in itertools.pairwise(marks)],
        tokens,
        time.perf_counter() - start,
    )


async def _round(make: object, concurrency: int, count: int, stats: PathStats) -> None:
    queue = list(range(count))

    async def worker() -> None:
        while queue:
            queue.pop()
            stats.samples.append(await make())  # type: ignore[operator]

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    stats.wall += time.perf_counter() - start


async def _measure(
    stack: Stack, key: str, requests: int, max_tokens: int, rounds: int, levels: list[int]
) -> dict[int, dict[str, PathStats]]:
    body = _request(max_tokens)
    url = f"{stack.config.base_url}/chat/completions"
    # The orchestrator names replicas by revision: pin the one the routing table serves.
    replica_id = stack.serving_endpoints()[0].replica_id
    results: dict[int, dict[str, PathStats]] = {}
    ports = stack.config.ports
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['node_agent']}") as agent_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['router']}") as router_channel,
        httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client,
    ):
        agent = inference_pb2_grpc.InferenceServiceStub(agent_channel)
        router = inference_pb2_grpc.InferenceServiceStub(router_channel)
        pinned = (("x-inferplane-replica", replica_id),)
        paths = {
            # (a) the node-agent alone (its gRPC service, the replica pinned)
            "direct": lambda: _grpc_one(agent, body, pinned),
            # the router's gRPC service (internal callers): router + node-agent
            "router": lambda: _grpc_one(router, body, ()),
            # (b) the edge: Envoy + ext_authz (auth) + router + node-agent, HTTP/SSE
            "edge": lambda: _http_one(client, url, key, body),
        }
        # Warm-up: every path, every batch size the engine will see.
        for concurrency in levels:
            for make in paths.values():
                await _round(make, concurrency, concurrency, PathStats())
        for concurrency in levels:
            stats = {name: PathStats() for name in paths}
            per_round = max(concurrency, requests // rounds)
            for _ in range(rounds):
                for name, make in paths.items():
                    await _round(make, concurrency, per_round, stats[name])
            results[concurrency] = stats
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per path and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per level")
    parser.add_argument(
        "--levels", default="1,16", help="comma-separated concurrency levels (16 is reported)"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=0,
        help="the deployment profile's stream_interval (tokens per chunk at least; 0: every one)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = StackConfig(
            data_dir=Path(tmp),
            http_port=free_port(),
            grpc_base_port=free_port_run(5),
            metrics_base_port=free_port_run(5),
            envoy_admin_port=free_port(),
            stream_interval=args.stream_interval,
        )
        stack = Stack(config)
        stack.start(lambda m: print(f"# {m}", flush=True))
        try:
            key = stack.create_api_key("bench")
            levels = [int(level) for level in args.levels.split(",")]
            results = asyncio.run(
                _measure(stack, key, args.requests, args.max_tokens, args.rounds, levels)
            )
        finally:
            stack.stop()
    print(
        f"{'path':<8} {'conc':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'ITL p99':>8} {'tok/s':>8}   (ms; {args.max_tokens} output tokens per request)"
    )
    for concurrency, paths in results.items():
        for name, stats in paths.items():
            r = stats.row()
            print(
                f"{name:<8} {concurrency:>4} {r['ttft_p50']:>9.2f} {r['ttft_p99']:>9.2f} "
                f"{r['itl_p50']:>8.2f} {r['itl_p99']:>8.2f} {r['tok_s']:>8.1f}"
            )
    for concurrency, paths in results.items():
        d, r, e = (paths[name].row() for name in ("direct", "router", "edge"))
        print(f"router_added_ttft_p50_ms_c{concurrency}: {r['ttft_p50'] - d['ttft_p50']:.2f}")
        print(f"added_ttft_p50_ms_c{concurrency}: {e['ttft_p50'] - d['ttft_p50']:.2f}")
        print(f"added_ttft_p99_ms_c{concurrency}: {e['ttft_p99'] - d['ttft_p99']:.2f}")
    if 16 not in results:
        return
    d, e = results[16]["direct"].row(), results[16]["edge"].row()
    print(f"edge_vs_direct_tok_s_c16: {e['tok_s'] / d['tok_s']:.3f}")
    print(f"added_ttft_p50_ms: {e['ttft_p50'] - d['ttft_p50']:.2f}")
    print(f"added_ttft_p99_ms: {e['ttft_p99'] - d['ttft_p99']:.2f}")


if __name__ == "__main__":
    main()
