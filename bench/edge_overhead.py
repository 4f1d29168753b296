"""What the edge adds on the v2 data path: streaming chat straight to the replica process vs
through Envoy + ext_authz + the endpoint picker, on the same engine, interleaved in one run;
and whether the picker's cost grows with output tokens (it must not: it never sees them).

    .venv/bin/python bench/edge_overhead.py [--requests 64] [--max-tokens 64] [--levels 1,16]
                                            [--stream-interval N] [--transport inproc]
                                            [--cpu-requests 24] [--cpu-concurrency 4]
                                            [--message-requests 32]

Starts the local stack (kimi-tiny on the CPU engine) in a temporary directory, then for each
concurrency level runs the same streaming chat requests (a) over gRPC to the replica process's
own `StreamChatCompletion` (its address from the routing table) and (b) over HTTP/SSE through
Envoy, alternating rounds so that machine noise hits both paths alike. TTFT is measured to the
first chunk carrying generated text (reasoning, content or a tool call), ITL as the gaps between
such chunks, tokens/s from the usage in the last chunk.

Then the router's and Envoy's CPU per request (all their threads, from /proc schedstat, ns
resolution) over `--cpu-requests` edge requests of 64 and of 1,024 output tokens (ignore_eos),
interleaved in two halves each, less each process's idle CPU rate (measured for 5 s first)
over the same wall time; and the replica process's cost per streamed message: its CPU per
request and the gRPC messages per request (counted on `StreamChatCompletionEvents`, the
method the edge calls, straight to the replica) at concurrency 1 and 8. Last lines:

    added_ttft_p50_ms_c1: X            (goal ≤ 2 ms)
    router_cpu_ms_per_request_64: A
    router_cpu_ms_per_request_1024: B
    router_cpu_growth_1024_vs_64: B/A  (goal ≤ 1.2: the picker's cost does not grow with tokens)
    envoy_cpu_us_per_request_64: E
    envoy_cpu_us_per_request_1024: F
    envoy_cpu_growth_1024_vs_64: F/E   (Envoy touches every token: it grows)
    envoy_cpu_us_per_output_token: (F - E) / 960
    replica_messages_per_request_c1 / _c8, replica_cpu_ms_per_request_c1 / _c8,
    replica_cpu_us_per_message_c1 / _c8
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


@dataclass
class ProcessCpu:
    """One process's CPU per edge request (ms) at 64 and 1,024 output tokens: `raw` as
    measured, `net` less its idle rate (`idle_ms_per_s`) over the same wall time."""

    raw: dict[int, float]
    net: dict[int, float]
    idle_ms_per_s: float


async def _edge_cpu(
    stack: Stack, key: str, requests: int, concurrency: int, pids: dict[str, int]
) -> dict[str, ProcessCpu]:
    """CPU ms per edge request of each of `pids` (name → pid) at 64 and 1,024 output tokens
    (two interleaved halves): "raw" as measured, and "net" less what the process spends idle
    over the same wall time (the router's background: the routing-table watch, the sinks'
    timers, gRPC's pollers; Envoy's: its timers and stats flush), measured for 5 s first. A
    1,024-token request lasts ~16× longer, so the raw figure grows with the idle rate even
    when the per-request work does not."""
    url = f"{stack.config.base_url}/chat/completions"
    spent = {name: {64: 0.0, 1024: 0.0} for name in pids}
    wall: dict[int, float] = {64: 0.0, 1024: 0.0}
    counted: dict[int, int] = {64: 0, 1024: 0}

    def now() -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        def one(tokens: int) -> Any:
            body = _request(tokens)
            return lambda: _http_one(client, url, key, body)

        for tokens in (64, 1024):  # warm-up
            await _round(one(tokens), 2, 2, PathStats())
        idle_from, idle_cpu = time.perf_counter(), now()
        await asyncio.sleep(5.0)
        idle_wall, idle_after = time.perf_counter() - idle_from, now()
        idle_rate = {n: (idle_after[n] - idle_cpu[n]) / idle_wall for n in pids}
        for _ in range(2):
            for tokens in (64, 1024):
                half = max(concurrency, requests // 2)
                before, started = now(), time.perf_counter()
                await _round(one(tokens), concurrency, half, PathStats())
                after = now()
                for name in pids:
                    spent[name][tokens] += after[name] - before[name]
                wall[tokens] += time.perf_counter() - started
                counted[tokens] += half
    return {
        name: ProcessCpu(
            raw={t: spent[name][t] * 1000 / counted[t] for t in counted},
            net={t: (spent[name][t] - idle_rate[name] * wall[t]) * 1000 / counted[t] for t in wall},
            idle_ms_per_s=idle_rate[name] * 1000,
        )
        for name in pids
    }


@dataclass
class MessageCost:
    """The replica process per streamed request at one concurrency: gRPC messages and CPU
    (ms, all its threads: the front, not vLLM's engine-core process; less its idle rate over
    the same wall time)."""

    messages: float
    cpu_ms: float


async def _replica_messages(
    stack: Stack, requests: int, max_tokens: int, levels: tuple[int, ...] = (1, 8)
) -> dict[int, MessageCost]:
    """Messages and replica-process CPU per request of `max_tokens` output tokens, streamed
    over `StreamChatCompletionEvents` straight to the replica (the method and bytes the edge
    gets), at each concurrency of `levels`, in two interleaved halves, less the process's idle
    CPU rate (measured for 3 s first) over the same wall time."""
    endpoint = stack.serving_endpoints()[0]
    pid = stack.serving_replica().engine_pid
    request = pb.StreamChatCompletionEventsRequest(
        request=chat_request_from_dict(_request(max_tokens))
    )
    messages: dict[int, int] = dict.fromkeys(levels, 0)
    spent: dict[int, float] = dict.fromkeys(levels, 0.0)
    counted: dict[int, int] = dict.fromkeys(levels, 0)
    async with stack.config.security.aio_channel(endpoint.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def one(level: int) -> None:
            async for _ in stub.StreamChatCompletionEvents(request):
                messages[level] += 1

        async def run(level: int, count: int) -> None:
            queue = list(range(count))

            async def worker() -> None:
                while queue:
                    queue.pop()
                    await one(level)

            await asyncio.gather(*(worker() for _ in range(level)))

        for level in levels:  # warm-up
            await run(level, level)
        messages = dict.fromkeys(levels, 0)
        idle_from, idle_cpu = time.perf_counter(), cpu_seconds(pid)
        await asyncio.sleep(3.0)
        idle_rate = (cpu_seconds(pid) - idle_cpu) / (time.perf_counter() - idle_from)
        for _ in range(2):
            for level in levels:
                half = max(level, requests // 2)
                before, started = cpu_seconds(pid), time.perf_counter()
                await run(level, half)
                wall = time.perf_counter() - started
                spent[level] += cpu_seconds(pid) - before - idle_rate * wall
                counted[level] += half
    return {
        level: MessageCost(messages[level] / counted[level], spent[level] * 1000 / counted[level])
        for level in levels
    }


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
    parser.add_argument(
        "--message-requests", type=int, default=32, help="per concurrency (1 and 8)"
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
            router = stack.processes["router"].proc
            assert router is not None and stack.edge is not None and stack.edge.pid
            cpu = asyncio.run(
                _edge_cpu(
                    stack,
                    key,
                    args.cpu_requests,
                    args.cpu_concurrency,
                    {"router": router.pid, "envoy": stack.edge.pid},
                )
            )
            replica = asyncio.run(_replica_messages(stack, args.message_requests, args.max_tokens))
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
    for level, cost in replica.items():
        print(
            f"# replica process, c={level}: {cost.messages:.1f} messages and "
            f"{cost.cpu_ms:.2f} ms CPU per request of {args.max_tokens} tokens"
        )
    raw, net = cpu["router"].raw, cpu["router"].net
    print(f"router_idle_cpu_ms_per_s: {cpu['router'].idle_ms_per_s:.2f}")
    print(f"router_cpu_ms_per_request_raw_64: {raw[64]:.3f}")
    print(f"router_cpu_ms_per_request_raw_1024: {raw[1024]:.3f}")
    print(f"router_cpu_ms_per_request_64: {net[64]:.3f}")
    print(f"router_cpu_ms_per_request_1024: {net[1024]:.3f}")
    print(f"router_cpu_growth_1024_vs_64: {net[1024] / net[64]:.3f}")
    envoy = cpu["envoy"].net
    print(f"envoy_idle_cpu_ms_per_s: {cpu['envoy'].idle_ms_per_s:.2f}")
    print(f"envoy_cpu_us_per_request_64: {envoy[64] * 1000:.1f}")
    print(f"envoy_cpu_us_per_request_1024: {envoy[1024] * 1000:.1f}")
    print(f"envoy_cpu_growth_1024_vs_64: {envoy[1024] / envoy[64]:.3f}")
    print(f"envoy_cpu_us_per_output_token: {(envoy[1024] - envoy[64]) * 1000 / 960:.2f}")
    for level, cost in replica.items():
        print(f"replica_messages_per_request_c{level}: {cost.messages:.1f}")
        print(f"replica_cpu_ms_per_request_c{level}: {cost.cpu_ms:.3f}")
        print(f"replica_cpu_us_per_message_c{level}: {cost.cpu_ms * 1000 / cost.messages:.1f}")


if __name__ == "__main__":
    main()
