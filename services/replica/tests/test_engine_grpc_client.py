"""GrpcEngineClient against the fake VllmEngine served in-process on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry, Gauge
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from inferplane.replica.engines.base import EngineConstraint, EngineError, SamplingParams
from inferplane.replica.engines.grpc_client import GrpcEngineClient, to_proto_sampling
from inferplane.testing.fake_engine import FakeEngine, parse

pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeEngine, grpc.aio.Server, GrpcEngineClient]]:
    opts = parse(["--port", "0", "--token-delay", "0.02"])
    engine = FakeEngine(opts, Gauge("vllm:num_requests_running", "r", registry=CollectorRegistry()))
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcEngineClient(f"127.0.0.1:{port}")
    yield engine, server, client
    await client.close()
    await server.stop(0)


def test_sampling_params_map_field_by_field() -> None:
    msg = to_proto_sampling(
        SamplingParams(
            max_tokens=32,
            temperature=0.0,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            min_tokens=2,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            seed=7,
            stop=("\n\n",),
            stop_token_ids=(5, 163586),
            ignore_eos=True,
            logprobs=2,
            logit_bias=((11, -100.0),),
            constraint=EngineConstraint("json_schema", '{"type": "object"}'),
        )
    )
    assert msg.max_tokens == 32 and msg.HasField("temperature") and msg.temperature == 0.0
    assert msg.top_p == pytest.approx(0.9) and msg.top_k == 0 and msg.min_p == pytest.approx(0.05)
    assert msg.min_tokens == 2 and msg.seed == 7 and msg.logprobs == 2
    assert msg.presence_penalty == 0.5 and msg.frequency_penalty == 0.25
    assert msg.repetition_penalty == pytest.approx(1.1)
    assert list(msg.stop) == ["\n\n"] and list(msg.stop_token_ids) == [5, 163586]
    assert msg.ignore_eos and not msg.skip_special_tokens and msg.n == 1
    assert dict(msg.logit_bias) == {11: -100.0}
    assert msg.WhichOneof("constraint") == "json_schema"
    # Unset optionals stay unset: the engine applies its defaults.
    bare = to_proto_sampling(SamplingParams(max_tokens=1))
    assert not bare.HasField("temperature") and not bare.HasField("seed")
    choice = to_proto_sampling(
        SamplingParams(max_tokens=1, constraint=EngineConstraint("choice", json.dumps(["a", "b"])))
    )
    assert list(choice.choice.choices) == ["a", "b"]
    assert to_proto_sampling(
        SamplingParams(max_tokens=1, constraint=EngineConstraint("json_object", ""))
    ).json_object
    with pytest.raises(EngineError):
        to_proto_sampling(SamplingParams(max_tokens=1, constraint=EngineConstraint("xml", "")))


async def test_stream_accumulates_tokens_and_counts(served) -> None:  # type: ignore[no-untyped-def]
    """Invariant: the final `complete` repeats the last delta; it is not counted twice."""
    _engine, _server, client = served
    outs = [o async for o in client.generate("a", [1, 2, 3], SamplingParams(max_tokens=5))]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == [4, 5, 6, 7, 8]
    last = outs[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.completion_tokens == 5 and last.prompt_tokens == 3
    assert [o.completion_tokens for o in outs[:-1]] == [1, 2, 3, 4, 5]
    assert await client.healthy()
    info = await client.get_model_info()
    assert info.max_context_length == 2048


async def test_stop_token_finishes_with_stop(served) -> None:  # type: ignore[no-untyped-def]
    _engine, _server, client = served
    params = SamplingParams(max_tokens=50, stop_token_ids=(6,))
    outs = [o async for o in client.generate("s", [3], params)]
    assert [t for o in outs for t in o.token_ids] == [4, 5, 6]
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == 3
    assert outs[-1].matched_stop == 6


async def test_abandoning_the_stream_aborts_the_engine_request(served) -> None:  # type: ignore[no-untyped-def]
    """Invariant: a consumer that goes away (break, cancel) aborts the request in the engine."""
    engine, _server, client = served
    stream = client.generate("gone", [1], SamplingParams(max_tokens=1000))
    async for _out in stream:
        break
    await stream.aclose()  # what `async for ... break` + GC does, made deterministic
    assert "gone" in engine.aborted

    async def consume() -> None:
        async for _out in client.generate("cancelled", [1], SamplingParams(max_tokens=1000)):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "cancelled" in engine.aborted
    async with asyncio.timeout(5):
        while engine.active:
            await asyncio.sleep(0.02)
    loads = await client.get_loads()
    assert loads.loads[0].num_running_reqs == 0


async def test_explicit_abort_ends_the_stream_with_abort(served) -> None:  # type: ignore[no-untyped-def]
    _engine, _server, client = served
    outs = []
    async for out in client.generate("x", [1], SamplingParams(max_tokens=1000)):
        outs.append(out)
        if len(outs) == 2:
            await client.abort("x")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    await client.abort("unknown-id")  # ignored


async def test_engine_gone_mid_stream_raises_engine_error(served) -> None:  # type: ignore[no-untyped-def]
    _engine, server, client = served
    got = 0
    with pytest.raises(EngineError) as info:
        async for _out in client.generate("y", [1], SamplingParams(max_tokens=1000)):
            got += 1
            if got == 2:
                await server.stop(0)
    assert not info.value.retryable  # tokens were already streamed


async def test_unreachable_engine() -> None:
    client = GrpcEngineClient("127.0.0.1:1", health_timeout_seconds=0.5)
    assert not await client.healthy()
    with pytest.raises(EngineError) as info:
        async for _out in client.generate("z", [1], SamplingParams(max_tokens=1)):
            pass
    assert info.value.retryable
    await client.close()


async def test_logprobs_come_back_per_token_with_alternatives(served) -> None:  # type: ignore[no-untyped-def]
    """`output_logprobs` of each chunk become one TokenLogprob per id, k alternatives each;
    without logprobs asked for, none."""
    from inferplane.testing.fake_http_engine import fake_logprobs

    _engine, _server, client = served
    params = SamplingParams(max_tokens=3, logprobs=2)
    outs = [o async for o in client.generate("lp", [1, 2, 3], params)]
    entries = [e for o in outs for e in (o.logprobs or ())]
    assert [e.token_id for e in entries] == [t for o in outs for t in o.token_ids] == [4, 5, 6]
    value, top = fake_logprobs(5, 2)
    assert entries[1].logprob == value and list(entries[1].top) == top
    plain = [o async for o in client.generate("np", [1], SamplingParams(max_tokens=2))]
    assert all(o.logprobs is None for o in plain)
