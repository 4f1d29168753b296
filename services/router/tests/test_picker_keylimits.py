"""Per-key limits in the endpoint picker: a key authenticated from the key table is admitted
on its limits at the request headers (`KeyLimiter`), refused with OpenAI's 429 before the body
is read, its allowed response carries the x-ratelimit-* headers, its concurrency slot is freed
at the request's one end and its tokens count once the summary says them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.router.keylimits import KeyLimiter
from inferplane.router.keys import KeyTable
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.testing.clock import FakeClock
from inferplane.wire import ResponseSummary

from .test_picker import CHAT, _chat_body, picker_rig

pytestmark = pytest.mark.timeout(30)

PEPPER = b"p" * 32
LIMITED = "ip-limited-secret-0123456789"
FREE = "ip-free-secret-0123456789"


def _keys(**limits: int) -> KeyTable:
    hasher = SecretHasher(PEPPER)
    table = KeyTable(hasher, FakeClock())

    def entry(secret: str, key_id: str, limits: auth_pb2.Limits) -> kpb.KeyEntry:
        return kpb.KeyEntry(
            secret_hash=hasher.hash(secret),
            key_id=key_id,
            tenant="t1",
            scopes=["inference"],
            tier="standard",
            limits=limits,
        )

    table.apply(
        kpb.WatchKeyTableResponse(
            snapshot=True,
            entries=[
                entry(LIMITED, "k-limited", auth_pb2.Limits(**limits)),
                entry(FREE, "k-free", auth_pb2.Limits()),
            ],
        )
    )
    return table


def _auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def _headers(mutation: ext_pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _error(answer: ext_pb.ProcessingResponse) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert answer.HasField("immediate_response"), answer
    refusal = answer.immediate_response
    return refusal.status.code, json.loads(refusal.body)["error"], _headers(refusal.headers)


def test_requests_per_minute_429_at_the_headers_with_openais_headers() -> None:
    async def scenario() -> None:
        async with picker_rig(keys=_keys(requests_per_minute=1), key_limits=KeyLimiter) as rig:
            stream = rig.stream()
            assert (await stream.headers(CHAT, _auth(LIMITED))).HasField("request_headers")
            await stream.body(_chat_body())
            answer = await stream.response_headers({":status": "200"})
            allowed = _headers(answer.response_headers.response.header_mutation)
            assert allowed["x-ratelimit-limit-requests"] == "1"
            assert allowed["x-ratelimit-remaining-requests"] == "0"
            await stream.response_trailers({"grpc-status": "0"})
            await stream.close()
            status, error, sent = _error(await rig.stream().headers(CHAT, _auth(LIMITED)))
            assert status == 429
            assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
            assert int(sent["retry-after"]) >= 1
            assert sent["x-ratelimit-remaining-requests"] == "0"
            # another key is not affected, and gets no x-ratelimit-* header
            stream = rig.stream()
            assert (await stream.headers(CHAT, _auth(FREE))).HasField("request_headers")
            await stream.body(_chat_body())
            answer = await stream.response_headers({":status": "200"})
            assert not _headers(answer.response_headers.response.header_mutation)

    asyncio.run(scenario())


def test_a_concurrency_slot_is_freed_at_the_requests_end() -> None:
    async def scenario() -> None:
        limits = KeyLimiter(FakeClock())
        async with picker_rig(
            keys=_keys(max_concurrent_requests=1), key_limits=lambda _clock: limits
        ) as rig:
            first = rig.stream()
            await first.headers(CHAT, _auth(LIMITED))
            assert limits.in_flight("k-limited") == 1
            status, error, sent = _error(await rig.stream().headers(CHAT, _auth(LIMITED)))
            assert (status, error["code"], sent["retry-after"]) == (429, "rate_limit_exceeded", "1")
            await first.body(_chat_body())
            await first.response_headers({":status": "200"})
            await first.response_trailers({"grpc-status": "0"})
            assert limits.in_flight("k-limited") == 0, "released at the trailers"
            await first.close()
            # a request refused after its key was admitted (unknown model) frees it too
            stream = rig.stream()
            await stream.headers(CHAT, _auth(LIMITED))
            status, error, _ = _error(await stream.body(_chat_body(model="no-such-model")))
            assert status == 404
            await asyncio.sleep(0.05)
            assert limits.in_flight("k-limited") == 0
            # and one whose client went away before its body
            stream = rig.stream()
            await stream.headers(CHAT, _auth(LIMITED))
            await stream.close()
            assert limits.in_flight("k-limited") == 0

    asyncio.run(scenario())


def test_tokens_per_minute_count_from_the_summary_then_refuse() -> None:
    async def scenario() -> None:
        async with picker_rig(keys=_keys(tokens_per_minute=10), key_limits=KeyLimiter) as rig:
            stream = rig.stream()
            await stream.headers(CHAT, _auth(LIMITED))
            await stream.body(_chat_body())
            await stream.response_headers({":status": "200"})
            summary = ResponseSummary(prompt_tokens=8, completion_tokens=4, finish_reason="stop")
            await stream.response_trailers({"grpc-status": "0", **dict(summary.to_metadata())})
            await stream.close()
            status, error, sent = _error(await rig.stream().headers(CHAT, _auth(LIMITED)))
            assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "tokens")
            assert sent["x-ratelimit-limit-tokens"] == "10"
            assert sent["x-ratelimit-remaining-tokens"] == "0"

    asyncio.run(scenario())


def test_a_spent_budget_is_insufficient_quota_in_anthropics_shape_on_messages() -> None:
    async def scenario() -> None:
        async with picker_rig(keys=_keys(monthly_token_budget=5), key_limits=KeyLimiter) as rig:
            stream = rig.stream()
            await stream.headers(CHAT, _auth(LIMITED))
            await stream.body(_chat_body())
            await stream.response_headers({":status": "200"})
            summary = ResponseSummary(prompt_tokens=4, completion_tokens=2, finish_reason="stop")
            await stream.response_trailers({"grpc-status": "0", **dict(summary.to_metadata())})
            await stream.close()
            status, error, _ = _error(await rig.stream().headers(CHAT, _auth(LIMITED)))
            assert (status, error["code"], error["type"]) == (
                429,
                "insufficient_quota",
                "insufficient_quota",
            )
            answer = await rig.stream().headers("/v1/messages", _auth(LIMITED))
            assert answer.immediate_response.status.code == 429
            assert json.loads(answer.immediate_response.body)["type"] == "error"

    asyncio.run(scenario())
