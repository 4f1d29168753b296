"""Engines of `embed` replicas: started with vLLM's pooling runner on `inproc` and
`http-completions`, refused on `grpc` (node-agent and replica process alike); the HTTP
transport's `/v1/embeddings` (against the fake vLLM HTTP server); a replica shutting down cuts
embeddings in flight short with an engine error."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig
from inferplane.node_agent.supervisor.process import plan_launch
from inferplane.replica.engines.base import EngineError
from inferplane.replica.engines.http_client import HttpEngineClient, to_embedding_body
from inferplane.replica.engines.inproc import engine_argv
from inferplane.replica.settings import parse_args
from inferplane.replica.state import TrackedEngine
from inferplane.replica.testing.pipeline import ScriptedEngine, fake_embedding
from inferplane.replica_contract import Task, resolve_transport
from inferplane.runtime import ConfigError, FailedPreconditionError
from inferplane.testing.fake_http_engine import FakeHttpEngine

pytestmark = [pytest.mark.timeout(30)]


def spec(transport: str = "", task: str = Task.EMBED, **extra: object) -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(
        served_model_name="embed-tiny",
        model_source="/m/embed",
        transport=transport,
        task=task,
        **extra,  # type: ignore[arg-type]
    )


def runner(args: Sequence[str]) -> str | None:
    args = list(args)
    return args[args.index("--runner") + 1] if "--runner" in args else None


# -- how the engine starts -------------------------------------------------------------------


def test_an_embed_spec_runs_the_pooling_runner_on_inproc_and_http() -> None:
    """`--runner pooling` for `embed` (in AsyncLLM's engine arguments and in the child
    `vllm serve` line), nothing for `generate` or a spec without task; a runner the spec's
    extra engine arguments name wins."""
    assert runner(engine_argv(spec(), cpu=True)) == "pooling"
    assert runner(engine_argv(spec(task="generate"), cpu=True)) is None
    assert runner(engine_argv(spec(task=""), cpu=True)) is None
    own = engine_argv(spec(extra_engine_args=["--runner", "auto"]), cpu=True)
    assert own.count("--runner") == 1 and runner(own) == "auto"


def test_inproc_engine_arguments_parse_as_a_pooling_model_in_vllm() -> None:
    """vLLM's own parser reads the pooling runner from the inproc arguments."""
    from inferplane.replica.engines.inproc import engine_args
    from inferplane.replica.testing.pipeline import embed_tiny_spec

    args = engine_args(engine_argv(embed_tiny_spec(), cpu=True))  # a real folder: vLLM reads it
    assert args.runner == "pooling"


@pytest.mark.parametrize("transport", ["http-completions", "inproc", ""])
def test_plans_of_embed_replicas(tmp_path: Path, transport: str) -> None:
    """The launch plan: the child engine's `vllm serve` line runs the pooling runner; on
    inproc the spec file carries the task to the replica process."""
    plan = plan_launch("e1", spec(transport), data_dir=tmp_path, cpu=True)
    if transport == "http-completions":
        assert runner(plan.argv[plan.argv.index("serve") :]) == "pooling"
    else:
        assert "--" not in plan.argv
    assert json_format.Parse(plan.spec_json, nodeagent_pb2.ReplicaSpec()).task == Task.EMBED


def test_grpc_cannot_serve_embeddings_and_the_refusal_names_the_transport(
    tmp_path: Path,
) -> None:
    """vLLM's gRPC `Embed` takes no `dimensions`: an `embed` spec on `grpc` is refused with a
    message naming the transport and the ones that work; unknown tasks are refused too."""
    with pytest.raises(ValueError, match=r"the grpc engine transport cannot serve embeddings"):
        resolve_transport(spec("grpc"))
    with pytest.raises(ValueError, match="http-completions or inproc"):
        plan_launch("e1", spec("grpc"), data_dir=tmp_path, cpu=True)
    with pytest.raises(ValueError, match="unknown replica task 'rerank'"):
        plan_launch("e1", spec(task="rerank"), data_dir=tmp_path, cpu=True)
    assert resolve_transport(spec("grpc", task="generate")) == "grpc"


@pytest.mark.anyio
async def test_the_node_agent_refuses_an_embed_spec_on_grpc_before_starting_anything(
    tmp_path: Path,
) -> None:
    """FAILED_PRECONDITION at StartReplica (param spec.transport; spec.task for an unknown
    task), and no process is spawned."""
    spawned: list[object] = []

    class Spawner:
        async def spawn(self, plan: object) -> object:
            spawned.append(plan)
            raise AssertionError("nothing may start")

    manager = ReplicaManager(SupervisorConfig(data_dir=tmp_path), spawner=Spawner())
    with pytest.raises(FailedPreconditionError, match="grpc engine transport") as info:
        await manager.start("e1", spec("grpc"))
    assert info.value.param == "spec.transport"
    with pytest.raises(FailedPreconditionError) as info:
        await manager.start("e1", spec(task="rerank"))
    assert info.value.param == "spec.task"
    assert spawned == [] and manager.list() == []
    await manager.close()


def test_the_replica_process_refuses_an_embed_spec_on_grpc(tmp_path: Path) -> None:
    """The replica process's own command line check (exit 2 in `main`)."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json_format.MessageToJson(spec("grpc")))
    argv = ["--replica-id", "e1", "--spec-file", str(spec_file), "--plaintext"]
    child = ["--engine-address", "127.0.0.1:1", "--", "python", "-m", "x"]
    with pytest.raises(ConfigError, match="grpc engine transport cannot serve embeddings"):
        parse_args([*argv, "--transport", "grpc", *child])
    assert parse_args([*argv, "--transport", "http-completions", *child]).spec.task == Task.EMBED


# -- the HTTP transport's /v1/embeddings -----------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeHttpEngine, HttpEngineClient]]:
    engine = FakeHttpEngine()
    port = await engine.start("127.0.0.1", 0)
    client = HttpEngineClient(f"http://127.0.0.1:{port}")
    yield engine, client
    await client.close()
    await engine.stop()


def test_the_embeddings_body_sends_token_ids_and_asks_for_little_endian_float32() -> None:
    body = to_embedding_body("embd-1", [(2, 5, 3), [2, 3]], 16)
    assert body == {
        "input": [[2, 5, 3], [2, 3]],
        "encoding_format": "base64",
        "embed_dtype": "float32",
        "endianness": "little",
        "request_id": "embd-1",
        "dimensions": 16,
    }
    assert "dimensions" not in to_embedding_body("embd-1", [[2]], None)


@pytest.mark.anyio
async def test_http_embed_returns_the_vectors_in_input_order(
    served: tuple[FakeHttpEngine, HttpEngineClient],
) -> None:
    """Decoded from base64 float32, ordered by `index` (the fake answers in reverse)."""
    engine, client = served
    inputs = [[2, 240, 3], [2, 241, 3], [2, 7, 8, 3]]
    got = await client.embed("embd-1", inputs)
    assert [list(v) for v in got] == [list(fake_embedding(i)) for i in inputs]
    assert all(isinstance(v, array) and v.typecode == "f" for v in got)
    cut = await client.embed("embd-2", inputs[:1], dimensions=32)
    assert list(cut[0]) == list(fake_embedding(inputs[0], dimensions=32))
    assert engine.requests[1]["dimensions"] == 32


@pytest.mark.anyio
async def test_http_embed_errors(served: tuple[FakeHttpEngine, HttpEngineClient]) -> None:
    """A 400 (vLLM refusing `dimensions`) is `rejected`; a 5xx or a dead engine retryable."""
    engine, client = served
    with pytest.raises(EngineError) as info:
        await client.embed("embd-1", [[2, 3]], dimensions=48)
    assert info.value.rejected and "Matryoshka" in str(info.value)
    engine.status = 500
    with pytest.raises(EngineError) as info:
        await client.embed("embd-2", [[2, 3]])
    assert info.value.retryable and not info.value.rejected
    await engine.stop()
    with pytest.raises(EngineError) as info:
        await HttpEngineClient(client.base_url).embed("embd-3", [[2, 3]])
    assert info.value.retryable


# -- shutdown --------------------------------------------------------------------------------


def test_abort_all_cuts_embeddings_in_flight_short_with_an_engine_error() -> None:
    """At shutdown (drain grace over) the replica aborts what runs: an embedding in flight
    is cancelled in the engine and its caller gets EngineError (UNAVAILABLE engine_failed),
    not a silent cancel; a caller that leaves by itself still gets its cancellation."""
    inner = ScriptedEngine([], block_at=0)
    failures: list[int] = []
    tracked = TrackedEngine(inner, lambda: failures.append(1))

    async def scenario() -> None:
        call = asyncio.ensure_future(tracked.embed("embd-1", [[2, 3]]))
        await asyncio.wait_for(inner.blocked.wait(), 5)
        assert await tracked.abort_all() == 1
        with pytest.raises(EngineError, match="shut down"):
            await call
        leaving = asyncio.ensure_future(tracked.embed("embd-2", [[2, 3]]))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving

    asyncio.run(scenario())
    assert inner.cancelled == ["embd-1", "embd-2"] and failures == []
