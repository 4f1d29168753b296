"""A scripted 100-turn agent session through the edge on each API (issue 27 §8): chat
completions (`openai`), Anthropic Messages (`anthropic`) and OpenAI Responses (`openai`).

    .venv/bin/python bench/agent_session.py [--api chat|messages|responses|all] [--turns 100]
                                            [--model kimi-tiny] [--max-tokens 256]
                                            [--context-tokens N] [--transport inproc]
                                            [--base-url URL --api-key KEY] [--json PATH]

Without `--base-url` it starts a local stack (`inferplane.localstack`, kimi-tiny; with
`--model qwen3-tiny` also qwen3-tiny) and runs each API's session one after the other on the
same engine, each with its own history (`inferplane.testing.agent_session`: tasks phrased as
kimi-tiny was trained, the model's answers sent back as each API returned them, scripted tool
results; history compacted only when it would not fit `--context-tokens`, default the
deployment's context length).

Per turn it checks that no marker leaked into content or reasoning, that every tool call names
a declared tool with schema-valid arguments and that the answer was not cut, and records the
API's usage: prompt tokens, those served from the prefix cache, and TTFT. Prints one row per
turn, a table of TTFT and cached share against turn index (per 10 turns), what the template's
dropping of earlier reasoning costs (turns right after a new user message against turns inside
a tool loop), and ends, per API, with

    agent_session_turns_ok <api> N/T              (goal T/T)
    agent_session_cached_share_p50 <api> X        (from turn 2 on; goal >= 0.9)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anthropic
import openai

from inferplane.localstack import StackConfig, running_stack
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.testing.agent_apis import SESSIONS
from inferplane.testing.agent_session import Summary, TurnResult, run_session, summarize

APIS = tuple(SESSIONS)
CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on CPU when none is set (vllm/platforms/cpu.py), as the stack runs it:
the prefix cache serves whole blocks, so a turn's cached tokens are a multiple of it."""


def client_for(api: str, base_url: str, key: str) -> Any:
    """The API's SDK client: `base_url` ends with `/v1` (OpenAI's convention); Anthropic's SDK
    adds `/v1/messages` itself."""
    if api == "messages":
        return anthropic.Anthropic(
            base_url=base_url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=300
        )
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def print_turn(api: str, t: TurnResult, block: int) -> None:
    """One row: prompt and cached tokens, the cached share, the share the template leaves
    reusable, TTFT and e2e (ms), output tokens, whether the prefix held, the checks."""
    a = t.answer
    if a is None:
        print(f"{api:9} {t.index + 1:4} {t.task:4}  FAILED  {'; '.join(t.problems)}", flush=True)
        return
    kind = f"{len(a.calls)} call" + ("s" if len(a.calls) != 1 else "") if a.calls else "answer"
    held = t.prefix_held(block)
    flags = ("compacted " if t.compacted else "") + ("after-user " if t.after_user else "")
    flags += "" if held is None else ("prefix-held " if held else "PREFIX-BROKEN ")
    reusable = (
        f"{min(t.template_reusable, a.prompt_tokens) / a.prompt_tokens:.2f}"
        if t.template_reusable
        else "-"
    )
    print(
        f"{api:9} {t.index + 1:4} {t.task:4} {kind:8} {a.prompt_tokens:7} {a.cached_tokens:7} "
        f"{t.cached_share:6.2f} {reusable:>6} {_ms(a.ttft):>6} {_ms(a.e2e):>6} "
        f"{a.completion_tokens:5}  {flags}{'ok' if t.ok else '; '.join(t.problems)}"
        + "".join(f"; {n}" for n in t.notes),
        flush=True,
    )


def print_by_index(api: str, turns: list[TurnResult], width: int = 10) -> None:
    """TTFT and cached share against turn index: medians per `width` turns."""
    print(f"\n== {api}: TTFT and cached share against turn index (medians per {width} turns)")
    print("turns      prompt  cached share  TTFT ms  turns ok")
    for start in range(0, len(turns), width):
        group = [t for t in turns[start : start + width] if t.answer is not None]
        shares = [t.cached_share for t in group if t.index > 0 and t.answer.prompt_tokens]  # type: ignore[union-attr]
        ttfts = [t.answer.ttft for t in group if not math.isnan(t.answer.ttft)]  # type: ignore[union-attr]
        prompts = [t.answer.prompt_tokens for t in group]  # type: ignore[union-attr]
        ok = sum(t.ok for t in turns[start : start + width])
        share = f"{statistics.median(shares):.3f}" if shares else "-"
        ttft = _ms(statistics.median(ttfts)) if ttfts else "-"
        prompt = f"{statistics.median(prompts):.0f}" if prompts else "-"
        end = min(start + width, len(turns))
        print(f"{start + 1:4}-{end:<4} {prompt:>7}  {share:>12}  {ttft:>7}  {ok}/{end - start}")


def print_reasoning_cost(api: str, s: Summary, block: int) -> None:
    """Whether each turn's prompt extended the previous one, and what the template's dropping
    of earlier reasoning costs (turns after a new user message against turns in a tool loop)."""
    print(
        f"\n== {api}: prefix held (cached >= the reusable prefix in whole {block}-token blocks) "
        f"in {s.prefix_held}/{s.prefix_checked} checked turns"
    )
    share = s.reasoning_dropped_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    print(
        f"reasoning dropped by the template at a new user message: cached share p50 "
        f"{s.cached_share_p50_after_user:.3f} on those turns vs {s.cached_share_p50_in_loop:.3f} "
        f"inside tool loops; {s.reasoning_dropped_tokens} prompt tokens computed again "
        f"({share:.1%} of all {s.prompt_tokens} prompt tokens)"
    )
    print(
        f"TTFT p50 {_ms(s.ttft_p50)} ms, p90 {_ms(s.ttft_p90)} ms; "
        f"compactions {s.compactions}; problems {dict(s.problems) or 'none'}; "
        f"notes {dict(s.notes) or 'none'}"
    )


def run_api(
    api: str, base_url: str, key: str, args: argparse.Namespace
) -> tuple[list[TurnResult], Summary]:
    session = SESSIONS[api](client_for(api, base_url, key), args.model)
    print(f"\n== {api}: {args.turns} turns on {args.model}")
    print("api       turn task kind      prompt  cached  share reusbl  ttft    e2e   out  checks")
    turns = run_session(
        session,
        turns=args.turns,
        max_tokens=args.max_tokens,
        context_tokens=args.context_tokens or None,
        # Each API starts at another task: their sessions on one engine share no prefix.
        first_task=3 * APIS.index(api),
        on_turn=lambda t: print_turn(api, t, args.block_size),
    )
    summary = summarize(api, turns, block=args.block_size)
    print_by_index(api, turns)
    print_reasoning_cost(api, summary, args.block_size)
    return turns, summary


def run_all(args: argparse.Namespace, base_url: str, key: str) -> list[Summary]:
    summaries = []
    dump: dict[str, Any] = {}
    for api in APIS if args.api == "all" else (args.api,):
        turns, summary = run_api(api, base_url, key, args)
        summaries.append(summary)
        dump[api] = {"summary": asdict(summary), "turns": [asdict(t) for t in turns]}
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1, default=str))
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--api", choices=(*APIS, "all"), default="all")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--model", default="kimi-tiny", help="kimi-tiny or qwen3-tiny")
    parser.add_argument("--max-tokens", type=int, default=256, help="per turn")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=0,
        help="compact the history beyond this many tokens (0: the started stack's context "
        "length; with --base-url, never)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=CPU_BLOCK_SIZE,
        help="the engine's KV block size in tokens (the prefix check's granularity)",
    )
    parser.add_argument("--transport", default="", help="engine transport ('': the default)")
    parser.add_argument("--base-url", default="", help="a running edge, e.g. http://h:8080/v1")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--json", default="", help="write every turn and summary here")
    args = parser.parse_args()

    if args.base_url:
        summaries = run_all(args, args.base_url, args.api_key)
    else:
        with tempfile.TemporaryDirectory(prefix="agent-session-") as tmp:
            config = StackConfig(
                data_dir=Path(tmp),
                http_port=free_port(),
                grpc_base_port=free_port_run(5),
                metrics_base_port=free_port_run(5),
                envoy_admin_port=free_port(),
                qwen3=args.model == "qwen3-tiny",
                **({"transport": args.transport} if args.transport else {}),
            )
            args.context_tokens = args.context_tokens or config.max_model_len
            with running_stack(config) as stack:
                key = stack.create_api_key("agent-session")
                summaries = run_all(args, stack.config.base_url, key)
    print()
    for s in summaries:
        print(f"agent_session_turns_ok {s.api} {s.turns_ok}/{s.turns}")
        print(f"agent_session_cached_share_p50 {s.api} {s.cached_share_p50:.3f}")


if __name__ == "__main__":
    main()
