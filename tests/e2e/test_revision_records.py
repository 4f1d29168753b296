"""Issue 30 through the whole stack: a request's records name the profile revision that served
it — the orchestrator's routing table gives each endpoint its revision, the router puts the
served one in its usage report (the ledger's `revision` column, `group_by: revision`), its
telemetry record (`QueryLatency` filtered by revision) and `inferplane_router_revision_*`."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _admin(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.admin_key}"}


def _serving_revision(stack: Stack) -> str:
    with stack.config.security.channel(stack.config.address("orchestrator")) as channel:
        deployments = orchestrator_pb2_grpc.DeploymentServiceStub(channel)
        answer = deployments.GetDeployment(
            pb.GetDeploymentRequest(name=f"deployments/{MODEL_NAME}"), timeout=10
        )
    revision = answer.deployment.status.current_revision
    assert revision, "the deployment reports no serving revision"
    return str(revision)


def _usage(stack: Stack, **params: str) -> dict[str, Any]:
    answer = httpx.get(
        f"{stack.config.base_url}/admin/usage", params=params, headers=_admin(stack), timeout=30
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _router_requests(stack: Stack, revision: str) -> float:
    url = f"http://127.0.0.1:{stack.config.metrics_ports['router']}/metrics"
    text = httpx.get(url, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "inferplane_router_revision_requests":
            continue
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name.endswith("_total")
                and labels.get("deployment") == MODEL_NAME
                and labels.get("revision") == revision
            ):
                total += sample.value
    return total


def test_usage_telemetry_and_router_metrics_name_the_serving_revision(stack: Stack) -> None:
    revision = _serving_revision(stack)
    body = {"tenant": "revision-e2e", "scopes": ["inference"]}
    created = httpx.post(
        f"{stack.config.base_url}/admin/api-keys", json=body, headers=_admin(stack), timeout=30
    )
    assert created.status_code == 200, created.text
    secret = created.json()["secret"]
    key_id = created.json()["api_key"]["name"].removeprefix("api-keys/")
    client = openai.OpenAI(base_url=stack.config.base_url, api_key=secret, max_retries=0)
    request = kimi_tiny.NO_TOOL.request()
    for _ in range(2):
        client.chat.completions.create(
            model=request["model"],
            messages=request["messages"],
            temperature=0,
            max_tokens=4,
            extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        )

    deadline = time.monotonic() + 30
    while len(rows := _usage(stack, key_id=key_id).get("rows", [])) < 2:
        assert time.monotonic() < deadline, f"{len(rows)} of 2 ledger rows arrived"
        time.sleep(0.2)
    assert {row["revision"] for row in rows} == {revision}
    grouped = _usage(stack, key_id=key_id, group_by="revision")
    assert [(g["group"], g["requests"]) for g in grouped["groups"]] == [(revision, "2")]

    address = stack.config.address("telemetry")
    with stack.config.security.channel(address) as channel:
        telemetry = telemetry_pb2_grpc.TelemetryServiceStub(channel)

        def count(of: str) -> int:
            answer = telemetry.QueryLatency(
                telemetry_pb2.QueryLatencyRequest(
                    model=MODEL_NAME, window_seconds=3600, revision=of
                ),
                timeout=5,
            )
            return int(answer.request_count)

        deadline = time.monotonic() + 15
        while count(revision) < 2:
            assert time.monotonic() < deadline, "telemetry has no records of the revision"
            time.sleep(0.5)
        assert count("no-such-revision") == 0
    assert _router_requests(stack, revision) >= 2
