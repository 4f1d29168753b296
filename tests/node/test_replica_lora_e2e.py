"""LoRA adapters on a real replica process (issue 29): `python -m inferplane.replica`, started
from the node-agent's own launch plan on `inproc` (vLLM's AsyncLLM, fp32, eager: a
`LoRARequest` per request) and on `http-completions` (a child `vllm serve`: the adapter loaded
through `POST /v1/load_lora_adapter`, then named as the model) with the fixture kimi-tiny and
LoRA on (`max_loras` 2, `max_lora_rank` 8, an allow-listed root holding
a copy of the fixture adapter `models/kimi-tiny-lora`).

With greedy decoding (temperature 0), the same NO_TOOL chat gives kimi-tiny's canonical answer
without the adapter headers and the adapter's trained answer with them
(`x-inferplane-adapter`, `x-inferplane-adapter-source`, as the endpoint picker sets them); the
base model's answer is identical before and after the adapter was used, and the replica's
state stream (WatchReplicaState) lists the adapter as loaded and its KV events name the adapter
(the blocks of a prompt run with it are `kvblocks.chain` salted with its name; the same prompt
on the base model stores the base's blocks: no prefix shared across). An adapter whose source leaves
the root (a symlink out of it, a `..` path) is refused before admission with
FAILED_PRECONDITION, code `adapter_source_not_allowed`, naming `model`. ~40-50 s per transport
on 2 cores (the engine's start is most of it); the `http-completions` case runs with the scenario
suites.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane import kvblocks, lora
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures import kimi_tiny_lora as kl
from inferplane.node_agent.supervisor.process import EngineProcess, ProcessSpawner, plan_launch
from inferplane.replica.testing.pipeline import kimi_tiny_ids, kimi_tiny_spec
from inferplane.wire import (
    ResponseSummary,
    chat_request_from_dict,
    completion_request_from_dict,
)
from inferplane.wire.headers import ADAPTER, ADAPTER_SOURCE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

READY_SECONDS = 180
ADAPTER_NAME = "sunny"  # the catalogue id; clients send "kimi-tiny:sunny"
BLOCK = 128  # tokens per KV block on vLLM's CPU backend


def answer(response: pb.CreateChatCompletionResponse) -> tuple[str, str]:
    """(reasoning, content) of the only choice."""
    message = response.choices[0].message
    return message.reasoning_content, message.content.string_value


def no_tool_chat() -> pb.CreateChatCompletionRequest:
    body = kt.NO_TOOL.request(temperature=0.0, max_completion_tokens=64)
    return pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))


@pytest.mark.parametrize(
    "transport",
    # The child engine's case is a second vLLM start: with the scenario suites (--scenarios).
    ["inproc", pytest.param("http-completions", marks=pytest.mark.scenario)],
)
def test_an_adapter_changes_the_output_and_the_base_model_stays_the_same(
    tmp_path: Path, transport: str
) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    adapter = root / "sunny"
    shutil.copytree(kl.adapter_path(), adapter)
    (root / "escape").symlink_to(kl.adapter_path())  # inside by name, outside once resolved
    spec = kimi_tiny_spec()
    spec.transport = transport
    spec.dtype = "float32"
    spec.kv_cache_bytes = 64 << 20
    spec.max_loras, spec.max_lora_rank, spec.lora_root = 2, kl.RANK, str(root)
    plan = plan_launch("e2e-lora", spec, data_dir=tmp_path / "node", cpu=True)

    async def run() -> None:
        process = await ProcessSpawner().spawn(plan)
        assert isinstance(process, EngineProcess)
        try:
            await _scenario(process, plan.inference_address, adapter, root, transport)
        except BaseException:
            print(plan.log_path.read_text(errors="replace")[-6000:])
            raise
        finally:
            code = await process.stop(20)
        assert code == 0, f"the replica exited with {code} on SIGTERM"

    asyncio.run(run())


async def _scenario(
    process: EngineProcess, address: str, adapter: Path, root: Path, transport: str
) -> None:
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert process.returncode is None, "the replica exited during start-up"
            assert time.monotonic() - started < READY_SECONDS, "not ready in time"
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            except grpc.aio.AioRpcError:
                status = None
            await asyncio.sleep(0.5)
        print(f"\nreplica_ready_seconds: {time.monotonic() - started:.1f}")
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        headers = ((ADAPTER, ADAPTER_NAME), (ADAPTER_SOURCE, str(adapter)))

        before = answer(await stub.CreateChatCompletion(no_tool_chat()))
        assert before == (kt.NO_TOOL.reasoning, kt.NO_TOOL.content)

        t0 = time.perf_counter()
        call = stub.CreateChatCompletion(no_tool_chat(), metadata=headers)
        response = await call
        with_adapter = answer(response)
        assert response.model == f"{kt.SERVED_MODEL_NAME}:{ADAPTER_NAME}"
        first_seconds = time.perf_counter() - t0
        assert with_adapter == (kl.ADAPTER_REASONING, kl.ADAPTER_CONTENT)
        summary = ResponseSummary.from_metadata(tuple(await call.trailing_metadata()))
        assert summary.finish_reason == "stop" and summary.completion_tokens > 0
        t0 = time.perf_counter()
        again = answer(await stub.CreateChatCompletion(no_tool_chat(), metadata=headers))
        loaded_seconds = time.perf_counter() - t0
        assert again == with_adapter
        print(
            f"[{transport}] adapter first request {first_seconds:.3f} s, "
            f"loaded {loaded_seconds:.3f} s"
        )

        after = answer(await stub.CreateChatCompletion(no_tool_chat()))
        assert after == before

        # Routers learn which adapters the engine holds (vLLM's own list on inproc, the most
        # recently used on http-completions).
        control = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
        watch = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest(router_id="e2e"))
        async with asyncio.timeout(10):
            while list((await watch.read()).loaded_adapters) != [ADAPTER_NAME]:
                pass

        # Prefix caching per adapter: the engine's KV events name the adapter, so the blocks
        # of a prompt run with it hash as `kvblocks.chain` with the adapter's name, and the same
        # prompt on the base model stores other blocks (no cache hit across the two).
        prompt: list[int] = []
        while len(prompt) < 2 * BLOCK + 60:  # two full blocks and a partial one
            prompt += kimi_tiny_ids(f"{len(prompt)}. Tell me something about Paris.")
        for adapter_name, metadata in ((ADAPTER_NAME, headers), ("", None)):
            request = completion_request_from_dict(
                {"model": kt.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 4}
            )
            await stub.CreateCompletion(
                pb.CreateCompletionRequest(request=request), metadata=metadata, timeout=60
            )
            stored: dict[str, list[int]] = {}
            async with asyncio.timeout(15):
                while len(stored.get(adapter_name, ())) < 2:
                    for block_set in (await watch.read()).stored:
                        stored.setdefault(block_set.adapter, []).extend(block_set.hashes)
            assert stored == {adapter_name: kvblocks.chain(prompt, BLOCK, adapter_name)}
        watch.cancel()

        for source in (root / "escape", root / ".." / "outside", kt.model_path()):
            refused = stub.CreateChatCompletion(
                no_tool_chat(), metadata=((ADAPTER, "out"), (ADAPTER_SOURCE, str(source)))
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await refused
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, source
            trailers = dict(info.value.trailing_metadata())
            assert trailers["x-openai-error-code"] == lora.ADAPTER_SOURCE_NOT_ALLOWED
            assert trailers["x-openai-error-param"] == "model"
            assert "outside the allow-listed adapter root" in info.value.details()
