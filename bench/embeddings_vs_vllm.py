"""Embeddings through the whole stack vs plain `vllm serve` on the same model (issue 19).

    .venv/bin/python bench/embeddings_vs_vllm.py [--requests 64] [--concurrency 4] [--rounds 3]
                                                 [--batches 1,32]

Serves the fixture embedding model (embed-tiny, vLLM's pooling runner on the CPU engine) two
ways, one after the other (two engines at once would share the 2 cores): (a) plain `vllm serve`
(through the node-agent's launcher, as the platform starts engines, with the engine arguments
the stack's replica gets: fp32, max model length 512, 16 sequences, eager), `POST
/v1/embeddings` over HTTP; (b) the local stack serving embed-tiny alone (mTLS between the
services, Envoy + ext_authz + the endpoint picker, the replica process with AsyncLLM
in-process), `POST /v1/embeddings` through the edge with an API key. For each batch size
(inputs per request: short sentences), `--rounds` rounds of `--requests` requests at
`--concurrency`; inputs/s per round, the median reported. Last lines:

    stack_vs_vllm_embeddings_per_s_b1: X
    stack_vs_vllm_embeddings_per_s_b32: Y
    stack_vs_vllm_embeddings_per_s: min(X, Y)   (goal ≥ 0.9)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from inferplane.fixtures import embed_tiny
from inferplane.localstack import EMBED_MODEL_NAME, Stack, StackConfig
from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port, free_port_run

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "near",
    "paris",
    "in",
    "the",
    "morning",
    "light",
]


def sentences(count: int, offset: int) -> list[str]:
    """`count` short distinct sentences (8-12 words)."""
    out = []
    for i in range(count):
        n = 8 + (i + offset) % 5
        out.append(" ".join(WORDS[(i + offset + k) % len(WORDS)] for k in range(n)))
    return out


async def _round(
    url: str, headers: dict[str, str], batch: int, requests: int, concurrency: int
) -> float:
    """Inputs per second over `requests` requests of `batch` inputs at `concurrency`."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {"model": EMBED_MODEL_NAME, "input": sentences(batch, i)}
                response = await client.post(url, json=body)
                response.raise_for_status()
                assert len(response.json()["data"]) == batch

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return requests * batch / elapsed


def measure(
    url: str, headers: dict[str, str], batches: Sequence[int], args: argparse.Namespace
) -> dict[int, float]:
    """Median inputs/s per batch size (one warm-up request first)."""
    asyncio.run(_round(url, headers, 1, 2, 1))
    out: dict[int, float] = {}
    for batch in batches:
        rates = [
            asyncio.run(_round(url, headers, batch, args.requests, args.concurrency))
            for _ in range(args.rounds)
        ]
        out[batch] = statistics.median(rates)
        print(f"#   batch {batch}: " + ", ".join(f"{r:.1f}" for r in rates) + " inputs/s")
    return out


@contextlib.contextmanager
def plain_vllm(work: Path) -> Iterator[str]:
    """`vllm serve` on embed-tiny with the stack replica's engine arguments; yields its URL."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "inferplane.replica.engines.launcher",
        "--device",
        "cpu",
        "--cache-root",
        str(work / "cache"),
        "--",
        *embed_tiny.serve_args(),
        "--max-num-seqs",
        "16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = (work / "vllm.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (work / "vllm.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "vllm serve not ready in 180 s"
            time.sleep(0.5)
        yield f"{base}/v1/embeddings"
    finally:
        procguard.kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,32", help="inputs per request")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("# plain vllm serve", flush=True)
        with plain_vllm(work) as url:
            vllm = measure(url, {}, batches, args)
        print("# the stack (embed-tiny only)", flush=True)
        config = StackConfig(
            data_dir=work / "stack",
            http_port=free_port(),
            grpc_base_port=free_port_run(5),
            metrics_base_port=free_port_run(5),
            envoy_admin_port=free_port(),
            chat=False,
            embeddings=True,
        )
        stack = Stack(config)
        stack.start(lambda m: print(f"#   {m}", flush=True))
        try:
            key = stack.create_api_key("bench")
            url = f"{config.base_url}/embeddings"
            through = measure(url, {"authorization": f"Bearer {key}"}, batches, args)
        finally:
            stack.stop()
    print(f"{'batch':>5} {'vllm inputs/s':>14} {'stack inputs/s':>15} {'ratio':>6}")
    ratios = []
    for batch in batches:
        ratio = through[batch] / vllm[batch]
        ratios.append(ratio)
        print(f"{batch:>5} {vllm[batch]:>14.1f} {through[batch]:>15.1f} {ratio:>6.3f}")
    for batch, ratio in zip(batches, ratios, strict=True):
        print(f"stack_vs_vllm_embeddings_per_s_b{batch}: {ratio:.3f}")
    print(f"stack_vs_vllm_embeddings_per_s: {min(ratios):.3f}")


if __name__ == "__main__":
    main()
