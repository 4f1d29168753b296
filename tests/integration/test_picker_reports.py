"""The v2 data path without an engine: a real Envoy edge, the real router as its endpoint
picker (ext_proc), real auth (ext_authz, usage) and real telemetry, in front of small fake
replica processes that stream SSE and end every response with summary trailers.

Invariants:
- usage reaches auth and exactly one record reaches telemetry per request, for a completed,
  a failed (error event after the first byte) and a client-cancelled stream;
- tokens the replica reports count against the key's limits (429 once over), and the usage
  report frees the key's concurrency slot;
- restarting the router under streaming load ends no stream already running, and while it is
  down new requests get a shaped 503 (fail closed), then succeed once it is back;
- a replica that cannot be reached costs no request: the picker's list falls back;
- the edge's access log gives telemetry one edge-overhead sample per request routed as a
  model, and none for other requests.

Real engines on this path: tests/e2e.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from inferplane.auth.domain import SCOPE_INFERENCE, KeySpec, Limits
from inferplane.wire import SSE_DONE

from .fabric import (
    MODEL,
    PROMPT_TOKENS,
    WORDS,
    Fabric,
    _body,
    _events,
    _eventually,
    _run,
    _stream,
)

pytestmark = pytest.mark.timeout(120)


def test_usage_and_one_record_per_request_completed_failed_and_cancelled(tmp_path: Path) -> None:
    """Every request through the edge yields one usage report to auth and one router record
    in telemetry, with the replica's tokens and TTFT, and a status telling a success, a
    failure after the first byte and a client cancel apart."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        async with httpx.AsyncClient(timeout=30) as client:
            status, raw = await _stream(client, fabric.url, secret, "hi")
            assert status == 200 and raw.endswith(SSE_DONE)
            status, raw = await _stream(client, fabric.url, secret, "fail")
            assert status == 200 and _events(raw)[-1]["error"]["code"] == "engine_failed"
            headers = {"authorization": f"Bearer {secret}"}
            async with client.stream(
                "POST", f"{fabric.url}/v1/chat/completions", json=_body("hang"), headers=headers
            ) as response:
                async for _ in response.aiter_bytes():
                    break  # the first chunk arrived: go away
            await asyncio.wait_for(fabric.replicas[0].cancelled.wait(), 10)
        await _eventually(lambda: len(fabric.records()) == 3)
        await _eventually(lambda: fabric.accounted() == 3)
        # Envoy sets the request id at the edge (a client's x-request-id is not trusted).
        records = {r.finish_reason: r for r in fabric.records()}
        assert set(records) == {"stop", "error", "abort"}
        assert len({r.request_id for r in records.values()}) == 3
        for r in records.values():
            assert (r.source, r.tenant, r.model, r.deployment) == ("router", "acme", MODEL, MODEL)
            assert r.replica == "replica-0"
            assert r.e2e >= 0 and r.queue_time >= 0
        ok, err, cancel = records["stop"], records["error"], records["abort"]
        assert (ok.finish_reason, ok.error_code, ok.failed) == ("stop", "", False)
        assert (ok.prompt_tokens, ok.completion_tokens) == (PROMPT_TOKENS, WORDS)
        assert 0.004 <= ok.ttft < 1.0  # the time to the pick plus the replica's own TTFT
        assert (err.finish_reason, err.error_code, err.failed) == ("error", "engine_failed", True)
        assert err.completion_tokens == 2
        assert (cancel.finish_reason, cancel.failed) == ("abort", False)

    asyncio.run(_run(tmp_path, body))


def test_replica_tokens_count_against_the_key_and_free_its_slot(tmp_path: Path) -> None:
    """The tokens in a replica's summary reach auth: a key at its tokens/minute limit gets
    429 with Retry-After; a key limited to one concurrent request can send the next one as
    soon as the previous one ended (its one slot is released at the stream's end, and the
    response's end waits for no usage delivery)."""

    async def body(fabric: Fabric) -> None:
        _, tokens = await fabric.key(Limits(0, PROMPT_TOKENS + WORDS, 0))
        _, single = await fabric.key(Limits(0, 0, 1))
        async with httpx.AsyncClient(timeout=30) as client:
            status, _ = await _stream(client, fabric.url, tokens)
            assert status == 200
            await _eventually(lambda: fabric.accounted() == 1)
            refused = await client.post(
                f"{fabric.url}/v1/chat/completions",
                json=_body(),
                headers={"authorization": f"Bearer {tokens}"},
            )
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"]
            for _ in range(3):
                status, raw = await _stream(client, fabric.url, single)
                assert status == 200 and raw.endswith(SSE_DONE)

    asyncio.run(_run(tmp_path, body))


def test_router_restart_under_streaming_load_ends_no_running_stream(tmp_path: Path) -> None:
    """Streams running while the router (the picker) goes away and comes back all complete;
    new requests meanwhile get a shaped 503 picker_unavailable; after the restart new
    requests succeed again."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        async with httpx.AsyncClient(timeout=60) as client:
            running = [
                asyncio.create_task(_stream(client, fabric.url, secret, "slow")) for _ in range(6)
            ]
            await _eventually(lambda: fabric.replicas[0].calls == 6)
            await fabric.stop_router()
            refused = await client.post(
                f"{fabric.url}/v1/chat/completions",
                json=_body(),
                headers={"authorization": f"Bearer {secret}"},
            )
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "picker_unavailable"
            await fabric.start_router()
            for status, raw in await asyncio.gather(*running):
                assert status == 200 and raw.endswith(SSE_DONE), raw[-200:]
                words = [e["choices"][0]["delta"]["content"] for e in _events(raw)]
                assert "".join(words) == "".join(f"w{i} " for i in range(WORDS))
            status, raw = await _stream(client, fabric.url, secret)
            assert status == 200 and raw.endswith(SSE_DONE)

    asyncio.run(_run(tmp_path, body))


def test_an_unreachable_replica_costs_no_request(tmp_path: Path) -> None:
    """With one replica of two not listening, every request still succeeds: the picker's
    list holds the other one and Envoy retries down it before the first byte."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(8):
                status, raw = await _stream(client, fabric.url, secret)
                assert status == 200 and raw.endswith(SSE_DONE)
        assert fabric.replicas[0].calls == 8

    asyncio.run(_run(tmp_path, body, dead_replica=True))


def test_picker_refusals_reach_the_client_in_openai_shape(tmp_path: Path) -> None:
    """The picker's refusals (unknown model, a model the key may not use) come back as
    OpenAI errors with the right status and code, and no replica is called."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        key, limited = await fabric.auth.manager.create(
            KeySpec(tenant="acme", scopes=(SCOPE_INFERENCE,), allowed_models=("other",)), "test"
        )
        del key
        async with httpx.AsyncClient(timeout=30) as client:
            for token, model, status, code in (
                (secret, "no-such-model", 404, "model_not_found"),
                (limited, MODEL, 403, "model_not_allowed"),
            ):
                for stream in (False, True):
                    response = await client.post(
                        f"{fabric.url}/v1/chat/completions",
                        json={**_body(), "model": model, "stream": stream},
                        headers={"authorization": f"Bearer {token}"},
                    )
                    assert response.status_code == status, response.text
                    assert response.headers["content-type"].startswith("application/json")
                    error = response.json()["error"]
                    assert (error["code"], error["type"]) == (code, "invalid_request_error")
                    assert error["message"]
                    assert not any(k.startswith(("grpc-", "x-openai")) for k in response.headers)
        assert fabric.replicas[0].calls == 0

    asyncio.run(_run(tmp_path, body))


def test_clients_that_close_right_after_done_lose_no_usage(tmp_path: Path) -> None:
    """The official (synchronous) openai client stops reading at `data: [DONE]` and closes its
    connection,
    so Envoy often cancels the picker's side stream before the response trailers reach it.
    Every request still yields one usage report to auth and one record with its tokens and
    finish reason "stop" (usage and record come from the same trace): the replica's
    out-of-band report fills in what the trailers could not."""
    requests = 12

    async def body(fabric: Fabric) -> None:
        key_id, secret = await fabric.key()
        fabric.replicas[0].trailer_delay = 0.2
        # The synchronous client closes at [DONE] (the async one drains HTTP/1.1 bodies).
        client = openai.OpenAI(base_url=f"{fabric.url}/v1", api_key=secret, max_retries=0)

        def one() -> None:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            for _chunk in stream:
                pass

        for _ in range(requests):
            await asyncio.to_thread(one)
        client.close()
        await _eventually(lambda: len(fabric.records()) == requests)
        await _eventually(lambda: fabric.accounted() == requests)
        records = fabric.records()
        assert [r.finish_reason for r in records] == ["stop"] * requests
        assert {(r.prompt_tokens, r.completion_tokens) for r in records} == {(PROMPT_TOKENS, WORDS)}
        del key_id

    asyncio.run(_run(tmp_path, body))


def test_the_edge_reports_its_overhead_per_model_to_telemetry(tmp_path: Path) -> None:
    """The edge's access log reaches telemetry for requests the picker routed as a model, and
    only those: each streamed request that reached a replica is one sample of
    `inferplane_edge_overhead_seconds{model}` with a sane value (above zero, the mean below
    the requests' mean duration); GET /v1/models, a 400 from the transcoder and a model the
    picker does not serve add none."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        auth = {"authorization": f"Bearer {secret}"}
        url = f"{fabric.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(f"{fabric.url}/v1/models", headers=auth)).status_code == 200
            bad = await client.post(url, json={"model": MODEL, "messages": 5}, headers=auth)
            assert bad.status_code == 400, bad.text
            unknown = await client.post(url, json={**_body(), "model": "nope"}, headers=auth)
            assert unknown.status_code == 404, unknown.text
            durations = []
            for _ in range(3):
                started = asyncio.get_running_loop().time()
                status, raw = await _stream(client, fabric.url, secret)
                durations.append(asyncio.get_running_loop().time() - started)
                assert status == 200 and raw.endswith(SSE_DONE)
        # Envoy flushes its buffered access log every second.
        await _eventually(lambda: fabric.edge_overhead("count", model=MODEL) == 3)
        mean = fabric.edge_overhead("sum", model=MODEL) / 3
        assert 0 < mean < sum(durations) / 3, (mean, durations)
        assert fabric.edge_overhead("entries", outcome="observed") == 3
        # The unknown model was refused before a replica: its entry (if the picker named it)
        # has no upstream timings; nothing else was logged.
        assert fabric.edge_overhead("entries", outcome="no_model") == 0
        print(f"\nedge overhead, mean of 3 streamed requests: {mean * 1e3:.2f} ms")

    asyncio.run(_run(tmp_path, body))


def test_the_request_id_is_always_the_edges_and_a_clients_own_is_echoed(tmp_path: Path) -> None:
    """A client-chosen x-request-id cannot name a slot or de-duplicate usage: two requests sent
    with the same one are both accounted; the response carries the edge's own x-request-id and
    the client's as x-client-request-id."""

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key(Limits(0, 10_000, 1))
        headers = {"authorization": f"Bearer {secret}", "x-request-id": "mine-1"}
        ids = []
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(2):
                response = await client.post(
                    f"{fabric.url}/v1/chat/completions", json=_body(), headers=headers
                )
                assert response.status_code == 200, response.text
                assert response.headers["x-client-request-id"] == "mine-1"
                ids.append(response.headers["x-request-id"])
        assert len(set(ids)) == 2 and "mine-1" not in ids
        await _eventually(lambda: fabric.accounted() == 2)

    asyncio.run(_run(tmp_path, body))


def test_a_flood_of_made_up_keys_does_not_slow_a_valid_key(tmp_path: Path) -> None:
    """2,000 well-formed random keys at concurrency 32 from one address: after the edge's
    limit of authentication failures, that address gets shaped 429s without auth being asked;
    meanwhile a valid key from another address keeps being served (its latency printed)."""
    from inferplane.auth.domain import new_secret

    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        url = f"{fabric.url}/v1/chat/completions"
        statuses: list[int] = []
        latencies: list[float] = []
        flooding = asyncio.Event()

        async def flood(client: httpx.AsyncClient, n: int) -> None:
            for _ in range(n):
                headers = {"authorization": f"Bearer {new_secret()}"}
                statuses.append((await client.post(url, json=_body(), headers=headers)).status_code)

        async def valid(client: httpx.AsyncClient) -> None:
            while not flooding.is_set():
                started = asyncio.get_running_loop().time()
                status, raw = await _stream(client, fabric.url, secret)
                latencies.append(asyncio.get_running_loop().time() - started)
                assert status == 200 and raw.endswith(SSE_DONE)

        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        limits = httpx.Limits(max_connections=32)
        async with (
            httpx.AsyncClient(timeout=30, transport=transport, limits=limits) as junk,
            httpx.AsyncClient(timeout=30) as good,
        ):
            checker = asyncio.create_task(valid(good))
            await asyncio.gather(*(flood(junk, 2_000 // 32 + 1) for _ in range(32)))
            flooding.set()
            await checker
        assert set(statuses) == {401, 429} and len(statuses) >= 2_000
        failures = statuses.count(401)
        # The limit plus the 32 requests already past the guard when it was reached, twice if
        # the 10 s window turned during the flood.
        assert failures <= 2 * (30 + 32), failures
        latencies.sort()
        p50, worst = latencies[len(latencies) // 2], latencies[-1]
        print(
            f"valid key during the flood: {len(latencies)} requests, p50 {p50 * 1e3:.1f} ms, "
            f"max {worst * 1e3:.1f} ms; flood: {failures} reached auth, "
            f"{statuses.count(429)} turned away by the edge"
        )
        assert len(latencies) >= 3 and worst < 5.0

    asyncio.run(_run(tmp_path, body))
