"""The replica's LoRA adapters (`inferplane.replica.engines.lora.AdapterRegistry`, issue 29):
the picker's headers checked against the spec (LoRA on, task, transport, the allow-listed root
after symlinks and `..`, a readable config, the rank), a stable vLLM id per (name, folder), and
what `loaded()` reports: vLLM's own list on inproc, the most recently used otherwise; and the
request path through the replica's server with a scripted engine (the headers' adapter on every
generation's `SamplingParams`, refusals before admission). The real engine is in
tests/node/test_replica_lora_e2e.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane import lora
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures import kimi_tiny_lora as kl
from inferplane.replica.engines.lora import AdapterRegistry
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    kimi_tiny_ids,
    kimi_tiny_spec,
    run_scenario,
    script,
)
from inferplane.replica_contract import Task, Transport
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError
from inferplane.wire import chat_request_from_dict, completion_request_from_dict
from inferplane.wire.headers import ADAPTER, ADAPTER_SOURCE


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An adapter root holding `a` (the fixture adapter, rank 8) and `wide` (rank 64)."""
    root = tmp_path / "adapters"
    shutil.copytree(kl.adapter_path(), root / "a")
    (root / "wide").mkdir()
    (root / "wide" / lora.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 64}))
    return root


def registry(root: Path, **fields: object) -> AdapterRegistry:
    spec = nodeagent_pb2.ReplicaSpec(
        max_loras=2, max_lora_rank=16, lora_root=str(root), transport=Transport.INPROC
    )
    for name, value in fields.items():
        setattr(spec, name, value)
    return AdapterRegistry(spec)


def refusal(reg: AdapterRegistry, name: str, source: str) -> FailedPreconditionError:
    with pytest.raises(FailedPreconditionError) as info:
        reg.resolve(name, source)
    assert info.value.param == "model"
    return info.value


def test_ids_are_stable_per_name_and_folder(root: Path) -> None:
    reg = registry(root)
    first = reg.resolve("m:a", str(root / "a"))
    assert (first.name, first.lora_id, first.path, first.rank) == ("m:a", 1, str(root / "a"), 8)
    assert reg.resolve("m:a", str(root / "x" / ".." / "a")) is first  # the same folder
    other = reg.resolve("m:b", str(root / "a"))
    assert other.lora_id == 2
    (root / "a2").symlink_to(root / "a")
    assert reg.resolve("m:a", str(root / "a2")) is first  # resolved: the same folder
    shutil.copytree(root / "a", root / "a-v2")
    moved = reg.resolve("m:a", str(root / "a-v2"))  # a new folder under the name: a new id
    assert moved.lora_id == 3 and moved.path == str(root / "a-v2")


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("{tmp}/elsewhere", lora.ADAPTER_SOURCE_NOT_ALLOWED),
        ("{root}/../elsewhere", lora.ADAPTER_SOURCE_NOT_ALLOWED),
        ("{root}/escape", lora.ADAPTER_SOURCE_NOT_ALLOWED),
        ("{root}/missing", lora.ADAPTER_UNREADABLE),
        ("{root}/wide", lora.ADAPTER_RANK_TOO_LARGE),
    ],
)
def test_refusals_name_their_code(root: Path, source: str, code: str) -> None:
    (root / "escape").symlink_to(kl.adapter_path())
    reg = registry(root)
    error = refusal(reg, "m:x", source.format(tmp=root.parent, root=root))
    assert error.code == code
    if code == lora.ADAPTER_RANK_TOO_LARGE:
        assert "rank 64, above this replica's max_lora_rank 16" in error.message


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({"max_loras": 0}, lora.LORA_DISABLED, "serves no LoRA adapters (max_loras is 0)"),
        ({"task": Task.EMBED}, lora.LORA_DISABLED, "serves no LoRA adapters"),
        (
            {"transport": Transport.HTTP_COMPLETIONS, "lora_root": ""},
            lora.ADAPTER_SOURCE_NOT_ALLOWED,
            "no allow-listed adapter root",
        ),
    ],
)
def test_a_replica_that_cannot_serve_adapters_refuses(
    root: Path, fields: dict[str, object], code: str, says: str
) -> None:
    error = refusal(registry(root, **fields), "m:a", str(root / "a"))
    assert error.code == code and says in error.message


def test_the_grpc_transport_refuses_adapters(root: Path) -> None:
    spec = nodeagent_pb2.ReplicaSpec(max_loras=2, lora_root=str(root))
    error = refusal(AdapterRegistry(spec, transport=Transport.GRPC), "m:a", str(root / "a"))
    assert error.code == lora.ADAPTER_TRANSPORT_UNSUPPORTED


@pytest.mark.parametrize("name,source", [("m:a", ""), ("bad name", "x"), ("\u00e9", "x")])
def test_malformed_headers_are_invalid_arguments(root: Path, name: str, source: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        registry(root).resolve(name, source)
    assert info.value.code == lora.INVALID_ADAPTER and info.value.param == "model"


def test_loaded_without_an_engine_list_is_the_most_recently_used(root: Path) -> None:
    """The http-completions view: vLLM's LRU cache of `max_loras` holds the most recently
    used adapters."""
    reg = registry(root)
    for name in ("m:1", "m:2", "m:1", "m:3"):
        reg.used(reg.resolve(name, str(root / "a")))
    assert reg.loaded() == ("m:1", "m:3")


def test_loaded_with_the_engine_list_reads_it_after_use(root: Path) -> None:
    """inproc: vLLM's `list_loras` ids, mapped back to catalogue names, read again (in the
    background) after each use."""

    async def scenario() -> None:
        reg = registry(root)
        held: set[int] = set()
        reads = 0

        async def list_ids() -> set[int]:
            nonlocal reads
            reads += 1
            await asyncio.sleep(0)
            return set(held)

        reg.attach(list_ids)
        a = reg.resolve("m:a", str(root / "a"))
        b = reg.resolve("m:b", str(root / "a"))
        assert reg.loaded() == ()
        held.add(a.lora_id)
        reg.used(a)
        await asyncio.sleep(0)  # the read is in flight (inside list_ids)
        reg.used(a)
        reg.used(a)  # both coalesced: one more read once the one in flight returns
        await asyncio.sleep(0.01)
        assert reg.loaded() == ("m:a",) and reads == 2
        held.discard(a.lora_id)
        held.add(b.lora_id)
        reg.used(b)
        await asyncio.sleep(0.01)
        assert reg.loaded() == ("m:b",)

    asyncio.run(scenario())


def test_a_failing_engine_list_keeps_the_last(root: Path) -> None:
    async def scenario() -> None:
        reg = registry(root)
        a = reg.resolve("m:a", str(root / "a"))
        answers: list[object] = [{a.lora_id}, RuntimeError("engine gone")]

        async def list_ids() -> set[int]:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer  # type: ignore[return-value]

        reg.attach(list_ids)
        await reg.refresh()
        await reg.refresh()
        assert reg.loaded() == ("m:a",)

    asyncio.run(scenario())


# -- the request path: headers → the engine's SamplingParams.adapter, refusals first ----------


def lora_replica(root: Path, engine: ScriptedEngine, **fields: object) -> FakeReplica:
    spec = kimi_tiny_spec()
    spec.max_loras, spec.max_lora_rank, spec.lora_root = 2, 8, str(root)
    for name, value in fields.items():
        setattr(spec, name, value)
    return FakeReplica("r1", spec, engine)


def chat_request(**extra: object) -> pb.CreateChatCompletionRequest:
    body = kt.NO_TOOL.request(max_completion_tokens=8, **extra)
    return pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))


def test_the_adapter_of_the_headers_reaches_every_generation(root: Path) -> None:
    """Chat with n=2 and a text completion name the adapter in their headers: each engine
    request carries the resolved `Adapter` (one id for the name and folder) and the response
    names the adapter's model (`{base}:{adapter}`); a request without the headers runs on the
    base model."""
    engine = ScriptedEngine(script(kimi_tiny_ids("Hello")))
    replica = lora_replica(root, engine)
    headers = ((ADAPTER, "a"), (ADAPTER_SOURCE, str(root / "x" / ".." / "a")))

    async def body(stub: Any) -> None:
        response = await stub.CreateChatCompletion(chat_request(n=2), metadata=headers)
        assert response.model == "kimi-tiny:a"  # the adapter's public name, `{base}:{adapter}`
        plain = await stub.CreateChatCompletion(chat_request())
        assert plain.model == "kimi-tiny"
        completion = completion_request_from_dict(
            {"model": kt.SERVED_MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
        )
        await stub.CreateCompletion(
            pb.CreateCompletionRequest(request=completion), metadata=headers
        )

    run_scenario(engine, body, replicas=[replica])
    adapters = [params.adapter for _id, _ids, params in engine.requests]
    assert len(adapters) == 4 and adapters[2] is None
    del adapters[2]
    assert {(a.name, a.lora_id, a.path, a.rank) for a in adapters[:3]} == {
        ("a", 1, str(root / "a"), kl.RANK)
    }


@pytest.mark.parametrize(
    ("fields", "source", "code"),
    [
        ({}, "{root}/../elsewhere", lora.ADAPTER_SOURCE_NOT_ALLOWED),
        ({}, "{root}/wide", lora.ADAPTER_RANK_TOO_LARGE),
        ({"max_loras": 0}, "{root}/a", lora.LORA_DISABLED),
    ],
)
def test_a_refused_adapter_never_reaches_admission_or_the_engine(
    root: Path, fields: dict[str, object], source: str, code: str
) -> None:
    engine = ScriptedEngine(script(kimi_tiny_ids("Hello")))
    replica = lora_replica(root, engine, **fields)
    headers = ((ADAPTER, "a"), (ADAPTER_SOURCE, source.format(root=root)))

    async def body(stub: Any) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(chat_request(), metadata=headers)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        trailers = dict(info.value.trailing_metadata())
        assert trailers["x-openai-error-code"] == code
        assert trailers["x-openai-error-param"] == "model"

    run_scenario(engine, body, replicas=[replica])
    assert replica.admitted == 0 and engine.requests == []


def test_only_a_served_adapter_counts_as_loaded(root: Path) -> None:
    """Without the engine's own list (http-completions), an adapter the engine refused (a
    load that failed) is not reported to routers as loaded; one that produced output is."""
    failing = ScriptedEngine(script(kimi_tiny_ids("Hello")), fail_at=0, rejects=True)
    replica = lora_replica(root, failing)
    reg = AdapterRegistry(replica.spec, transport=Transport.HTTP_COMPLETIONS)
    headers = ((ADAPTER, "a"), (ADAPTER_SOURCE, str(root / "a")))

    async def refused(stub: Any) -> None:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.CreateChatCompletion(chat_request(), metadata=headers)

    run_scenario(failing, refused, replicas=[replica], adapters=reg)
    assert reg.loaded() == ()
    serving = ScriptedEngine(script(kimi_tiny_ids("Hello")))

    async def served(stub: Any) -> None:
        await stub.CreateChatCompletion(chat_request(), metadata=headers)

    run_scenario(serving, served, replicas=[lora_replica(root, serving)], adapters=reg)
    assert reg.loaded() == ("a",)
