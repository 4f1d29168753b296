"""CPU cost of the replica process's inference pipeline per generated token.

Replays a long Kimi K2.5-format output (reasoning, `</think>`, an answer with multi-byte text,
then tool calls with large arguments), tokenized by the REAL fixture tokenizer
(models/kimi-tiny), through the pipeline's stages with an engine that costs nothing, one token
per engine increment (the worst case: vLLM streams one token per step per request):

- `detokenize`: `IncrementalDetokenizer.push` (DecodeStream + stop-string bookkeeping);
- `detokenize_parse`: `Generation.steps()` (async iteration, detokenize, the Kimi parser
  session per token (which also assembles the response and counts reasoning tokens), stream
  interval);
- `pipeline` = that + building each chunk message (`ChatChunks.step`) and serialising it, which
  is what the servicer hands to gRPC;
- `grpc_stream`: the whole StreamChatCompletion over in-process gRPC (loopback, client
  included; informative: it is mostly gRPC's own cost).

Run: `python bench/pipeline_cost.py [--tokens N]` (set INFERPLANE_KIMI_TINY if the model lives
elsewhere). One figure per line; the last line is `pipeline_us_per_token: X`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections.abc import AsyncIterator, Sequence

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput, SamplingParams
from inferplane.replica.pipeline.chunks import ChatChunks
from inferplane.replica.pipeline.detokenize import IncrementalDetokenizer
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica.testing.pipeline import (
    TickingClock,
    kimi_tiny_assets,
    kimi_tiny_ids,
    run_scenario,
    script,
)
from inferplane.runtime.time.clock import SystemClock
from inferplane.wire import chat_request_from_dict

WORDS = [
    "the",
    "user",
    "wants",
    "weather",
    "in",
    "Tokyo,",
    "日本語",
    "café",
    "😀",
    "so",
    "I",
    "will",
]


def kimi_output(approx_tokens: int) -> str:
    """Reasoning (~60%), </think>, an answer (~20%), then 4 tool calls (~20%)."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    reasoning = words(int(approx_tokens * 0.45))
    content = words(int(approx_tokens * 0.15))
    calls = "".join(
        f"<|tool_call_begin|>functions.web_search:{i}<|tool_call_argument_begin|>"
        f'{{"query": "{words(int(approx_tokens * 0.035))}", "max_results": 3}}<|tool_call_end|>'
        for i in range(4)
    )
    return (
        f"{reasoning}</think>{content}<|tool_calls_section_begin|>{calls}"
        "<|tool_calls_section_end|><|im_end|>"
    )


class FreeEngine:
    """Yields pre-built increments without touching the event loop (no I/O, no sleeps)."""

    def __init__(self, outputs: Sequence[EngineOutput]) -> None:
        self.outputs = outputs

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        for out in self.outputs:
            yield out

    async def abort(self, request_id: str) -> None:
        return None


def best_of(runs: int, fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8000, help="approximate output length")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    assets = kimi_tiny_assets()
    ids = kimi_tiny_ids(kimi_output(args.tokens))
    n = len(ids)
    outputs = script(ids)
    prompt = kimi_tiny_ids("<|im_assistant|>assistant<|im_middle|><think>")
    params = SamplingParams(max_tokens=n)

    def detokenize() -> None:
        detokenizer = IncrementalDetokenizer(assets.backend, prompt)
        for out in outputs:
            detokenizer.push(out.token_ids)
        detokenizer.finish()

    def generation(build_chunks: bool) -> None:
        async def go() -> None:
            gen = Generation(
                engine=FreeEngine(outputs),
                request_id="bench",
                prompt_ids=prompt,
                params=params,
                backend=assets.backend,
                stop_token_ids=assets.eos_token_ids,
                session=assets.parser.start(thinking=True),
                clock=SystemClock(),
                started=0.0,
            )
            chunks = ChatChunks("chatcmpl-bench", 1, "kimi-tiny", "")
            async for step in gen.steps():
                if build_chunks and not step.empty:
                    chunks.step(step).SerializeToString()
            assert gen.finish_reason == "tool_calls", gen.finish_reason
            assert not gen.session.result().marker_leaked

        asyncio.run(go())

    print(f"output_tokens: {n}")
    detok = best_of(args.runs, detokenize) / n * 1e6
    print(f"detokenize_us_per_token: {detok:.2f}")
    parse = best_of(args.runs, lambda: generation(False)) / n * 1e6
    print(f"detokenize_parse_us_per_token: {parse:.2f}")
    pipeline = best_of(args.runs, lambda: generation(True)) / n * 1e6

    from inferplane.replica.testing.pipeline import ScriptedEngine

    elapsed: list[float] = []

    async def grpc_body(stub) -> None:  # type: ignore[no-untyped-def]
        request = pb.StreamChatCompletionRequest(
            request=chat_request_from_dict(kt.WEATHER.request())
        )
        for _ in range(max(2, args.runs // 2)):
            start = time.perf_counter()
            count = 0
            async for _chunk in stub.StreamChatCompletion(request):
                count += 1
            elapsed.append(time.perf_counter() - start)

    run_scenario(ScriptedEngine(outputs), grpc_body, clock=TickingClock())
    print(f"grpc_stream_us_per_token: {min(elapsed) / n * 1e6:.2f}")
    print(f"pipeline_us_per_token: {pipeline:.2f}")


if __name__ == "__main__":
    main()
