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
bench/edge_overhead.py and bench/stack_vs_vllm.py). One router runs per event loop in
`--event-loops` (`event_loop` setting; default `uvloop,asyncio`) and per gRPC core setting in
`--grpc-experiments` (`;`-separated `GRPC_EXPERIMENTS` values; `service`, the default, is what
the service entry points set, inferplane/grpc_core.py; `grpc` is gRPC's own defaults), all
against the same fake node-agent, measured in alternation for `--rounds` rounds; figures are
medians over rounds. `--step-ms` paces the fake node-agent like an engine: all streams get
their next chunk together every step (0: as fast as it can, which lets gRPC batch messages).
Voluntary context switches per request (all the router's threads, /proc) are printed too.
Last lines: `router_cpu_ms_per_request_c8: X` (the first router listed) and, with two or more,
`router_cpu_ratio_c8: R` (first router's CPU per request / second's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from inferplane.grpc_core import EXPERIMENTS_ENV
from inferplane.runtime.ports import free_port

MODEL = "kimi-tiny"


class _Agent(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, tokens: int, step_s: float) -> None:
        self.tokens = tokens
        self.step_s = step_s
        self._step = asyncio.Event()

    async def steps(self) -> None:
        """Wakes every stream waiting for its next chunk once per `step_s`, like engine steps."""
        while True:
            await asyncio.sleep(self.step_s)
            self._step.set()
            self._step = asyncio.Event()

    async def StreamChatCompletion(self, request: Any, context: Any) -> Any:
        head = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk"}
        head |= {"created": 1_700_000_000, "model": MODEL}
        first = pb.StreamChatCompletionResponse(**head)
        first.choices.add(index=0, delta=pb.ChatCompletionDelta(role="assistant", content=""))
        yield first
        for i in range(self.tokens):
            if self.step_s:
                await self._step.wait()
            chunk = pb.StreamChatCompletionResponse(**head)
            choice = chunk.choices.add(index=0, delta=pb.ChatCompletionDelta(content=" word"))
            if i == self.tokens - 1:
                choice.finish_reason = "length"
            yield chunk
        last = pb.StreamChatCompletionResponse(**head)
        last.usage.prompt_tokens, last.usage.completion_tokens = 128, self.tokens
        last.usage.total_tokens = 128 + self.tokens
        yield last


async def _serve_agent(port: int, tokens: int, step_s: float) -> None:
    agent = _Agent(tokens, step_s)
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(agent, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    steps = asyncio.create_task(agent.steps()) if step_s else None
    await server.wait_for_termination()
    if steps:
        steps.cancel()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of all of `pid`'s threads (each one a sleep and a wake)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


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
                    switches = _voluntary_switches(pids[loop])
                    seconds, per_request = await _level(stub, requests, concurrency)
                    cpu = {n: _cpu_seconds(pid) - before[n] for n, pid in watched.items()}
                    switches = _voluntary_switches(pids[loop]) - switches
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
                            "router_switches_per_request": switches / requests,
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


def _router_env(experiments: str) -> dict[str, str]:
    """The router's environment for a `--grpc-experiments` value."""
    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    if experiments == "grpc":
        env[EXPERIMENTS_ENV] = ""  # set, so the entry point keeps it: gRPC's own defaults
    elif experiments != "service":
        env[EXPERIMENTS_ENV] = experiments
    return env  # "service": unset, the entry point sets SERVICE_EXPERIMENTS


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
    parser.add_argument(
        "--grpc-experiments",
        default="service",
        help="';'-separated GRPC_EXPERIMENTS values, one router each: 'service' (what the "
        "entry point sets), 'grpc' (gRPC's defaults) or a value such as "
        "'-event_engine_client'",
    )
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="engine step of the fake node-agent (0: none)"
    )
    parser.add_argument("--serve-agent", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_agent:
        asyncio.run(_serve_agent(args.serve_agent, args.tokens, args.step_ms / 1000))
        return
    loops = [name.strip() for name in args.event_loops.split(",") if name.strip()]
    settings = [value.strip() for value in args.grpc_experiments.split(";") if value.strip()]
    routers = {
        (f"{loop}/{exp}" if len(settings) > 1 else loop): (loop, exp)
        for loop in loops
        for exp in settings
    }
    agent_port = free_port()
    router_ports = {name: free_port() for name in routers}
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
                    *("--tokens", str(args.tokens), "--step-ms", str(args.step_ms)),
                ]
            ),
        }
        for name, port in router_ports.items():
            loop, experiments = routers[name]
            procs[name] = subprocess.Popen(
                [
                    *(sys.executable, "-m", "inferplane.router", "--port", str(port)),
                    *("--metrics-port", "0", "--routes-file", str(routes), "--no-json-logs"),
                    *("--event-loop", loop),
                ],
                env=_router_env(experiments),
                stderr=subprocess.DEVNULL,
            )
        try:
            for port in router_ports.values():
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    grpc.channel_ready_future(channel).result(timeout=60)
            pids = {name: proc.pid for name, proc in procs.items()}
            addresses = {name: f"127.0.0.1:{port}" for name, port in router_ports.items()}
            results = asyncio.run(_measure(addresses, pids, args.requests, args.rounds))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(30)
    width = max(8, *(len(name) for name in routers))
    print(
        f"{'router':>{width}} {'conc':>4} {'req/s':>8} {'events/req':>10} {'router ms/req':>13} "
        f"{'router us/msg':>13} {'switches/req':>12} {'agent ms/req':>12}   ({args.tokens} "
        f"chunks per request, step {args.step_ms:g} ms, medians of {args.rounds} rounds)"
    )
    for name, by_conc in results.items():
        for concurrency, r in by_conc.items():
            print(
                f"{name:>{width}} {concurrency:>4} {r['requests_per_s']:>8.1f} "
                f"{r['events_per_request']:>10.1f} {r['router_ms']:>13.2f} "
                f"{r['router_us_per_message']:>13.1f} "
                f"{r['router_switches_per_request']:>12.1f} {r['agent_ms']:>12.2f}"
            )
    names = list(routers)
    first = results[names[0]][8]
    print(f"router_us_per_message_c8: {first['router_us_per_message']:.1f}")
    print(f"router_cpu_ms_per_request_c8: {first['router_ms']:.2f}")
    if len(names) > 1:
        ratio = first["router_ms"] / results[names[1]][8]["router_ms"]
        print(f"router_cpu_ratio_c8: {ratio:.3f}")


if __name__ == "__main__":
    main()
