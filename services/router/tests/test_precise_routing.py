"""Precise prefix routing through the composition root: `build_app` with the replica state
watch on, three fake replicas over real gRPC announcing KV blocks, kimi-tiny's real
tokenizer; the picker's decision goes to the replica holding the prompt's prefix, and falls
back to the approximate table once that replica's stream says its events are off. (With a
real replica and vLLM: tests/e2e/test_kv_routing.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import replica_pb2 as rpb
from inferplane.kvblocks import chain
from inferplane.router.app import build_app
from inferplane.router.picker.codec import METHODS
from inferplane.router.picker.codec import SERVICE_NAME as PICKER_SERVICE
from inferplane.router.picker.director import RequestFacts
from inferplane.router.settings import RouterSettings
from inferplane.router.tokenize import load_tokenizer, prompt_ids

from .test_replica_watch import FakeReplica, serve, until, update

pytestmark = pytest.mark.timeout(60)

KIMI = str(Path(__file__).resolve().parents[3] / "models" / "kimi-tiny")
CHAT = METHODS["/inferplane.inference.v1.InferenceService/StreamChatCompletionEvents"]


def chat_request(user: str) -> pb.ChatCompletionRequest:
    return json_format.ParseDict(
        {
            "model": "kimi-tiny",
            "messages": [
                {"role": "system", "content": "You review pull requests carefully. " * 60},
                {"role": "user", "content": user},
            ],
        },
        pb.ChatCompletionRequest(),
    )


def test_the_picker_sends_a_prompt_where_its_prefix_is_cached(tmp_path: Path) -> None:
    request = chat_request("Please review the change to the router.")
    ids = prompt_ids(load_tokenizer(KIMI), request, 1 << 20)
    assert ids is not None
    blocks = chain(ids[0], 128)
    assert len(blocks) >= 3

    def holder(n: int) -> list[rpb.WatchReplicaStateResponse]:
        if n == 0:
            return [update(1, reset=True, stored=blocks)]
        return [update(1, reset=True, kv_events=False)]

    def empty(n: int) -> list[rpb.WatchReplicaStateResponse]:
        return [update(1, reset=True)]

    async def scenario() -> None:
        fakes = [FakeReplica(empty), FakeReplica(holder), FakeReplica(empty)]
        served = [await serve(f) for f in fakes]
        routes = tmp_path / "routes.yaml"
        endpoints: list[dict[str, Any]] = [
            {"address": address, "replica_id": f"r{i}"} for i, (_, address) in enumerate(served)
        ]
        routes.write_text(
            yaml.safe_dump(
                {
                    "models": [
                        {
                            "model": "kimi-tiny",
                            "routing_policy": "precise_prefix",
                            "tokenizer": KIMI,
                            "endpoints": endpoints,
                        }
                    ]
                }
            )
        )
        app = build_app(
            RouterSettings(
                host="127.0.0.1", port=0, routes_file=str(routes), replica_state_watch="on"
            )
        )
        picker: Any = next(b.servicer for b in app.servicers if b.name == PICKER_SERVICE)
        director = picker.director
        await app.start()
        try:
            assert app.kv_index is not None and director.prompt_tokens is not None
            await until(lambda: app.kv_index.blocks("r1") == len(blocks))
            route = director.route(RequestFacts(CHAT, "kimi-tiny", request, {})).route
            assert await director.prompt_tokens.ready(route)
            for _ in range(3):  # each request released before the next
                decision = await director.decide(RequestFacts(CHAT, "kimi-tiny", request, {}))
                assert decision.slot.endpoint.replica_id == "r1"
                decision.slot.release()
            policy = director._admission._deployments["kimi-tiny"].policy  # the test's peek
            assert (policy.precise, policy.fallen_back) == (3, 0)
            # r1 says its KV events are off (its second stream): nothing of it is trusted,
            # and the decision is the approximate table's (which remembers r1 too).
            fakes[1].release.set()
            await until(lambda: len(fakes[1].requests) >= 2 and app.kv_index.blocks("r1") == 0)
            decision = await director.decide(RequestFacts(CHAT, "kimi-tiny", request, {}))
            assert decision.slot.endpoint.replica_id == "r1"
            assert (policy.precise, policy.fallen_back) == (3, 1)
            decision.slot.release()
            other = chat_request("x")  # nobody holds it: still decided, by the fallback
            decision = await director.decide(RequestFacts(CHAT, "kimi-tiny", other, {}))
            decision.slot.release()
        finally:
            await app.stop()
            for server, _ in served:
                await server.stop(None)

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 60
