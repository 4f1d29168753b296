"""CPU the node-agent spends reading one engine stream (the `http-completions` transport).

    .venv/bin/python bench/engine_client_cost.py [--requests 200] [--concurrency 8] [--rounds 3]

Starts the fake vLLM HTTP server
(libs/inferplane/testing/fake_http_engine.py: one SSE event per
token, as vLLM streams at stream interval 1) in its own process, then measures in this
process, side by side and alternating rounds, the CPU time (process_time) per 64-token
streamed request of:

- `HttpEngineClient.generate` (aiohttp; what the node-agent runs);
- the same SSE reading done with httpx (`AsyncClient.stream` + `aiter_raw`, the client this
  transport used before): the reference the choice of aiohttp is measured against.

Prints the median per round; last line `engine_client_cpu_ms_per_request: X`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx

from inferplane.replica.engines.base import SamplingParams
from inferplane.replica.engines.http_client import HttpEngineClient, to_completion_body
from inferplane.runtime.processes.ports import free_port

TOKENS = 64


async def _rate(one: Callable[[int], Awaitable[int]], requests: int, concurrency: int) -> float:
    """CPU ms per request over `requests` requests at `concurrency`."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> int:
        async with gate:
            return await one(i)

    start = time.process_time()
    tokens = await asyncio.gather(*(limited(i) for i in range(requests)))
    spent = time.process_time() - start
    assert all(t == TOKENS for t in tokens), tokens[:4]
    return spent * 1000 / requests


async def _run(port: int, requests: int, concurrency: int, rounds: int) -> dict[str, list[float]]:
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    ours = HttpEngineClient(f"http://127.0.0.1:{port}")
    ref = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None, trust_env=False)

    async def with_ours(i: int) -> int:
        return sum([len(o.token_ids) async for o in ours.generate(f"a{i}", [1, 2, 3], params)])

    async def with_httpx(i: int) -> int:
        body = to_completion_body(f"h{i}", [1, 2, 3], params)
        count, buffer = 0, b""
        async with ref.stream("POST", "/v1/completions", json=body) as response:
            async for data in response.aiter_raw():
                buffer += data
                cut = buffer.rfind(b"\n\n")
                if cut < 0:
                    continue
                complete, buffer = buffer[:cut], buffer[cut + 2 :]
                for event in complete.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        for choice in json.loads(event[6:]).get("choices") or ():
                            count += len(choice.get("token_ids") or ())
        return count

    paths = {"aiohttp (HttpEngineClient)": with_ours, "httpx (reference)": with_httpx}
    results: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for one in paths.values():  # warm-up: connections, imports, caches
            await _rate(one, concurrency * 2, concurrency)
        for _ in range(rounds):
            for name, one in paths.items():
                results[name].append(await _rate(one, requests, concurrency))
    finally:
        await ours.close()
        await ref.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferplane.testing.fake_http_engine",
            "--",
            "serve",
            "fake",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        results = asyncio.run(_run(port, args.requests, args.concurrency, args.rounds))
    finally:
        engine.terminate()
        engine.wait(10)
    print(
        f"CPU ms per {TOKENS}-token streamed request, c={args.concurrency}, {args.rounds} rounds:"
    )
    for name, values in results.items():
        print(
            f"  {name:<28} median {statistics.median(values):6.2f}  (rounds: "
            + ", ".join(f"{v:.2f}" for v in values)
            + ")"
        )
    ours, ref = (statistics.median(v) for v in results.values())
    print(f"httpx_over_aiohttp_cpu_ratio: {ref / ours:.2f}")
    print(f"engine_client_cpu_ms_per_request: {ours:.2f}")


if __name__ == "__main__":
    main()
