"""Strict `response_format: json_schema` on the fixture models through the replica's pipeline
and a real in-process vLLM engine: the share of responses that validate, end with `length`, or
are invalid (what the guarantee rules out), and marker text in content; with `--tokenizer`,
what the answer's marker exclusion costs xgrammar on another vocabulary.

    .venv/bin/python bench/structured_output_validity.py [--requests 60] [--max-tokens 256]
        [--models kimi-tiny,qwen3-tiny] [--seed 0] [--without-exclusion]
        [--tokenizer PATH ...] [--schemas 60]

`--requests` schemas (every third the free-string schema of issue 27's measurement, the others
random object schemas, `inferplane.testing.tool_schemas.object_schemas`: strings with and
without maxLength, integers with bounds, numbers, booleans, enums, nested objects, arrays,
random `required`), each a strict json_schema request, thinking on for half, sampled at
temperature 1 (the fixtures' greedy answers are not JSON: sampling shows what the grammar lets
through), all at once. `--without-exclusion` serves the same requests with the constraint as it
was before issue 27 (no marker exclusion: `ModelAssets.marker_texts` empty).

`--tokenizer` (a tokenizer.json, e.g. `bench/kimi_sized_tokenizer.py`'s 163k BPE, or a model
folder): compile time of `--schemas` new schemas' answer grammars, thinking off and on, without
and with the exclusion, as vLLM's xgrammar backend compiles (8 threads, no cache).

Last lines, per model: `structured_output_valid_share_<model>: X` (valid / all) and
`structured_output_invalid_<model>: N` (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from inferplane.replica.pipeline.assets import ModelAssets, load_model_assets
from inferplane.replica.testing.structured import (
    Verdict,
    ask,
    kimi_tiny_inproc_spec,
    qwen3_tiny_spec,
    schema_requests,
    serve_inproc,
    verdict,
)

SPECS = {"kimi-tiny": kimi_tiny_inproc_spec, "qwen3-tiny": qwen3_tiny_spec}


async def run_model(model: str, args: argparse.Namespace) -> list[Verdict]:
    spec = SPECS[model]()
    assets = load_model_assets(spec)
    markers = assets.marker_texts

    def loader(s: Any) -> ModelAssets:
        loaded = load_model_assets(s)
        return dataclasses.replace(loaded, marker_texts=()) if args.without_exclusion else loaded

    pairs = schema_requests(model, args.requests, args.seed, max_tokens=args.max_tokens)
    started = time.perf_counter()
    async with serve_inproc(spec, loader=loader) as stub:
        ready = time.perf_counter() - started
        began = time.perf_counter()
        responses = await asyncio.gather(*(ask(stub, body) for body, _ in pairs))
        took = time.perf_counter() - began
    verdicts = [
        verdict(r, schema, markers) for r, (_, schema) in zip(responses, pairs, strict=True)
    ]
    outcomes = Counter(v.outcome for v in verdicts)
    print(
        f"\n== {model} ({'without' if args.without_exclusion else 'with'} the marker "
        f"exclusion): {len(verdicts)} requests in {took:.1f} s (engine ready in {ready:.0f} s)"
    )
    print(
        f"valid {outcomes['valid']}, length {outcomes['length']}, invalid {outcomes['invalid']}"
        f" (invalid with finish_reason stop: "
        f"{sum(v.outcome == 'invalid' and v.finish_reason == 'stop' for v in verdicts)}); "
        f"marker text in content {sum(v.content_marker for v in verdicts)}, "
        f"in reasoning {sum(v.reasoning_marker for v in verdicts)}"
    )
    for v in [v for v in verdicts if v.outcome == "invalid"][:3]:
        print(f"  invalid ({v.finish_reason}): {v.content[:120]!r}")
    return verdicts


def grammar_cost(path_text: str, n: int, seed: int) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from inferplane.parsers import build_json_constraint
    from inferplane.testing.tool_schemas import draw, object_schemas

    path = Path(path_text)
    tok: Any = (
        PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
        if path.is_file()
        else AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    )
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    markers = sorted({str(t.content) for t in tok.added_tokens_decoder.values()})
    schemas = draw(object_schemas(max_length=40), n, seed)
    print(f"\n== xgrammar with {path.name} ({len(tok)} tokens, {len(markers)} marker texts)")
    for thinking in (False, True):
        for with_markers in (False, True):
            compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
            seconds = []
            for schema in schemas:
                built = build_json_constraint(
                    schema, thinking=thinking, markers=markers if with_markers else ()
                )
                began = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if built.kind == "json_schema":
                        compiler.compile_json_schema(built.value)
                    else:
                        compiler.compile_structural_tag(built.value)
                seconds.append(time.perf_counter() - began)
            seconds.sort()
            p90 = seconds[int(0.9 * (len(seconds) - 1))]
            print(
                f"thinking {'on ' if thinking else 'off'}, "
                f"exclusion {'on ' if with_markers else 'off'}: compile median "
                f"{statistics.median(seconds) * 1000:.1f} ms, "
                f"p90 {p90 * 1000:.1f} ms, max {seconds[-1] * 1000:.1f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--models", default="kimi-tiny,qwen3-tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-exclusion", action="store_true")
    parser.add_argument("--tokenizer", action="append", default=[])
    parser.add_argument("--schemas", type=int, default=60)
    args = parser.parse_args()
    for path in args.tokenizer:
        grammar_cost(path, args.schemas, args.seed)
    results = {}
    for model in [m for m in args.models.split(",") if m]:
        results[model] = asyncio.run(run_model(model, args))
    print()
    for model, verdicts in results.items():
        valid = sum(v.outcome == "valid" for v in verdicts)
        invalid = sum(v.outcome == "invalid" for v in verdicts)
        print(f"structured_output_valid_share_{model}: {valid / len(verdicts):.3f}")
        print(f"structured_output_invalid_{model}: {invalid}")


if __name__ == "__main__":
    main()
