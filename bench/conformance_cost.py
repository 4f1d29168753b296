"""What the conformance gate's live phase costs on kimi-tiny, and where its time goes.

    .venv/bin/python bench/conformance_cost.py [--seeds 1-5,7] [--requests 12] [--max-tokens N]

For each seed, the gate's live requests (`inferplane.conformance.live_requests`, the family's
thinking switch) are sent through the replica's own pipeline and a real in-process vLLM engine
(`serve_inproc`: render → engine → parse, kimi-tiny fp32, `constrain_tool_choice_auto` on as
the local stack deploys it), `LIVE_CONCURRENCY` at a time as `RunConformance` sends them, and
scored by `LiveTally`. Per request: tool_choice, thinking, `max_tokens`, completion tokens,
finish reason, calls returned, and for an answer cut by `max_tokens` the tail of what it wrote
(reasoning, content or the last call's arguments: where in the grammar it ran on). Per seed:
the live phase's wall seconds and the tally (calls returned / expected, schema-valid).
`--max-tokens` sends every request with that `max_tokens` instead of the gate's caps
(`FORCED_MAX_TOKENS`, `AUTO_MAX_TOKENS`): 1024 is the gate before they were set.

Last lines: `conformance_live_seconds_median`, `conformance_live_seconds_max`,
`conformance_forced_calls_returned N/M` and `conformance_largest_complete_forced_call_tokens`
(what a complete forced call needs: the basis of `FORCED_MAX_TOKENS`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from typing import Any

from google.protobuf import json_format

from inferplane.conformance import LiveRequest, LiveTally, family_markers, live_requests
from inferplane.replica.pipeline.assets import load_model_assets
from inferplane.replica.server.conformance import LIVE_CONCURRENCY
from inferplane.replica.testing.structured import ask, kimi_tiny_inproc_spec, serve_inproc


def _where(message: dict[str, Any]) -> str:
    """Where an answer cut by max_tokens was writing: the tail of its last part."""
    calls = message.get("tool_calls") or []
    if calls:
        args = (calls[-1].get("function") or {}).get("arguments") or ""
        return f"call {len(calls)} arguments ...{args[-60:]!r}"
    content = message.get("content") or ""
    if content:
        return f"content ...{content[-60:]!r}"
    reasoning = message.get("reasoning_content") or ""
    return f"reasoning ...{reasoning[-60:]!r}"


def _seeds(text: str) -> list[int]:
    """`1,2,5-9` → [1, 2, 5, 6, 7, 8, 9]."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


async def run_seed(
    stub: Any,
    model: str,
    seed: int,
    n: int,
    thinking_kwarg: str | None,
    tally: LiveTally,
    max_tokens: int = 0,
) -> tuple[float, list[tuple[LiveRequest, dict[str, Any], float]]]:
    drawn = live_requests(n, seed, thinking_kwarg)
    if max_tokens:
        drawn = [replace(r, body={**r.body, "max_tokens": max_tokens}) for r in drawn]
    gate = asyncio.Semaphore(LIVE_CONCURRENCY)

    async def one(live: LiveRequest) -> tuple[LiveRequest, dict[str, Any], float]:
        async with gate:
            began = time.perf_counter()
            response = await ask(stub, {**live.body, "model": model})
            answer = json_format.MessageToDict(response, preserving_proto_field_name=True)
            return live, answer, time.perf_counter() - began

    began = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in drawn))
    took = time.perf_counter() - began
    for live, answer, _ in results:
        tally.add(live, answer)
    return took, list(results)


async def main_async(args: argparse.Namespace) -> None:
    spec = kimi_tiny_inproc_spec()
    spec.constrain_tool_choice_auto = True
    assets = load_model_assets(spec)
    markers, reasoning = (
        family_markers(assets.parser.config.terminals) if assets.parser else ([], [])
    )
    thinking_kwarg = assets.chat_family.thinking_kwarg
    seeds = _seeds(args.seeds)
    walls: list[float] = []
    returned = expected = 0
    largest_forced = 0
    started = time.perf_counter()
    async with serve_inproc(spec, max_num_seqs=16) as stub:
        print(f"engine ready in {time.perf_counter() - started:.0f} s")
        for seed in seeds:
            tally = LiveTally(markers=markers, reasoning_markers=reasoning)
            took, results = await run_seed(
                stub,
                spec.served_model_name,
                seed,
                args.requests,
                thinking_kwarg,
                tally,
                args.max_tokens,
            )
            walls.append(took)
            returned += tally.tool_calls_returned
            expected += tally.tool_calls_expected
            print(
                f"\n== seed {seed}: live phase {took:.1f} s; calls returned "
                f"{tally.tool_calls_returned}/{tally.tool_calls_expected}, schema-valid "
                f"{tally.tool_calls_schema_valid}/{tally.tool_calls}, errors {tally.errors}, "
                f"finish mismatches {tally.finish_reason_mismatches}, leaked "
                f"{tally.leaked_markers}"
            )
            for live, answer, seconds in results:
                choice = answer["choices"][0]
                message = choice.get("message", {})
                finish = choice.get("finish_reason", "")
                tokens = int((answer.get("usage") or {}).get("completion_tokens", 0))
                calls = len(message.get("tool_calls") or [])
                if live.expects_call and calls and finish != "length":
                    largest_forced = max(largest_forced, tokens)
                thinking = "on " if live.thinking else "off"
                cap = live.body["max_tokens"]
                line = (
                    f"  {live.index:2d} {live.tool_choice:8s} thinking {thinking} max {cap:4d}"
                    f" tokens {tokens:4d} {finish:10s} calls {calls} {seconds:5.1f} s"
                )
                if finish == "length":
                    line += f"  cut: {_where(message)}"
                print(line)
            for problem in tally.problems:
                print(f"  problem: {problem}")
    print(f"\nconformance_live_seconds_median: {statistics.median(walls):.1f}")
    print(f"conformance_live_seconds_max: {max(walls):.1f}")
    print(f"conformance_forced_calls_returned {returned}/{expected}")
    print(f"conformance_largest_complete_forced_call_tokens: {largest_forced}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument(
        "--max-tokens", type=int, default=0, help="every request's max_tokens (0: the gate's)"
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
