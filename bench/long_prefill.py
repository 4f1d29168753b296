"""What a long agent prompt costs the kimi-tiny fixture on this CPU: the first prefill of an
N-token prompt, then the next turn (the same prompt + the generated token + 500 new tokens)
with the prefix served from vLLM's prefix cache.

    .venv/bin/python bench/long_prefill.py [--sizes 8192,32768,100000] [--max-model-len N]
        [--max-num-batched-tokens T]

The engine is the replica process's own (`inproc`: vLLM's `AsyncLLM` in this process, started
from the engine arguments `engine_argv` gives a replica spec, with the replica's CPU
environment `engine_environment`), configured as the local stack deploys kimi-tiny (fp32,
eager, `max_model_len` = `kimi_tiny.MAX_MODEL_LEN`, 16 sequences, a 1 GiB KV cache; vLLM's
defaults for the rest: chunked prefill of 2,048 tokens per step on CPU, prefix caching on).
Prompts are random token ids of the plain BPE range (a fixed seed per size, so sizes share no
prefix); `max_tokens` is 1, so the time is the prefill's. One request at a time.

Prints per size `prompt_tokens`, `first_prefill_s`, `next_turn_tokens`, `next_turn_s` and the
cached tokens the engine reported, then `first_prefill_seconds_<N>: X` per size (the largest
size last). The machine's other load adds to every figure: run it on a quiet box, or read the
spread of a few runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.fixtures import kimi_tiny

GIB = 1024**3
NEXT_TURN_TOKENS = 500
# kimi-tiny's ids 0-5 are special tokens and 903-909 its think/tool markers; ids 6-902 are
# plain BPE pieces (models/kimi-tiny/MANIFEST.json `token_ids`).
PLAIN_IDS = range(6, 903)


def spec(max_model_len: int, extra: list[str]) -> nodeagent_pb2.ReplicaSpec:
    """A replica spec of kimi-tiny as the local stack deploys it (`kimi_tiny_deployment`)."""
    return nodeagent_pb2.ReplicaSpec(
        deployment=kimi_tiny.SERVED_MODEL_NAME,
        served_model_name=kimi_tiny.SERVED_MODEL_NAME,
        model_source=str(kimi_tiny.model_path()),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=16,
        kv_cache_bytes=GIB,
        extra_engine_args=extra,
    )


async def timed(engine: object, request_id: str, ids: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the finished output, cached prompt tokens, generated ids) of one request."""
    from inferplane.replica.engines.base import SamplingParams

    started = time.monotonic()
    cached, out = 0, []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for piece in engine.generate(request_id, ids, params):  # type: ignore[attr-defined]
        cached = piece.cached_tokens
        out.extend(piece.token_ids)
    return time.monotonic() - started, cached, out


async def run(args: argparse.Namespace) -> dict[int, float]:
    from inferplane.replica.engines.environment import apply_engine_environment, patch_vllm_version

    extra = []
    if args.max_num_batched_tokens:
        extra = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    replica = spec(args.max_model_len, extra)
    cache_root = Path(tempfile.mkdtemp(prefix="long-prefill-"))
    apply_engine_environment(os.environ, cpu=True, cache_root=cache_root)
    patch_vllm_version(True)
    from inferplane.replica.engines.inproc import InprocEngine, engine_argv

    started = time.monotonic()
    engine = await InprocEngine.start(engine_argv(replica, cpu=True))
    print(f"engine ready in {time.monotonic() - started:.1f} s", flush=True)
    firsts: dict[int, float] = {}
    try:
        await timed(engine, "warmup", [PLAIN_IDS[0]] * 16)
        for size in args.sizes:
            rng = random.Random(size)
            prompt = [rng.choice(PLAIN_IDS) for _ in range(size)]
            first, _, generated = await timed(engine, f"first-{size}", prompt)
            turn = prompt + generated + [rng.choice(PLAIN_IDS) for _ in range(NEXT_TURN_TOKENS)]
            second, cached, _ = await timed(engine, f"next-{size}", turn)
            firsts[size] = first
            print(
                f"prompt_tokens={size} first_prefill_s={first:.2f} "
                f"next_turn_tokens={len(turn)} next_turn_s={second:.2f} cached_tokens={cached}",
                flush=True,
            )
    finally:
        await engine.close()
    return firsts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[8192, 32768, 100_000],
        help="prompt sizes in tokens, comma-separated (each < --max-model-len)",
    )
    ap.add_argument("--max-model-len", type=int, default=kimi_tiny.MAX_MODEL_LEN)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="vLLM's prefill chunk (tokens per engine step); 0: vLLM's default (2,048 on CPU)",
    )
    args = ap.parse_args()
    if max(args.sizes) + 1 + NEXT_TURN_TOKENS + 1 > args.max_model_len:
        ap.error(f"the largest size's next turn does not fit --max-model-len {args.max_model_len}")
    firsts = asyncio.run(run(args))
    load = os.getloadavg()[0]
    print(f"load_average_1min_after: {load:.1f}")
    for size in sorted(firsts):
        print(f"first_prefill_seconds_{size}: {firsts[size]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
