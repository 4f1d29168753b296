"""Tool-call validity of `tool_choice: "auto"` with the deployment option
`constrain_tool_choice_auto` off and on, side by side in one run, on the fixture model; and
what the constraint costs.

    .venv/bin/python bench/tool_call_validity.py [--requests 200] [--concurrency 8]
                                                 [--max-tokens 256] [--latency-requests 40]
                                                 [--repeats 5] [--max-string-length 40]
                                                 [--seed 0]
                                                 [--transport inproc] [--dump PATH]
                                                 [--tokenizer PATH ...]

Draws `--requests` random tool sets (hypothesis, `inferplane.testing.tool_schemas`: random
function names; object schemas with integer / number / boolean / string / enum / nested object /
array properties and random `required` lists) and asks one weather question per set
(`weather_requests`: the fixture model was trained to call a tool for those; greedy; thinking
off for a third, `parallel_tool_calls: false` for another third). The same requests run
through the edge (HTTP/SSE, Envoy + auth + picker) of a local stack whose kimi-tiny deployment
has the option off, then of a fresh stack with it on (one at a time: the node-agent places the
engine as `inferplane up` does), at `--concurrency`. Then, on the same stack,
`--latency-requests` requests on tool sets not seen before (so every grammar is compiled) one
at a time: TTFT (to the first chunk with text); and the fixture model's canonical cases
(`kimi_tiny.RELIABLE_CASES`, `--repeats` times), whose greedy output is grammar-valid and so the
same token for token on and off: TTFT, e2e latency and time per output token, medians.

With `--tokenizer` (a tokenizer.json or a model folder, e.g. a real Kimi K2's), first times
xgrammar in this process on that vocabulary: compiling each request's grammar, and the token
mask per step of a sample call (the fixture's vocabulary has 910 tokens, Kimi K2's 163,840).

Validity is `inferplane.parsers.validate_tool_calls` (the verdicts telemetry counts): the name
is declared, the arguments are a strict JSON object valid against the function's
`parameters`. A call cut by `--max-tokens` (the last call of a `length` response) cannot be
complete: it is counted apart, and the rate over complete calls is the constraint's figure.
Last lines:

    schema_valid_auto_unconstrained: X     (complete calls, option off)
    schema_valid_auto_constrained: X       (complete calls, option on)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import Stack, StackConfig, running_stack
from inferplane.parsers import ToolCall, validate_tool_calls
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.testing.tool_schemas import draw, tool_sets, weather_requests


@dataclass
class Outcome:
    calls: list[ToolCall]
    finish_reason: str
    ttft: float
    e2e: float
    tokens: int


@dataclass
class Mode:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    latency: list[Outcome] = field(default_factory=list)
    canonical: list[Outcome] = field(default_factory=list)
    ready_seconds: float = 0.0
    wall: float = 0.0


async def one(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> Outcome:
    """One streamed chat request through the edge: TTFT to the first chunk with text, the tool
    calls as a client assembles them from the deltas."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = math.nan
    calls: dict[int, list[str]] = {}
    finish, tokens = "", 0
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            d = choice["delta"]
            if math.isnan(ttft) and (
                d.get("content") or d.get("reasoning_content") or d.get("tool_calls")
            ):
                ttft = time.perf_counter() - start
            for tc in d.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], ["", "", ""])
                call[0] = call[0] or tc.get("id") or ""
                fn = tc.get("function") or {}
                call[1] += fn.get("name") or ""
                call[2] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return Outcome(
        [ToolCall(*calls[i]) for i in sorted(calls)],
        finish,
        ttft,
        time.perf_counter() - start,
        tokens,
    )


def stack_config(data_dir: Path, constrain: bool, transport: str) -> StackConfig:
    return StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        constrain_tool_choice_auto=constrain,
        **({"transport": transport} if transport else {}),
    )


async def run_mode(
    mode: Mode,
    stack: Stack,
    bodies: list[dict[str, Any]],
    latency_bodies: list[dict[str, Any]],
    concurrency: int,
    repeats: int,
) -> None:
    key = stack.create_api_key("bench")
    url = f"{stack.config.base_url}/chat/completions"
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        # Warm-up: vLLM's first requests, and the grammar compiler's first compilations.
        await asyncio.gather(*(one(client, url, key, b) for b in bodies[:concurrency]))
        results: list[Outcome | None] = [None] * len(bodies)
        queue = list(range(len(bodies)))

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results[i] = await one(client, url, key, bodies[i])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        mode.wall = time.perf_counter() - started
        mode.outcomes = [r for r in results if r is not None]
        for body in latency_bodies:
            mode.latency.append(await one(client, url, key, body))
        for _ in range(repeats):
            for case in kimi_tiny.RELIABLE_CASES:
                body = case.request(temperature=0, max_tokens=256)
                mode.canonical.append(await one(client, url, key, body))


def tpot(o: Outcome) -> float:
    """Seconds per output token after the first (NaN for one-token outputs)."""
    return (o.e2e - o.ttft) / (o.tokens - 1) if o.tokens > 1 else math.nan


def delta(on: dict[str, float], off: dict[str, float], name: str, digits: int = 1) -> str:
    diff = (on[name] - off[name]) * 1000
    return f"{diff:+.{digits}f} ms ({on[name] / off[name]:.2f}x)"


def median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def report(mode: Mode, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    returned = complete = valid = cut = with_calls = over_one = single = 0
    reasons: Counter[str] = Counter()
    for body, out in zip(bodies, mode.outcomes, strict=True):
        returned += len(out.calls)
        with_calls += bool(out.calls)
        if body.get("parallel_tool_calls") is False:
            single += 1
            over_one += len(out.calls) > 1
        for i, verdict in enumerate(validate_tool_calls(out.calls, body["tools"])):
            if out.finish_reason == "length" and i == len(out.calls) - 1:
                cut += 1
                continue
            complete += 1
            valid += verdict.valid
            if verdict.reason is not None:
                reasons[str(verdict.reason)] += 1
    finishes = Counter(o.finish_reason for o in mode.outcomes)
    rate = valid / complete if complete else 0.0
    all_valid = valid / returned if returned else 0.0
    tokens = sum(o.tokens for o in mode.outcomes)
    figures = {
        "rate": rate,
        "ttft": median([o.ttft for o in mode.latency]),
        "ttft_same": median([o.ttft for o in mode.canonical]),
        "e2e_same": median([o.e2e for o in mode.canonical]),
        "tpot_same": median([tpot(o) for o in mode.canonical]),
        "tokens_same": sum(o.tokens for o in mode.canonical),
        "ttft_loaded": median([o.ttft for o in mode.outcomes]),
        "tokens": tokens / len(mode.outcomes),
    }
    ready = f"stack ready in {mode.ready_seconds:.0f} s"
    print(f"\n== constrain_tool_choice_auto {mode.name} ({ready})")
    print(f"requests: {len(mode.outcomes)}, responses with tool calls: {with_calls}")
    print(
        f"calls returned: {returned}; complete: {complete}, schema-valid {valid} "
        f"({rate:.3f}); cut by max_tokens: {cut}; valid of all returned: {all_valid:.3f}"
    )
    print(f"invalid complete calls by reason: {dict(reasons) or '-'}")
    print(f"parallel_tool_calls=false requests with more than one call: {over_one} of {single}")
    print(f"finish reasons: {dict(finishes)}")
    print(
        f"at c={concurrency}: TTFT median {figures['ttft_loaded'] * 1000:.1f} ms, "
        f"{figures['tokens']:.1f} completion tokens per request, {tokens / mode.wall:.0f} tok/s"
    )
    cold = figures["ttft"] * 1000
    print(f"one at a time, new tool sets ({len(mode.latency)}): TTFT median {cold:.1f} ms")
    print(
        f"one at a time, the fixture's canonical cases ({len(mode.canonical)} requests, "
        f"{figures['tokens_same']:.0f} tokens): TTFT median {figures['ttft_same'] * 1000:.1f} ms, "
        f"e2e median {figures['e2e_same'] * 1000:.1f} ms, time per output token median "
        f"{figures['tpot_same'] * 1000:.2f} ms"
    )
    return figures


def grammar_cost(tokenizer_path: str, bodies: list[dict[str, Any]]) -> None:
    """What the constraint costs xgrammar with another vocabulary (a real model's, say), in this
    process as vLLM's xgrammar backend does it (8 threads, no cache): compiling each request's
    grammar (the tools as the replica sees them, after the wire's round trip), and filling the
    token mask at each step of a write_file call with a 600-character argument."""
    import xgrammar as xgr
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from inferplane.parsers import build_tool_constraint
    from inferplane.wire import chat_request_from_dict, chat_request_to_dict

    path = Path(tokenizer_path)
    tok: Any = (
        PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
        if path.is_file()
        else AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    )
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    seconds = []
    for body in bodies:
        seen = chat_request_to_dict(chat_request_from_dict(body))
        constraint = build_tool_constraint(
            seen["tools"],
            "auto",
            thinking=seen["chat_template_kwargs"]["thinking"],
            parallel_tool_calls=seen.get("parallel_tool_calls", True) is not False,
            constrain_auto=True,
        )
        assert constraint is not None
        started = time.perf_counter()
        compiler.compile_structural_tag(constraint.value)
        seconds.append(time.perf_counter() - started)
    seconds.sort()
    p90 = seconds[int(0.9 * (len(seconds) - 1))]
    print(
        f"\n== xgrammar with {path.name} ({len(tok)} tokens): compile per new tool set "
        f"median {statistics.median(seconds) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
        f"max {seconds[-1] * 1000:.1f} ms ({len(seconds)} grammars)"
    )
    params = {"path": {"type": "string"}, "content": {"type": "string"}}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "write_file",
                "parameters": {"type": "object", "properties": params, "required": list(params)},
            },
        }
    ]
    content = "def main():\n    print('hello world')\n    return 0\n" * 12
    arguments = json.dumps({"path": "src/app.py", "content": content})
    text = (
        "I will write it.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        f"functions.write_file:0<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    constraint = build_tool_constraint(tools, "auto", thinking=True, constrain_auto=True)
    assert constraint is not None
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(constraint.value))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for token in tok.encode(text, add_special_tokens=False):
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        steps.append(time.perf_counter() - started)
        if not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} of the sample answer")
    steps.sort()
    print(
        f"token mask per step ({len(steps)} steps): median {statistics.median(steps) * 1e6:.0f} "
        f"us, p90 {steps[int(0.9 * (len(steps) - 1))] * 1e6:.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--latency-requests", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5, help="of the canonical cases")
    parser.add_argument("--max-string-length", type=int, default=40, help="largest maxLength")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", default="", help="engine transport ('': the default)")
    parser.add_argument("--dump", default="", help="write each mode's outcomes to DUMP.<mode>")
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        help="also time xgrammar on this tokenizer (a tokenizer.json or a model folder; repeat)",
    )
    args = parser.parse_args()

    started = time.perf_counter()
    sets = draw(
        tool_sets(max_length=args.max_string_length),
        args.requests + args.latency_requests,
        args.seed,
    )
    bodies = weather_requests(sets[: args.requests], max_tokens=args.max_tokens)
    latency_bodies = weather_requests(sets[args.requests :], max_tokens=args.max_tokens)
    print(
        f"{len(bodies)} + {len(latency_bodies)} requests, "
        f"{time.perf_counter() - started:.1f} s to draw the tool sets"
    )
    for tokenizer in args.tokenizer:
        grammar_cost(tokenizer, bodies + latency_bodies)
    figures = {}
    for name, constrain in (("off", False), ("on", True)):
        mode = Mode(name)
        with tempfile.TemporaryDirectory(prefix="tool-call-validity-") as tmp:
            started = time.perf_counter()
            with running_stack(stack_config(Path(tmp), constrain, args.transport)) as stack:
                mode.ready_seconds = time.perf_counter() - started
                asyncio.run(
                    run_mode(mode, stack, bodies, latency_bodies, args.concurrency, args.repeats)
                )
        figures[name] = report(mode, bodies, args.concurrency)
        if args.dump:
            rows = [
                {"body": b, "finish": o.finish_reason, "calls": [asdict(c) for c in o.calls]}
                for b, o in zip(bodies, mode.outcomes, strict=True)
            ]
            Path(f"{args.dump}.{name}").write_text(json.dumps(rows, indent=1))
    off, on = figures["off"], figures["on"]
    print("\n== cost of the constraint, one request at a time (on − off, medians)")
    print(f"TTFT, new tool sets (a grammar compiled per request): {delta(on, off, 'ttft')}")
    same = on["tokens_same"] == off["tokens_same"]
    print(f"canonical cases ({'the same' if same else 'NOT the same'} output tokens on and off):")
    print(f"  TTFT {delta(on, off, 'ttft_same')}, e2e {delta(on, off, 'e2e_same')}")
    print(f"  time per output token {delta(on, off, 'tpot_same', 2)}")
    print(f"schema_valid_auto_unconstrained: {off['rate']:.3f}")
    print(f"schema_valid_auto_constrained: {on['rate']:.3f}")


if __name__ == "__main__":
    main()
