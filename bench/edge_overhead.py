"""What the edge adds on the v2 data path: streaming chat straight to the replica process vs
through Envoy + ext_authz + the endpoint picker, on the same engine, interleaved in one run;
and whether the picker's cost grows with output tokens (it must not: it never sees them).

    .venv/bin/python bench/edge_overhead.py [--requests 64] [--max-tokens 64] [--levels 1,16]
                                            [--stream-interval N] [--transport inproc]
                                            [--cpu-requests 24] [--cpu-concurrency 4]

Starts the local stack (kimi-tiny on the CPU engine) in a temporary directory, then for each
concurrency level runs the same streaming chat requests (a) over gRPC to the replica process's
own `StreamChatCompletion` (its address from the routing table) and (b) over HTTP/SSE through
Envoy, alternating rounds so that machine noise hits both paths alike. TTFT is measured to the
first chunk carrying generated text (reasoning, content or a tool call), ITL as the gaps between
such chunks, tokens/s from the usage in the last chunk.

Then the router's CPU per request (all its threads, from /proc schedstat, ns resolution) over
`--cpu-requests` edge requests of 64 and of 1,024 output tokens (ignore_eos), interleaved in
two halves each, less the router's idle CPU rate (measured for 5 s first) over the same wall
time. Last lines:

    added_ttft_p50_ms_c1: X            (goal ≤ 2 ms)
    router_cpu_ms_per_request_64: A
    router_cpu_ms_per_request_1024: B
    router_cpu_growth_1024_vs_64: B/A  (goal ≤ 1.2: the picker's cost does not grow with tokens)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import Stack, StackConfig
from inferplane.runtime.processes.ports import free_port, free_port_run
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
    replica = stack.serving_endpoints()[0].address  # the replica process's own port
    results: dict[int, dict[str, PathStats]] = {}
    async with (
        stack.config.security.aio_channel(replica) as replica_channel,
        httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client,
    ):
        direct = inference_pb2_grpc.InferenceServiceStub(replica_channel)
        paths = {
            # (a) the replica process alone (its gRPC service)
            "direct": lambda: _grpc_one(direct, body, ()),
            # (b) the edge: Envoy + ext_authz (auth) + picker (router) + the replica, HTTP/SSE
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


def cpu_seconds(pid: int) -> float:
    """CPU time (s) of every thread of `pid` (schedstat: nanoseconds, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


async def _router_cpu(
    stack: Stack, key: str, requests: int, concurrency: int
) -> dict[str, dict[int, float]]:
    """Router CPU ms per edge request at 64 and 1,024 output tokens (two interleaved halves):
    "raw" as measured, and "net" less what the router spends idle over the same wall time
    (its background: the routing-table watch, the sinks' timers, gRPC's pollers), measured
    for 5 s first. A 1,024-token request lasts ~16× longer, so the raw figure grows with the
    idle rate even when the per-request work does not."""
    router = stack.processes["router"].proc
    assert router is not None
    url = f"{stack.config.base_url}/chat/completions"
    spent: dict[int, float] = {64: 0.0, 1024: 0.0}
    wall: dict[int, float] = {64: 0.0, 1024: 0.0}
    counted: dict[int, int] = {64: 0, 1024: 0}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        def one(tokens: int) -> Any:
            body = _request(tokens)
            return lambda: _http_one(client, url, key, body)

        for tokens in (64, 1024):  # warm-up
            await _round(one(tokens), 2, 2, PathStats())
        idle_from, idle_cpu = time.perf_counter(), cpu_seconds(router.pid)
        await asyncio.sleep(5.0)
        idle_rate = (cpu_seconds(router.pid) - idle_cpu) / (time.perf_counter() - idle_from)
        for _ in range(2):
            for tokens in (64, 1024):
                half = max(concurrency, requests // 2)
                before, started = cpu_seconds(router.pid), time.perf_counter()
                await _round(one(tokens), concurrency, half, PathStats())
                spent[tokens] += cpu_seconds(router.pid) - before
                wall[tokens] += time.perf_counter() - started
                counted[tokens] += half
    raw = {t: spent[t] * 1000 / counted[t] for t in spent}
    net = {t: (spent[t] - idle_rate * wall[t]) * 1000 / counted[t] for t in spent}
    return {"raw": raw, "net": net, "idle_ms_per_s": {0: idle_rate * 1000}}


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
    parser.add_argument("--transport", default="", help="engine transport ('': the default)")
    parser.add_argument("--cpu-requests", type=int, default=24, help="per output length")
    parser.add_argument("--cpu-concurrency", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = StackConfig(
            data_dir=Path(tmp),
            http_port=free_port(),
            grpc_base_port=free_port_run(5),
            metrics_base_port=free_port_run(5),
            envoy_admin_port=free_port(),
            stream_interval=args.stream_interval,
            **({"transport": args.transport} if args.transport else {}),
        )
        stack = Stack(config)
        stack.start(lambda m: print(f"# {m}", flush=True))
        try:
            key = stack.create_api_key("bench")
            levels = [int(level) for level in args.levels.split(",")]
            results = asyncio.run(
                _measure(stack, key, args.requests, args.max_tokens, args.rounds, levels)
            )
            router_cpu = asyncio.run(
                _router_cpu(stack, key, args.cpu_requests, args.cpu_concurrency)
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
        d, e = (paths[name].row() for name in ("direct", "edge"))
        print(f"added_ttft_p50_ms_c{concurrency}: {e['ttft_p50'] - d['ttft_p50']:.2f}")
        print(f"added_ttft_p99_ms_c{concurrency}: {e['ttft_p99'] - d['ttft_p99']:.2f}")
        print(f"edge_vs_direct_tok_s_c{concurrency}: {e['tok_s'] / d['tok_s']:.3f}")
    raw, net = router_cpu["raw"], router_cpu["net"]
    print(f"router_idle_cpu_ms_per_s: {router_cpu['idle_ms_per_s'][0]:.2f}")
    print(f"router_cpu_ms_per_request_raw_64: {raw[64]:.3f}")
    print(f"router_cpu_ms_per_request_raw_1024: {raw[1024]:.3f}")
    print(f"router_cpu_ms_per_request_64: {net[64]:.3f}")
    print(f"router_cpu_ms_per_request_1024: {net[1024]:.3f}")
    print(f"router_cpu_growth_1024_vs_64: {net[1024] / net[64]:.3f}")


if __name__ == "__main__":
    main()
