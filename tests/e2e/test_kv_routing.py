"""Precise prefix routing against a real replica and vLLM (issue 29 §4), on the session stack.

After a long prompt through the edge, the replica's engine has stored the prompt's KV blocks
and announced them on its `WatchReplicaState` stream: a watch opened here with the router's
identity (`ReplicaWatch`, the router's own code) holds every full block of the prompt, by the
content hashes the router computes from the prompt (`router.tokenize`), and `precise_prefix`
scores that replica with all of them; the stack's router process follows the same stream (its
`inferplane_router_kv_index_entries` covers the blocks). kimi-tiny on vLLM's CPU backend: KV
blocks of 128 tokens.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.fixtures import kimi_tiny
from inferplane.kvblocks import chain
from inferplane.localstack import MODEL_NAME, Stack
from inferplane.router.breaker import CircuitBreaker
from inferplane.router.engine_state import EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.kvindex import KvIndex
from inferplane.router.policies import PrecisePrefix
from inferplane.router.replica_watch import ReplicaWatch
from inferplane.router.replicas import ReplicaSet, ReplicaState
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.router.tokenize import load_tokenizer, prompt_ids
from inferplane.runtime.security.identity import PeerSecurity

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BLOCK = 128

SYSTEM = " ".join(f"Rule {i}: review every change to the router with care." for i in range(80))


def _prom(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_the_router_indexes_a_long_prompts_blocks_and_scores_its_replica(
    stack: Stack, client: openai.OpenAI
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which rule comes first?"},
    ]
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    request = json_format.ParseDict(
        {"model": MODEL_NAME, "messages": messages}, pb.ChatCompletionRequest()
    )
    ids = prompt_ids(load_tokenizer(str(kimi_tiny.model_path())), request, 1 << 20)
    assert ids is not None
    hashes = chain(ids[0], BLOCK)
    assert len(hashes) >= 8  # a long prompt: ~1,100+ tokens

    endpoints = stack.serving_endpoints()
    assert endpoints
    config = stack.config
    security = (
        PeerSecurity.plaintext("router")
        if config.plaintext
        else PeerSecurity(config.pki_dir, "router")
    )

    async def watch_it() -> dict[str, int]:
        states = EngineStates(time.monotonic)
        index = KvIndex()
        watch = ReplicaWatch(states, index, security=security, router_id="e2e")
        table = RouteTable.of(
            [
                ModelRoute(
                    MODEL_NAME,
                    tuple(Endpoint(e.address, e.replica_id) for e in endpoints),
                )
            ]
        )
        watch.on_table(table)
        await watch.start()
        try:
            deadline = time.monotonic() + 30
            found: dict[str, int] = {}
            while time.monotonic() < deadline:
                found = index.longest_prefix(hashes)
                if found:
                    break
                await asyncio.sleep(0.1)
            state = states.get(endpoints[0].replica_id)
            assert state is not None and state.kv_events and state.block_size == BLOCK
            # The policy scores the replica holding them (a set of this table's replicas).
            route = table.routes[MODEL_NAME]
            replica_set = ReplicaSet(
                MODEL_NAME,
                route.endpoints,
                [ReplicaState(e.key, CircuitBreaker()) for e in route.endpoints],
                16,
                0.0,
            )
            features = RequestFeatures(
                kv_hashes=tuple(hashes), kv_block_size=BLOCK, prompt_tokens=len(ids[0])
            )
            scored = PrecisePrefix(states, index).cached_blocks(replica_set, features)
            assert {route.endpoints[i].replica_id: n for i, n in scored.items()} == found
            return found
        finally:
            await watch.stop()

    found = asyncio.run(watch_it())
    holders = [r for r, n in found.items() if n == len(hashes)]
    assert holders, f"no replica holds all {len(hashes)} blocks: {found}"
    port = config.metrics_ports["router"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert _prom(text, "inferplane_router_replica_state_streams") >= len(endpoints)
    assert _prom(text, "inferplane_router_kv_index_entries") >= len(hashes)
