"""Precise prefix-cache routing from KV events against the approximate table and least load
(issue 29 §4), on a multi-turn agentic workload over three kimi-tiny replicas.

    .venv/bin/python bench/kv_routing.py [--sessions 6] [--turns 5] [--rounds 3]
                                        [--system-words 1500] [--user-words 700]
                                        [--max-tokens 4] [--think 1.0] [--engine-binding]
                                        [--no-niceness]
                                        [--policies precise_prefix,prefix_affinity,least_load]
                                        [--cost-only] [--streams 200]

1. The router's CPU per request for `precise_prefix` (in this process, the code the router
   runs: `router.tokenize.prompt_ids` + `kvblocks.chain`, then `KvIndex.longest_prefix`): a
   chat with a ~4k-token prompt and a 100,000-character agent prompt (tool calls and results),
   kimi-tiny's tokenizer and qwen3-tiny's, thread CPU, median of 15; the KV index's memory per
   (block, replica) entry (tracemalloc over 200,000 entries) and, with `--streams N`, the
   router's memory per `WatchReplicaState` stream (RSS of this process before and after
   opening N streams, each on its own channel, to a fake replica in a child process).
2. A local stack (`inferplane.localstack`: Envoy, auth, router, orchestrator, node-agent) with
   three kimi-tiny replicas (`inproc`, `max_num_seqs` 4, vLLM's CPU KV blocks of 128 tokens,
   prefix caching and KV events on). Per round, each policy in turn (the order rotates each
   round) is set on the deployment (`UpdateDeployment` of `routing_policy`; a policy change
   rolls no replica) and runs the same workload: `--sessions` concurrent agent sessions, each
   on one of two long shared system prompts (`--system-words`, ~2.2 kimi-tiny tokens a word),
   `--turns` turns each (a user message of `--user-words` words, standing for a tool result
   or a pasted file, then the model's greedy answer of `--max-tokens` tokens appended),
   streamed through the edge. The sessions run at once and each waits a random pause before
   each turn (uniform over 0-2 × `--think` seconds, the agent's tool running; the same pauses
   for every policy of a round), so their turns interleave and a cache-unaware policy
   scatters a session's turns over the replicas (without the pauses, six sessions on three
   replicas settle two to a replica and least load sends each turn back where the previous
   one ran, as its replica is the one just freed: a 1.00 own-history share). The defaults make
   prefill dominate TTFT: each turn adds ~1,500 tokens of its own to a history that grows to
   ~11,000, and 4-token answers leave the engines little decoding to interleave.
   Equal conditions: every (round, policy) run salts its system prompts and messages, so no
   run reuses another's cached blocks. Each engine's KV cache is 128 MiB (`max_num_seqs` 4 ×
   32,768 tokens × 1 KiB: 1,024 blocks, the router's index levels off at ~3,070 entries); a
   run stores at most ~600 distinct blocks on one replica, and vLLM evicts the least recently
   freed blocks first, so a run only evicts older runs' blocks, which it never reads: each
   run starts as with fresh caches.
   Equal replicas: the stack's node-agent runs with `--engine-cpu-cores-per-rank 0`, so
   every engine's OpenMP threads are `nobind` (supervisor/cpus.py) and the OS shares the
   cores among the three alike; the platform's default binds the first replica's engine to
   the one free core of a 2-core box and leaves the other two unbound (too few cores for
   each), which made that replica ~3× faster and TTFT a measure of how often a policy picked
   it (least load's ties go to the lowest index). The niceness settings stay at their
   defaults (they apply to every replica alike) unless `--no-niceness` sets both to 0: on a
   box loaded by other processes the niced engines (core 19, autogroup 10) get a small share
   of the cores and TTFT measures that share more than prefill. `--engine-binding` keeps
   the platform's binding (the unequal replicas, for comparison). One replica per policy run
   would be equal too, but no policy can route anywhere then; three unbound replicas on two
   cores are the fairest set this box holds.
   Hit rate = the engines' own count: Σ cached prompt tokens / Σ prompt tokens of the run's
   requests (`usage.prompt_tokens_details.cached_tokens`, which the replica fills from vLLM's
   `num_cached_tokens`), and the delta of the replicas' `vllm:prefix_cache_hits` /
   `vllm:prefix_cache_queries` over the run. Own-history share: of the turns after a
   session's first, those whose cached tokens cover the previous turn's prompt (its full
   blocks, less one), i.e. that went to a replica holding the session's history. Where the
   requests went: each replica's `vllm:request_success_total` delta. TTFT: request sent →
   first streamed token.

Last lines:

    kv_routing_own_history_<policy> X       (per policy, median over rounds)
    kv_routing_hit_rate_<policy> X          (per policy, median over rounds)
    precise_vs_approx_hit_rate X            (goal >= 1.0)
    precise_vs_least_load_ttft_p50 X        (goal <= 0.7 where prefill dominates)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.kvblocks import chain
from inferplane.localstack import MODEL_NAME, StackConfig, running_stack
from inferplane.router.kvindex import KvIndex
from inferplane.router.tokenize import load_tokenizer, prompt_ids
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.sdk import Client

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # vLLM's CPU block size, as the stack runs kimi-tiny
POLICIES = ("precise_prefix", "prefix_affinity", "least_load")
_VOCABULARY = (
    "the of and to in is for on that with as are this be by from at or an it not which have "
    "has was can will more all their other about into than them these its also router replica "
    "cache prefix block token engine request latency deploy kernel tensor schedule queue batch "
    "review change test build agent tool call result file patch diff commit branch merge"
)
WORDS = tuple(_VOCABULARY.split())


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- 1. the router's cost ---------------------------------------------------------------------


def _chat(body: dict[str, Any]) -> pb.ChatCompletionRequest:
    return json_format.ParseDict({"model": "m", **body}, pb.ChatCompletionRequest())


def agent_prompt(chars: int, rng: random.Random) -> pb.ChatCompletionRequest:
    """An agent conversation of about `chars` characters: a system prompt, tools, then user
    turns, assistant tool calls and tool results."""
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 300)}]
    n = 0
    while sum(len(json.dumps(m)) for m in messages) < chars:
        n += 1
        call_id = f"functions.read_file:{n}"
        messages += [
            {"role": "user", "content": words(rng, 40)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": f'{{"path": "f{n}.py"}}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": words(rng, 400)},
        ]
    return _chat({"messages": messages, "tools": [tool]})


def _hash(loaded: Any, request: pb.ChatCompletionRequest) -> list[int]:
    """What the router's worker thread does per request (`PromptTokens._hash`)."""
    ids = prompt_ids(loaded, request, 32_768)
    assert ids is not None
    return chain(ids[0], BLOCK)


def _median_cpu_ms(fn: Any, reps: int = 15) -> float:
    samples = []
    for _ in range(reps):
        started = time.thread_time()
        fn()
        samples.append((time.thread_time() - started) * 1000)
    return statistics.median(samples)


def router_cost(streams: int) -> dict[str, float]:
    rng = random.Random(7)
    out: dict[str, float] = {}
    for model in ("kimi-tiny", "qwen3-tiny"):
        loaded = load_tokenizer(str(ROOT / "models" / model))
        system = words(rng, 1500)
        chat4k = _chat(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 150)},
                ]
            }
        )
        agent = agent_prompt(100_000, rng)
        for name, request in (("chat_4k", chat4k), ("agent_100k_chars", agent)):
            ids = prompt_ids(loaded, request, 32_768)
            assert ids is not None
            tokens = ids[1]
            ms = _median_cpu_ms(lambda r=request, t=loaded: _hash(t, r))
            hashes = chain(ids[0], BLOCK)
            index = KvIndex()
            for replica in range(3):
                index.store(f"r{replica}", hashes[: len(hashes) * (replica + 1) // 3])
            lookup_us = _median_cpu_ms(lambda h=hashes, i=index: i.longest_prefix(h), 200) * 1000
            print(
                f"  {model:<10} {name:<17} {tokens:>6} prompt tokens, {len(hashes):>3} blocks: "
                f"tokenize+hash {ms:.2f} ms CPU, index lookup (3 holders) {lookup_us:.1f} us"
            )
            out[f"router_cpu_ms_{name}_{model}"] = ms
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex()
    for replica in range(10):
        index.store(f"replica-{replica}", range(replica * 20_000, (replica + 1) * 20_000))
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(index)
    tracemalloc.stop()
    print(f"  KV index: {per_entry:.0f} bytes per (block, replica) entry ({len(index):,} entries)")
    out["kv_index_bytes_per_entry"] = per_entry
    if streams:
        out["router_kib_per_replica_stream"] = stream_memory(streams)
    return out


_FAKE_REPLICA = r"""
import asyncio, sys
import grpc
from inferplane.api.nodeagent.v1 import replica_pb2 as rpb, replica_pb2_grpc

class R(replica_pb2_grpc.ReplicaProcessServiceServicer):
    async def WatchReplicaState(self, request, context):
        seq = 0
        while True:
            seq += 1
            yield rpb.WatchReplicaStateResponse(sequence=seq, reset=seq == 1, block_size=128,
                                                total_kv_blocks=1000, free_kv_blocks=900,
                                                kv_events=True)
            await asyncio.sleep(1.0)

async def main():
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(R(), server)
    ports = [server.add_insecure_port("127.0.0.1:0") for _ in range(int(sys.argv[1]))]
    await server.start()
    print(" ".join(map(str, ports)), flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def stream_memory(n: int) -> float:
    """KiB of this process's RSS per open WatchReplicaState stream (n streams, n channels)."""
    from inferplane.router.engine_state import EngineStates
    from inferplane.router.replica_watch import ReplicaWatch
    from inferplane.router.routes import Endpoint, ModelRoute, RouteTable

    child = subprocess.Popen(
        [sys.executable, "-c", _FAKE_REPLICA, str(n)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        ports = child.stdout.readline().split()

        async def run() -> float:
            states = EngineStates(time.monotonic)
            watch = ReplicaWatch(states, KvIndex())
            await asyncio.sleep(0.5)
            before = _rss_kib()
            endpoints = tuple(Endpoint(f"127.0.0.1:{p}", f"r{i}") for i, p in enumerate(ports))
            watch.on_table(RouteTable.of([ModelRoute("m", endpoints)]))
            await watch.start()
            deadline = time.monotonic() + 60
            while watch.open_streams < n and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)
            opened = watch.open_streams
            after = _rss_kib()
            await watch.stop()
            per = (after - before) / max(1, opened)
            print(f"  {opened} replica state streams: {per:.1f} KiB of router RSS each")
            return per

        return asyncio.run(run())
    finally:
        child.terminate()
        child.wait()


# -- 2. the stack run -------------------------------------------------------------------------


def _prom(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", line)
            if m:
                total += float(m.group(1))
    return total


def engine_counters(urls: list[str]) -> tuple[float, float, list[float]]:
    """Σ vllm:prefix_cache_hits_total, Σ vllm:prefix_cache_queries_total of the replicas, and
    each replica's vllm:request_success_total (where the requests went)."""
    hits = queries = 0.0
    served = []
    for url in urls:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            served.append(float("nan"))
            continue
        hits += _prom(text, "vllm:prefix_cache_hits_total")
        queries += _prom(text, "vllm:prefix_cache_queries_total")
        served.append(_prom(text, "vllm:request_success_total"))
    return hits, queries, served


async def one_turn(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, Any]], max_tokens: int
) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, answer) of one streamed greedy turn."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"thinking": False},
    }
    started = time.perf_counter()
    ttft = 0.0
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                if piece and not ttft:
                    ttft = time.perf_counter() - started
                text.append(delta.get("content") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (
        ttft or time.perf_counter() - started,
        usage.get("prompt_tokens", 0),
        cached,
        "".join(text),
    )


async def workload(
    base_url: str, key: str, args: argparse.Namespace, salt: str, round_: int
) -> dict[str, Any]:
    rng = random.Random(salt)
    systems = [f"[{salt}/{k}] " + words(rng, args.system_words) for k in range(2)]
    ttfts: list[float] = []
    prompt = cached = later_turns = own_history = 0

    async def session(i: int, client: httpx.AsyncClient) -> None:
        nonlocal prompt, cached, later_turns, own_history
        srng = random.Random(f"{salt}/{i}")
        # the pauses depend on the round and the session only: every policy gets the same
        pauses = random.Random(f"{round_}/{i}")
        messages: list[dict[str, Any]] = [{"role": "system", "content": systems[i % 2]}]
        previous = 0
        for turn in range(args.turns):
            await asyncio.sleep(pauses.uniform(0, 2 * args.think))
            messages.append({"role": "user", "content": words(srng, args.user_words)})
            ttft, p, c, answer = await one_turn(client, key, messages, args.max_tokens)
            ttfts.append(ttft)
            prompt += p
            cached += c
            if turn:
                later_turns += 1
                own_history += c >= (previous // BLOCK - 1) * BLOCK
            previous = p
            messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await asyncio.gather(*(session(i, client) for i in range(args.sessions)))
    ttfts.sort()
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "own_history": own_history / later_turns if later_turns else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "requests": len(ttfts),
    }


def set_policy(client: Client, policy: str) -> None:
    client.deployments.update(
        opb.Deployment(name=f"deployments/{MODEL_NAME}", routing_policy=policy),
        ["routing_policy"],
    )
    time.sleep(3.0)  # the table reaches the router (its watch) well within this


def router_metric(port: int, name: str) -> float:
    try:
        return _prom(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text, name)
    except httpx.HTTPError:
        return float("nan")


def node_agent_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The node-agent's flags for this bench (module docstring: equal replicas)."""
    flags = () if args.engine_binding else ("--engine-cpu-cores-per-rank", "0")
    if args.no_niceness:
        flags += ("--engine-cpu-core-niceness", "0", "--engine-cpu-autogroup-niceness", "0")
    return flags


def stack_run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policies}
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as tmp:
        config = StackConfig(
            data_dir=Path(tmp),
            http_port=free_port(),
            grpc_base_port=free_port_run(5),
            metrics_base_port=free_port_run(5),
            envoy_admin_port=free_port(),
            replicas=3,
            max_num_seqs=4,
            routing_policy=args.policies[0],
            max_model_len=32_768,
            service_args={"node_agent": node_agent_args(args)},
        )
        with running_stack(config, lambda m: print(f"  {m}", flush=True)) as stack:
            key = stack.create_api_key("kv-routing")
            client = Client(
                orchestrator=config.address("orchestrator"), security=config.security, timeout=10
            )
            router_port = config.metrics_ports["router"]
            urls = [e.metrics_url for e in stack.serving_endpoints() if e.metrics_url]
            deadline = time.monotonic() + 120
            while router_metric(router_port, "inferplane_router_replica_state_streams") < 3:
                if time.monotonic() > deadline:
                    print("  the router holds fewer than 3 replica state streams")
                    break
                time.sleep(1)
            print(f"  replicas' engine metrics: {len(urls)}")
            for r in range(args.rounds):
                order = list(args.policies[r % len(args.policies) :]) + list(
                    args.policies[: r % len(args.policies)]
                )
                for policy in order:
                    set_policy(client, policy)
                    hits0, queries0, served0 = engine_counters(urls)
                    started = time.monotonic()
                    result = asyncio.run(workload(config.base_url, key, args, f"{r}/{policy}", r))
                    hits1, queries1, served1 = engine_counters(urls)
                    spread = "/".join(f"{b - a:.0f}" for a, b in zip(served0, served1, strict=True))
                    queries = queries1 - queries0
                    result["engine_hit_rate"] = (hits1 - hits0) / queries if queries else 0.0
                    result["seconds"] = time.monotonic() - started
                    result["kv_index_entries"] = router_metric(
                        router_port, "inferplane_router_kv_index_entries"
                    )
                    results[policy].append(result)
                    print(
                        f"  round {r + 1} {policy:<16} hit rate {result['hit_rate']:.3f} "
                        f"(engines' counters {result['engine_hit_rate']:.3f}; "
                        f"{result['cached_tokens']:,}/{result['prompt_tokens']:,} tokens; "
                        f"own history {result['own_history']:.2f}), "
                        f"TTFT p50 {result['ttft_p50'] * 1000:.0f} ms p99 "
                        f"{result['ttft_p99'] * 1000:.0f} ms, {result['requests']} requests in "
                        f"{result['seconds']:.0f} s (per replica {spread}); router KV index "
                        f"{result['kv_index_entries']:.0f} entries",
                        flush=True,
                    )
            client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=1500)
    parser.add_argument("--user-words", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument(
        "--think", type=float, default=1.0, help="mean seconds before each turn (uniform 0-2x)"
    )
    parser.add_argument(
        "--engine-binding",
        action="store_true",
        help="keep the node-agent's default core binding (unequal replicas on 2 cores)",
    )
    parser.add_argument(
        "--no-niceness",
        action="store_true",
        help="engines at the node-agent's priority (default: niced as on the platform)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--cost-only", action="store_true", help="only the router's cost")
    parser.add_argument("--streams", type=int, default=200, help="0: skip the stream memory")
    args = parser.parse_args()
    args.policies = tuple(args.policies.split(","))

    print("router CPU per request (precise_prefix: render + tokenize + hash, then lookup)")
    cost = router_cost(args.streams)
    if args.cost_only:
        return
    print("three kimi-tiny replicas, the policies side by side")
    results = stack_run(args)
    print()
    for name, value in cost.items():
        print(f"{name} {value:.2f}")
    summary = {}
    for policy, runs in results.items():
        summary[policy] = {
            k: statistics.median(r[k] for r in runs)
            for k in ("hit_rate", "engine_hit_rate", "own_history", "ttft_p50", "ttft_p99")
        }
        s = summary[policy]
        print(
            f"kv_routing_ttft_ms_{policy} p50 {s['ttft_p50'] * 1000:.0f} "
            f"p99 {s['ttft_p99'] * 1000:.0f}"
        )
        print(f"kv_routing_engine_hit_rate_{policy} {s['engine_hit_rate']:.3f}")
        print(f"kv_routing_own_history_{policy} {s['own_history']:.3f}")
    for policy in results:
        print(f"kv_routing_hit_rate_{policy} {summary[policy]['hit_rate']:.3f}")
    precise, approx, least = (
        summary.get("precise_prefix"),
        summary.get("prefix_affinity"),
        summary.get("least_load"),
    )
    if precise and approx:
        ratio = precise["hit_rate"] / approx["hit_rate"] if approx["hit_rate"] else float("inf")
        print(f"precise_vs_approx_hit_rate {ratio:.3f}")
    if precise and least:
        print(f"precise_vs_least_load_ttft_p50 {precise['ttft_p50'] / least['ttft_p50']:.3f}")


if __name__ == "__main__":
    main()
