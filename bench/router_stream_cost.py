"""CPU the router spends per streamed request, and per gRPC message it relays.

    .venv/bin/python bench/router_stream_cost.py [--tokens 64] [--requests 600]

Starts a fake node-agent (this script with `--serve-agent`: a gRPC `StreamChatCompletion` that
answers at once with a role chunk, `--tokens` one-token chunks and a usage chunk, like the real
node-agent on a fast engine) and the real router (`python -m inferplane.router`, static routes
file), then drives the router's `StreamChatCompletionEvents` (what Envoy calls) at concurrency 1
and 8 and reads both processes' CPU time (utime + stime, /proc) around each level. The router
reads every chunk from the node-agent and writes it on as one SSE event, so it handles two gRPC
messages per chunk; `router_us_per_message` is its CPU divided by those.

This isolates the router hop's cost from the engine's (which the 2-core box shares with it in
bench/edge_overhead.py and bench/stack_vs_vllm.py). With `--event-loops uvloop,asyncio` (the
default) one router per event loop (`event_loop` setting) runs against the same fake
node-agent, measured in alternation for `--rounds` rounds; figures are medians over rounds.
Last lines: `router_cpu_ms_per_request_c8: X` (the first loop listed) and, with two loops,
`router_cpu_ratio_c8: R` (first loop's CPU per request / second's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.testing.ports import free_port

MODEL = "kimi-tiny"


class _Agent(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def StreamChatCompletion(self, request: Any, context: Any) -> Any:
        head = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk"}
        head |= {"created": 1_700_000_000, "model": MODEL}
        first = pb.StreamChatCompletionResponse(**head)
        first.choices.add(index=0, delta=pb.ChatCompletionDelta(role="assistant", content=""))
        yield first
        for i in range(self.tokens):
            chunk = pb.StreamChatCompletionResponse(**head)
            choice = chunk.choices.add(index=0, delta=pb.ChatCompletionDelta(content=" word"))
            if i == self.tokens - 1:
                choice.finish_reason = "length"
            yield chunk
        last = pb.StreamChatCompletionResponse(**head)
        last.usage.prompt_tokens, last.usage.completion_tokens = 128, self.tokens
        last.usage.total_tokens = 128 + self.tokens
        yield last


async def _serve_agent(port: int, tokens: int) -> None:
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(_Agent(tokens), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _level(
    stub: inference_pb2_grpc.InferenceServiceStub, requests: int, concurrency: int
) -> tuple[float, float]:
    """Runs `requests` streams at `concurrency`; returns (seconds, messages per request)."""
    request = pb.StreamChatCompletionRequest(
        request=pb.ChatCompletionRequest(
            model=MODEL, messages=[pb.ChatMessage(role="user")], stream=True
        )
    )
    left = requests
    messages = 0

    async def worker() -> None:
        nonlocal left, messages
        while left > 0:
            left -= 1
            async for _ in stub.StreamChatCompletionEvents(request):
                messages += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, messages / requests


async def _measure(
    addresses: dict[str, str], pids: dict[str, int], requests: int, rounds: int
) -> dict[str, dict[int, dict[str, float]]]:
    """Per router (by event loop) and concurrency: medians over `rounds` alternating rounds."""
    samples: dict[str, dict[int, list[dict[str, float]]]] = {
        loop: {1: [], 8: []} for loop in addresses
    }
    channels = {loop: grpc.aio.insecure_channel(a) for loop, a in addresses.items()}
    try:
        stubs = {loop: inference_pb2_grpc.InferenceServiceStub(c) for loop, c in channels.items()}
        for stub in stubs.values():
            await _level(stub, 16, 8)  # warm-up: connections, caches
        for _ in range(rounds):
            for loop, stub in stubs.items():
                for concurrency in (1, 8):
                    watched = {"router": pids[loop], "agent": pids["agent"]}
                    before = {name: _cpu_seconds(pid) for name, pid in watched.items()}
                    seconds, per_request = await _level(stub, requests, concurrency)
                    cpu = {n: _cpu_seconds(pid) - before[n] for n, pid in watched.items()}
                    samples[loop][concurrency].append(
                        {
                            "requests_per_s": requests / seconds,
                            "router_ms": cpu["router"] * 1000 / requests,
                            "agent_ms": cpu["agent"] * 1000 / requests,
                            # Each SSE event the router writes is a chunk it read: two
                            # messages each.
                            "router_us_per_message": cpu["router"]
                            * 1e6
                            / (requests * per_request * 2),
                            "events_per_request": per_request,
                        }
                    )
    finally:
        await asyncio.gather(*(c.close() for c in channels.values()))
    return {
        loop: {
            conc: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for conc, runs in by_conc.items()
        }
        for loop, by_conc in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="chunks per request")
    parser.add_argument("--requests", type=int, default=600, help="requests per level")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    parser.add_argument(
        "--event-loops",
        default="uvloop,asyncio",
        help="comma-separated event loops, one router each (the router's event_loop setting)",
    )
    parser.add_argument("--serve-agent", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_agent:
        asyncio.run(_serve_agent(args.serve_agent, args.tokens))
        return
    loops = [name.strip() for name in args.event_loops.split(",") if name.strip()]
    agent_port = free_port()
    router_ports = {loop: free_port() for loop in loops}
    with tempfile.TemporaryDirectory(prefix="router-cost-") as tmp:
        routes = Path(tmp) / "routes.yaml"
        routes.write_text(
            f"models:\n  - model: {MODEL}\n    endpoints:\n"
            f"      - {{address: 127.0.0.1:{agent_port}, replica_id: r0, max_concurrency: 64}}\n"
        )
        procs = {
            "agent": subprocess.Popen(
                [
                    *(sys.executable, __file__, "--serve-agent", str(agent_port)),
                    *("--tokens", str(args.tokens)),
                ]
            ),
        }
        for loop, port in router_ports.items():
            procs[loop] = subprocess.Popen(
                [
                    *(sys.executable, "-m", "inferplane.router", "--port", str(port)),
                    *("--metrics-port", "0", "--routes-file", str(routes), "--no-json-logs"),
                    *("--event-loop", loop),
                ],
                stderr=subprocess.DEVNULL,
            )
        try:
            for port in router_ports.values():
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    grpc.channel_ready_future(channel).result(timeout=60)
            pids = {name: proc.pid for name, proc in procs.items()}
            addresses = {loop: f"127.0.0.1:{port}" for loop, port in router_ports.items()}
            results = asyncio.run(_measure(addresses, pids, args.requests, args.rounds))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(30)
    print(
        f"{'loop':>8} {'conc':>4} {'req/s':>8} {'events/req':>10} {'router ms/req':>13} "
        f"{'router us/msg':>13} {'agent ms/req':>12}   ({args.tokens} chunks per request, "
        f"medians of {args.rounds} rounds)"
    )
    for loop, by_conc in results.items():
        for concurrency, r in by_conc.items():
            print(
                f"{loop:>8} {concurrency:>4} {r['requests_per_s']:>8.1f} "
                f"{r['events_per_request']:>10.1f} {r['router_ms']:>13.2f} "
                f"{r['router_us_per_message']:>13.1f} {r['agent_ms']:>12.2f}"
            )
    first = results[loops[0]][8]
    print(f"router_us_per_message_c8: {first['router_us_per_message']:.1f}")
    print(f"router_cpu_ms_per_request_c8: {first['router_ms']:.2f}")
    if len(loops) > 1:
        ratio = first["router_ms"] / results[loops[1]][8]["router_ms"]
        print(f"router_cpu_ratio_c8: {ratio:.3f}")


if __name__ == "__main__":
    main()
