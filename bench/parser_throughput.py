"""Kimi K2 streaming parser throughput: inferplane's parser vs the installed vLLM's.

Streams long synthetic Kimi K2.5 outputs one token per delta (text + that token's id, as the
node-agent does after incremental detokenization) through ``inferplane.parsers`` and through
vLLM's ``vllm.parser.kimi_k2.KimiK2Parser.parse_delta`` on the very same deltas, checks both
parse them to the same reasoning / content / tool calls, and prints tokens/s for each, the
ratio, and the per-token cost at 1k, 10k and 50k tokens (flat = O(n) overall).

Workloads: "agentic" = 2k tokens of reasoning, a short answer, then 5 tool calls with large
arguments (~600 tokens each, code with ``<`` characters); "long" = the same shape at 50k
tokens. Tokens are 1-6 character pieces from a stub tokenizer whose vocab holds the Kimi
markers as single tokens (ids resolved from that vocab, as with a real tokenizer).

Both parsers get the request's tools (each function: ``path`` string, ``content`` string,
``line`` integer), so ours pays for what production pays: names checked against the tools and
arguments streamed through the repair / coercion rewriter. A line also gives our parser
without tools on the same deltas, and what the tools cost (goal: at most 10% of the ratio).

Run: ``python bench/parser_throughput.py [--quick]``. The last line is
``parser_speedup_vs_vllm: X.XX`` (agentic workload, tokens/s ratio; goal >= 2).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs"))

from inferplane.parsers import KIMI_K2_MARKERS, ParseResult, build_parser

TE = "</think>"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WORDS = [
    "the", "user", "wants", "weather", "for", "Tokyo", "so", "I", "should", "call", "tool",
    "with", "city", "and", "then", "compare", "results", "against", "yesterday", "before",
    "answering", ";", "maybe", "also", "search", "docs", ",", "check", "units",
]  # fmt: skip
TOOLS = ["read_file", "write_file", "search", "run_tests", "get_weather"]
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": n,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "line": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    }
    for n in TOOLS
]


@dataclass(frozen=True)
class Workload:
    name: str
    tokens: list[tuple[str, int]]  # (text, token id) per delta


class Vocab:
    """Grows a vocab from generated pieces; markers are single tokens."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        for m in KIMI_K2_MARKERS:
            self.id(m)

    def id(self, piece: str) -> int:
        return self.ids.setdefault(piece, len(self.ids) + 1000)


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def make_output(n_tokens: int, vocab: Vocab, seed: int = 0) -> list[tuple[str, int]]:
    """~40% of ``n_tokens`` reasoning (at least 2k when there is room), a short answer, then
    5 tool calls sharing the rest as large JSON arguments."""
    rng = random.Random(seed)
    toks: list[tuple[str, int]] = []

    def text(s: str) -> None:
        toks.extend((p, vocab.id(p)) for p in _pieces(s, rng))

    def marker(m: str) -> None:
        toks.append((m, vocab.id(m)))

    reasoning_tokens = max(min(2000, n_tokens // 2), int(n_tokens * 0.4))
    while len(toks) < reasoning_tokens:
        text(" ".join(rng.choice(WORDS) for _ in range(12)) + ".\n")
    marker(TE)
    text("I'll make the changes now.")
    marker(SB)
    per_call = max(50, (n_tokens - len(toks)) // 5 - 6)
    for i, name in enumerate(TOOLS):
        marker(CB)
        text(f"functions.{name}:{i}")
        marker(AB)
        body: list[str] = []
        chars = 0
        while chars < per_call * 3.5:  # pieces average 3.5 characters
            body.append(rng.choice(["<div class='x'>", "if a < b:", " return a", "\n", " x <= 3"]))
            body.append(" ".join(rng.choice(WORDS) for _ in range(4)))
            chars += len(body[-1]) + len(body[-2]) + 2
        text(json.dumps({"path": f"src/{name}.py", "content": "".join(body)}))
        marker(CE)
    marker(SE)
    return toks


def run_ours(
    tokens: list[tuple[str, int]], vocab: dict[str, int], tools: bool = True
) -> tuple[float, ParseResult]:
    parser = build_parser("kimi_k2", vocab=vocab)
    gc.collect()
    gc.disable()  # the bench keeps every delta alive; a real stream does not
    t0 = time.perf_counter()
    s = parser.start(thinking=True, tools=TOOL_SCHEMAS if tools else None)
    feed = s.feed
    deltas = [feed(t, [tid]) for t, tid in tokens]
    deltas.append(s.finish())
    elapsed = time.perf_counter() - t0
    gc.enable()
    return elapsed, parser.collect(deltas)


def load_vllm() -> Callable[[list[tuple[str, int]], dict[str, int]], tuple[float, Any]]:
    """Import vLLM's Kimi K2 parser (CPU build); raises ImportError with the reason."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # The PyPI torchvision/torchaudio/torchcodec wheels are CUDA builds that break
    # ``import vllm`` on CPU (scripts/setup.sh removes them; docs/architecture.md); the parser
    # needs none of them.
    for name in ("torchvision", "torchaudio", "torchcodec"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.kimi_k2 import KimiK2Parser

    class StubTokenizer:
        """What vLLM's parser engine reads from a tokenizer: vocab, specials, decode."""

        def __init__(self, vocab: dict[str, int]) -> None:
            self.all_special_tokens: list[str] = []  # none: nothing for vLLM to drop
            self.all_special_ids: list[int] = []
            self._vocab = vocab
            self._inv = {v: k for k, v in vocab.items()}

        def get_vocab(self) -> dict[str, int]:
            return self._vocab

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(self._inv[i] for i in ids)

    tools: Any = TOOL_SCHEMAS

    def run_vllm(tokens: list[tuple[str, int]], vocab: dict[str, int]) -> tuple[float, Any]:
        request = ChatCompletionRequest.model_validate(
            {"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
        )
        tokenizer: Any = StubTokenizer(vocab)
        parser = KimiK2Parser(tokenizer, request.tools)  # type: ignore[arg-type]
        last = len(tokens) - 1
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        out = [
            parser.parse_delta(t, [tid], request, None, finished=(i == last))
            for i, (t, tid) in enumerate(tokens)
        ]
        elapsed = time.perf_counter() - t0
        gc.enable()
        return elapsed, out

    return run_vllm


def vllm_result(deltas: list[Any]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content = [], []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d is None:
            continue
        reasoning.append(d.reasoning or "")
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            if tc.function is not None:
                if tc.function.name:
                    names[tc.index] = tc.function.name
                args.setdefault(tc.index, []).append(tc.function.arguments or "")
    calls = [(names.get(i, ""), "".join(args[i])) for i in sorted(args)]
    return "".join(reasoning).strip(), "".join(content).strip(), calls


def best(fn: Callable[[], tuple[float, Any]], repeat: int) -> tuple[float, Any]:
    runs = [fn() for _ in range(repeat)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    opts = ap.parse_args()
    repeat = 1 if opts.quick else 3

    vocab = Vocab()
    agentic = make_output(5200, vocab, seed=1)
    sizes = {n: make_output(n, vocab, seed=n) for n in (1_000, 10_000, 50_000)}
    ids = vocab.ids

    try:
        run_vllm: Callable[[list[tuple[str, int]], dict[str, int]], tuple[float, Any]] | None
        run_vllm = load_vllm()
        import vllm

        vllm_version = getattr(vllm, "__version__", "?")
    except Exception as e:  # report any import failure and go on
        run_vllm = None
        print(f"vLLM parser unavailable ({type(e).__name__}: {e}); printing our figures only")
        vllm_version = ""

    print(f"python {sys.version.split()[0]}; vllm {vllm_version or 'n/a'}; one token per delta")
    speedup = float("nan")
    for label, tokens, reps in [
        (f"agentic ({len(agentic)} tokens)", agentic, repeat),
        (f"long ({len(sizes[50_000])} tokens)", sizes[50_000], 1),
    ]:
        ours_s, ours = best(lambda t=tokens: run_ours(t, ids), reps)  # type: ignore[misc]
        line = f"{label:<24} ours {len(tokens) / ours_s:>11,.0f} tok/s"
        if run_vllm is not None:
            v_s, v_out = best(lambda t=tokens: run_vllm(t, ids), reps)  # type: ignore[misc]
            r, c, calls = vllm_result(v_out)
            same = (r, c, calls) == (
                ours.reasoning,
                ours.content,
                [(tc.name, tc.arguments) for tc in ours.tool_calls],
            )
            ratio = v_s / ours_s
            line += f" | vllm {len(tokens) / v_s:>11,.0f} tok/s | ratio {ratio:5.2f}x"
            line += f" | same result: {'yes' if same else 'NO'}"
            if label.startswith("agentic"):
                speedup = ratio
        print(line)
        bare_s, bare = best(lambda t=tokens: run_ours(t, ids, False), reps)  # type: ignore[misc]
        assert bare == ours, "the tools changed the result"
        print(
            f"{'':<24} ours without tools {len(tokens) / bare_s:>11,.0f} tok/s"
            f" | the tools cost {ours_s / bare_s - 1:+.1%}"
        )

    print("per-token cost (microseconds; flat across sizes = O(n) overall):")
    for n, tokens in sizes.items():
        reps = max(1, repeat - 1) if n == 50_000 else repeat
        ours_s, _ = best(lambda t=tokens: run_ours(t, ids), reps)  # type: ignore[misc]
        line = f"  {n:>6,} tokens   ours {ours_s / len(tokens) * 1e6:6.2f} us/token"
        if run_vllm is not None:
            v_s, _ = best(lambda t=tokens: run_vllm(t, ids), reps)  # type: ignore[misc]
            line += f"   vllm {v_s / len(tokens) * 1e6:6.2f} us/token"
        print(line)
    print(f"parser_speedup_vs_vllm: {speedup:.2f}")


if __name__ == "__main__":
    main()
