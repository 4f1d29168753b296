"""Autoscaling and scale to zero through the whole local stack (issue 29).

Its own stack (module scope): kimi-tiny on fake-engine replicas (`StackConfig.
fake_engine_token_delay`: the real replica process around the fake vLLM HTTP engine, one token
every `TOKEN_DELAY` s, `MAX_NUM_SEQS` requests per replica), autoscaling on with short windows
(`WINDOW_S` to scale down, `IDLE_S` to zero). Requests are streamed text completions with the
official `openai` client through the edge, read as SSE (bench/autoscale.py's load, whose
machinery this module runs). In order:

- 3× one replica's capacity: more replicas in the routing table and in ListDeploymentReplicas;
- a light load that one replica serves: back to `min_replicas` after the window, the others
  retired through the drain, and no stream of the whole run ended without `[DONE]` or with an
  error event;
- idle: the deployment goes to zero replicas and `/v1/models` still lists the model;
- a request sent at zero is held by the picker while a replica starts, then answered (the
  cold-start time is printed);
- a second deployment at zero whose replica never starts (on the `grpc` transport, which the
  fake engine refuses at start) answers a request with 503 `deployment_cold_start` and
  Retry-After once its 3 s cold-start budget ran out, not before;
- the console's deployments page shows the autoscaler's decisions of the run.
"""

from __future__ import annotations

import asyncio
import html
import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.localstack import MODEL_NAME, Stack, kimi_tiny_deployment, running_stack
from inferplane.sdk import Client

from .conftest import local_config

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(900)]

TOKEN_DELAY = 0.05
MAX_TOKENS = 40  # 2 s per stream: streams are in flight when replicas drain
MAX_NUM_SEQS = 2  # one replica: 1 request/s
WINDOW_S = 6
IDLE_S = 10
MAX_REPLICAS = 3
NEVER = "kimi-never"  # the deployment whose replica cannot be placed
NEVER_BUDGET_S = 3


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "autoscale.py"
    spec = importlib.util.spec_from_file_location("inferplane_bench_autoscale", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = local_config(
        tmp_path_factory.mktemp("autoscale"),
        transport="http-completions",
        fake_engine_token_delay=TOKEN_DELAY,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=2048,
    )
    with running_stack(config, print) as started:
        yield started


@pytest.fixture(scope="module")
def orchestrator(stack: Stack) -> Iterator[Client]:
    with bench.orchestrator(stack) as client:
        bench.set_autoscaling(
            client, MODEL_NAME, min_replicas=1, max_replicas=MAX_REPLICAS,
            scale_to_zero=True, scale_down_window_seconds=WINDOW_S,
            idle_seconds_before_zero=IDLE_S,
        )  # fmt: skip
        yield client


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.create_api_key("autoscale-e2e")


@pytest.fixture(scope="module")
def outcomes() -> list[Any]:
    """Every request of the module's load (the failed-stream check covers them all)."""
    return []


def _api(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.config.base_url, api_key=key, max_retries=0)


def _placed(client: Client) -> int:
    return len(list(client.deployments.replicas(MODEL_NAME)))


def test_scales_up_under_three_times_one_replicas_capacity(
    stack: Stack, orchestrator: Client, key: str, outcomes: list[Any]
) -> None:
    capacity = MAX_NUM_SEQS / (MAX_TOKENS * TOKEN_DELAY)

    async def run() -> int:
        load = bench.Load(_api(stack, key), MODEL_NAME, MAX_TOKENS)
        load.start()
        load.set_rate(3 * capacity)
        try:
            await bench.wait_until(
                "a second replica serving", 120, lambda: len(bench.serving(stack)) >= 2
            )
        finally:
            await load.stop()
            outcomes.extend(load.outcomes)
        return len(bench.serving(stack))

    started = time.monotonic()
    serving = asyncio.run(run())
    print(f"{serving} replicas serving {time.monotonic() - started:.1f} s after the step")
    assert serving >= 2
    assert _placed(orchestrator) >= 2  # ListDeploymentReplicas
    decisions = orchestrator.deployments.autoscaler_decisions(MODEL_NAME)
    assert decisions[0].decision == "scale_up" and decisions[0].to_replicas >= 2
    assert decisions[0].reason  # says which signal asked for it


def test_scales_down_through_the_drain_without_a_failed_stream(
    stack: Stack, orchestrator: Client, key: str, outcomes: list[Any]
) -> None:
    """A load one replica serves (0.5 request/s of 2 s streams) runs on while the autoscaler
    retires the others after its window: their streams in flight end normally."""

    async def run() -> None:
        load = bench.Load(_api(stack, key), MODEL_NAME, MAX_TOKENS)
        load.start()
        load.set_rate(0.5)
        try:
            await bench.wait_until(
                "back to min_replicas", WINDOW_S + 120,
                lambda: bench.at_replicas(stack, orchestrator, 1),
            )  # fmt: skip
            await asyncio.sleep(2 * MAX_TOKENS * TOKEN_DELAY)  # streams after the drain
        finally:
            await load.stop()
            outcomes.extend(load.outcomes)

    asyncio.run(run())
    [last, *_] = orchestrator.deployments.autoscaler_decisions(MODEL_NAME)
    assert (last.decision, last.to_replicas) == ("scale_down", 1)
    summary = bench.summary(outcomes)
    print(f"requests of the run: {summary}")
    failed = [o for o in outcomes if o.failed_stream]
    assert not failed, failed
    assert summary["other_refused"] == summary["no_response"] == 0
    assert summary["served"] > 0


def test_idle_goes_to_zero_and_the_model_stays_listed(
    stack: Stack, orchestrator: Client, key: str
) -> None:
    async def run() -> None:
        await bench.wait_until(
            "scaled to zero", IDLE_S + 120, lambda: bench.at_replicas(stack, orchestrator, 0)
        )

    asyncio.run(run())
    assert _placed(orchestrator) == 0
    status = orchestrator.deployments.get(MODEL_NAME).status
    assert status.autoscaler.last_decision in ("scale_to_zero", "hold")
    listed = openai.OpenAI(base_url=stack.config.base_url, api_key=key).models.list()
    assert MODEL_NAME in [m.id for m in listed]


def test_a_request_at_zero_is_held_then_answered(
    stack: Stack, orchestrator: Client, key: str
) -> None:
    seconds, outcome = asyncio.run(
        bench.cold_start(stack, orchestrator, _api(stack, key), MAX_TOKENS, IDLE_S + 120)
    )
    print(f"cold start (fake engine): first token {seconds:.2f} s after the request")
    assert outcome.served and outcome.first_token is not None
    kinds = [d.decision for d in orchestrator.deployments.autoscaler_decisions(MODEL_NAME)]
    assert kinds[:2] == ["scale_from_zero", "scale_to_zero"]


def test_a_deployment_that_cannot_start_answers_503_with_retry_after(
    stack: Stack, orchestrator: Client, key: str
) -> None:
    never = kimi_tiny_deployment(stack.config)
    # The node-agent's engine is the fake vLLM HTTP server, which exits at once when asked for
    # vLLM's gRPC server: this deployment's replica is placed but never starts.
    never.profile.transport = "grpc"
    never.replicas, never.min_replicas, never.max_replicas = 0, 0, 1
    never.autoscaling.CopyFrom(
        orchestrator_pb2.Autoscaling(
            enabled=True, scale_to_zero=True, cold_start_budget_seconds=NEVER_BUDGET_S
        )
    )
    orchestrator.deployments.create(NEVER, never)

    async def send() -> Any:
        # Until the router has the new route the model is unknown (404): ask again.
        deadline = time.monotonic() + 30
        while True:
            outcome = await bench.stream_once(_api(stack, key), NEVER, MAX_TOKENS)
            if outcome.status != 404 or time.monotonic() > deadline:
                return outcome
            await asyncio.sleep(0.5)

    outcome = asyncio.run(send())
    held = outcome.end - outcome.start
    print(f"{NEVER}: {outcome.status} {outcome.error} after {held:.2f} s")
    assert outcome.status == 503 and outcome.error == "deployment_cold_start"
    assert int(outcome.retry_after) > 0
    assert held >= NEVER_BUDGET_S - 0.5  # held for the budget, not refused at once
    print(f"{NEVER}: {' '.join(orchestrator.deployments.explain(NEVER))}")
    orchestrator.deployments.delete(NEVER)  # no more engine restarts for the rest of the run


def test_the_console_shows_the_decisions(stack: Stack) -> None:
    """The deployments page, signed in with the bootstrap admin key through the edge, shows
    the autoscaler's decisions of this run (ListAutoscalerDecisions through the SDK)."""
    with httpx.Client(base_url=stack.config.console_url, follow_redirects=True) as web:
        page = web.get("sign-in").text
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token is not None
        signed = web.post("sign-in", data={"api_key": stack.admin_key, "csrf_token": token[1]})
        assert signed.status_code == 200
        deployments = web.get("deployments")
    assert deployments.status_code == 200
    text = html.unescape(deployments.text)
    section = text.split('<h2 id="dep-')[1:]
    kimi = next(s for s in section if s.split(">", 1)[1].startswith(f"{MODEL_NAME}<"))
    assert "on: the autoscaler sets replicas within 1..3" in kimi
    for kind in ("scale_up", "scale_down", "scale_to_zero", "scale_from_zero"):
        assert f'<th scope="row">{kind}</th>' in kimi
    assert "Replicas of kimi-tiny after each autoscaler decision" in kimi
