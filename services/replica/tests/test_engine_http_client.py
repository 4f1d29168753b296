"""HttpEngineClient (the `http-completions` transport) against the fake vLLM HTTP server
(testing/fake_http_engine.py) served in-process on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from inferplane.replica.engines.base import (
    EngineConstraint,
    EngineError,
    EngineOutput,
    SamplingParams,
)
from inferplane.replica.engines.http_client import HttpEngineClient, to_completion_body
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.fake_http_engine import FakeHttpEngine

pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeHttpEngine, HttpEngineClient]]:
    engine = FakeHttpEngine(token_delay=0.01, cached_tokens=16)
    port = await engine.start("127.0.0.1", 0)
    client = HttpEngineClient(f"http://127.0.0.1:{port}")
    yield engine, client
    await client.close()
    await engine.stop()


async def collect(
    client: HttpEngineClient, rid: str, prompt: list[int], params: SamplingParams
) -> list[EngineOutput]:
    return [o async for o in client.generate(rid, prompt, params)]


async def eventually(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_sampling_params_map_field_by_field() -> None:
    body = to_completion_body(
        "req-1",
        [1, 2, 3],
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
            seed=(1 << 40) + 7,
            stop=("\n\n",),
            stop_token_ids=(5, 163586),
            ignore_eos=True,
            logprobs=2,
            logit_bias=((11, -100.0),),
            constraint=EngineConstraint("json_schema", '{"type": "object"}'),
            stream_interval=4,
        ),
    )
    assert body["prompt"] == [1, 2, 3] and body["request_id"] == "req-1"
    # Token ids back, every token visible, exact usage at the end: what the pipeline needs.
    assert body["stream"] is True and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["skip_special_tokens"] is False and body["spaces_between_special_tokens"] is False
    assert body["max_tokens"] == 32 and body["temperature"] == 0.0 and body["top_p"] == 0.9
    assert body["top_k"] == 0 and body["min_p"] == 0.05 and body["min_tokens"] == 2
    assert body["presence_penalty"] == 0.5 and body["frequency_penalty"] == 0.25
    assert body["repetition_penalty"] == 1.1 and body["logprobs"] == 2
    assert body["seed"] == 7  # folded to 31 bits like the gRPC transport: same samples
    assert body["stop"] == ["\n\n"] and body["stop_token_ids"] == [5, 163586]
    assert body["ignore_eos"] is True and body["n"] == 1
    assert body["logit_bias"] == {"11": -100.0}
    assert body["structured_outputs"] == {"json": '{"type": "object"}'}
    assert body["stream_interval"] == 4  # the engine merges tokens itself
    # Unset optionals stay out: the engine applies its defaults.
    bare = to_completion_body("r", [1], SamplingParams(max_tokens=1))
    for name in (
        "temperature",
        "seed",
        "top_k",
        "stop",
        "logit_bias",
        "structured_outputs",
        "stream_interval",
    ):
        assert name not in bare


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [
        ("regex", "[a-z]+", {"regex": "[a-z]+"}),
        ("grammar", 'root ::= "a"', {"grammar": 'root ::= "a"'}),
        ("structural_tag", '{"type": "x"}', {"structural_tag": '{"type": "x"}'}),
        ("json_object", "", {"json_object": True}),
        ("choice", json.dumps(["a", "b"]), {"choice": ["a", "b"]}),
    ],
)
def test_constraints_map_to_structured_outputs(kind: str, value: str, expected: object) -> None:
    params = SamplingParams(max_tokens=1, constraint=EngineConstraint(kind, value))
    assert to_completion_body("r", [1], params)["structured_outputs"] == expected


@pytest.mark.parametrize(("kind", "value"), [("ebnf", "x"), ("choice", "nope"), ("choice", "[1]")])
def test_bad_constraints_are_not_retryable(kind: str, value: str) -> None:
    with pytest.raises(EngineError) as err:
        to_completion_body(
            "r", [1], SamplingParams(max_tokens=1, constraint=EngineConstraint(kind, value))
        )
    assert not err.value.retryable


async def test_streams_token_ids_and_exact_usage(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    outs = await collect(client, "a", [7, 8, 9], SamplingParams(max_tokens=4))
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12, 13]
    assert [o.finished for o in outs] == [False, False, False, True]
    last = outs[-1]
    assert last.finish_reason == "length" and last.matched_stop is None
    assert (last.prompt_tokens, last.cached_tokens, last.completion_tokens) == (3, 16, 4)
    assert [o.completion_tokens for o in outs] == [1, 2, 3, 4]
    assert engine.requests[0]["request_id"] == "a"
    # The keep-alive pool reuses the connection for the next request.
    outs = await collect(client, "b", [7], SamplingParams(max_tokens=2))
    assert outs[-1].completion_tokens == 2 and len(engine.requests) == 2
    assert engine.connections_opened == 1 and not engine.aborted


async def test_stop_token_and_stop_string(served) -> None:  # type: ignore[no-untyped-def]
    _engine, client = served
    outs = await collect(client, "s1", [7], SamplingParams(max_tokens=10, stop_token_ids=(10,)))
    assert [t for o in outs for t in o.token_ids] == [8, 9, 10]
    assert outs[-1].finish_reason == "stop" and outs[-1].matched_stop == 10
    outs = await collect(client, "s2", [7], SamplingParams(max_tokens=10, stop=(" t9",)))
    # The ids include the tokens of the match; the pipeline decides what to show.
    assert [t for o in outs for t in o.token_ids] == [8, 9]
    assert outs[-1].finish_reason == "stop" and outs[-1].matched_stop == " t9"


async def test_closing_the_iteration_closes_the_stream_and_the_engine_aborts(served) -> None:  # type: ignore[no-untyped-def]
    """Invariant: a consumer that walks away (client disconnect, deadline) frees the engine:
    the HTTP stream is closed and the engine no longer runs the request."""
    engine, client = served
    stream = client.generate("walk", [7], SamplingParams(max_tokens=500))
    async for _out in stream:
        assert engine.running == {"walk"}
        break
    await stream.aclose()
    await eventually(lambda: not engine.running)
    assert engine.aborted == ["walk"]
    # Cancellation of the consuming task does the same.
    started = asyncio.Event()

    async def consume() -> None:
        async for _out in client.generate("cancel", [7], SamplingParams(max_tokens=500)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: engine.aborted == ["walk", "cancel"] and not engine.running)


async def test_abort_ends_the_stream_with_an_abort_increment(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    outs = []
    async for out in client.generate("ab", [7], SamplingParams(max_tokens=500)):
        outs.append(out)
        if len(outs) == 3:
            await client.abort("ab")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].completion_tokens == 3
    await eventually(lambda: engine.aborted == ["ab"] and not engine.running)
    await client.abort("ab")  # unknown by now: ignored
    await client.abort("never-seen")


async def test_abort_from_another_task(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    outs: list[EngineOutput] = []

    async def consume() -> None:
        async for out in client.generate("other", [7], SamplingParams(max_tokens=500)):
            outs.append(out)

    task = asyncio.create_task(consume())
    await eventually(lambda: len(outs) >= 2)
    await client.abort("other")
    await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason == "abort"
    await eventually(lambda: engine.aborted == ["other"] and not engine.running)


async def test_engine_death_mid_stream_is_an_error_not_retryable(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    engine.die_after_tokens = 3
    outs = []
    with pytest.raises(EngineError) as err:
        async for out in client.generate("d", [7], SamplingParams(max_tokens=50)):
            outs.append(out)
    assert len(outs) == 3 and not err.value.retryable


async def test_engine_death_before_the_first_token_is_retryable(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    engine.die_after_tokens = 0
    with pytest.raises(EngineError) as err:
        await collect(client, "d0", [7], SamplingParams(max_tokens=50))
    assert err.value.retryable


async def test_error_event_mid_stream(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    engine.error_after_tokens = 2
    outs = []
    with pytest.raises(EngineError, match="engine core died") as err:
        async for out in client.generate("e", [7], SamplingParams(max_tokens=50)):
            outs.append(out)
    assert len(outs) == 2 and not err.value.retryable
    engine.error_after_tokens = 0
    with pytest.raises(EngineError) as err:
        await collect(client, "e0", [7], SamplingParams(max_tokens=50))
    assert err.value.retryable


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (503, True), (500, True)])
async def test_http_status_errors(served, status: int, retryable: bool) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    engine.status = status
    with pytest.raises(EngineError, match=f"HTTP {status}: fake status") as err:
        await collect(client, "st", [7], SamplingParams(max_tokens=5))
    assert err.value.retryable is retryable


async def test_health_and_an_engine_that_is_gone(served) -> None:  # type: ignore[no-untyped-def]
    engine, client = served
    assert await client.healthy()
    engine.unhealthy = True
    assert not await client.healthy()
    nobody = HttpEngineClient(f"http://127.0.0.1:{free_port()}", health_timeout_seconds=1)
    try:
        assert not await nobody.healthy()
        with pytest.raises(EngineError) as err:
            await collect(nobody, "x", [7], SamplingParams(max_tokens=5))
        assert err.value.retryable
    finally:
        await nobody.close()


async def test_concurrent_streams_share_the_pool(served) -> None:  # type: ignore[no-untyped-def]
    _engine, client = served
    results = await asyncio.gather(
        *(collect(client, f"c{i}", [100 * i], SamplingParams(max_tokens=8)) for i in range(8))
    )
    for i, outs in enumerate(results):
        assert [t for o in outs for t in o.token_ids] == [100 * i + k for k in range(1, 9)]
        assert outs[-1].completion_tokens == 8


def _event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _token(ids: list[int], finish: str | None = None) -> dict[str, object]:
    choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}
    return {"choices": [choice]}


async def test_events_that_arrive_together_are_one_increment() -> None:
    """A loaded node-agent reads several engine increments at once: they become one
    EngineOutput (fewer chunks downstream); an event split across reads is reassembled."""
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}
    body = b"".join(
        [_event(_token([10])), _event(_token([11])), _event(_token([12]))]
    )  # read 1: three whole events
    split = _event(_token([13]))
    reads = [
        body + split[:9],  # ...and the start of a fourth
        split[9:],  # read 2: the rest of the fourth
        _event(_token([14])) + _event(_token([2], "stop")) + _event(usage) + b"data: [DONE]\n\n",
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                b":"
            )[1]
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        for piece in reads:  # one socket read each: the client gets them apart
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpEngineClient(f"http://127.0.0.1:{port}")
    try:
        outs = await collect(client, "r", [1, 2, 3], SamplingParams(max_tokens=8))
    finally:
        await client.close()
        server.close()
    assert [o.token_ids for o in outs] == [(10, 11, 12), (13,), (14, 2)]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == 6
    assert [o.completion_tokens for o in outs[:2]] == [3, 4]


async def test_logprobs_come_back_per_token_with_alternatives(served) -> None:  # type: ignore[no-untyped-def]
    """With logprobs k the body asks for tokens as ids, and every output id carries its
    logprob and its k alternatives (most likely first), the finish's ids included."""
    from inferplane.testing.fake_http_engine import fake_logprobs

    engine, client = served
    outs = await collect(client, "r-lp", [10, 20], SamplingParams(max_tokens=4, logprobs=3))
    assert engine.requests[-1]["return_tokens_as_token_ids"] is True
    ids = [t for o in outs for t in o.token_ids]
    entries = [e for o in outs for e in (o.logprobs or ())]
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in outs)
    assert [e.token_id for e in entries] == ids == [21, 22, 23, 24]
    value, top = fake_logprobs(21, 3)
    assert entries[0].logprob == value and list(entries[0].top) == top
    without = await collect(client, "r-no", [10, 20], SamplingParams(max_tokens=2))
    assert all(o.logprobs is None for o in without)
    assert "return_tokens_as_token_ids" not in engine.requests[-1]
