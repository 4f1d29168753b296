"""The performance gate's runner through the real edge (issue 30): GuideLLM (its own
`.venv-guidellm`) runs a tiny workload (agentic-v1's shape: shared system prompts, two turns
with history, Poisson arrivals, a seed; 6 requests) against kimi-tiny pinned to the revision
that serves, with the stack's operator key (scopes inference and admin, written by the stack
for the orchestrator's gate); every request completes. The same pin with an inference-only key
is refused (403 insufficient_scope naming the header), a pin to a revision no replica runs is
503 revision_unavailable, and an answer names the revision that served it."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import pytest

from inferplane.benchmark import Workload, load_workload, run_workload, validate_workload
from inferplane.benchmark.workload import WORKLOADS_DIR
from inferplane.localstack import MODEL_NAME, Stack, benchmark_key_file
from inferplane.wire.headers import REVISION, SERVED_REVISION

pytestmark = pytest.mark.e2e


def _tiny() -> Workload:
    spec = copy.deepcopy(dict(load_workload("agentic-v1").spec))
    spec["name"] = "agentic-v1-tiny"
    spec["conversations"]["turns"] = 2
    spec["arrivals"]["rate"] = 4.0
    spec["bounds"] = {"max_requests": 6, "max_seconds": 20}
    return validate_workload(spec, str(WORKLOADS_DIR / "agentic-v1.json") + " (tiny)")


def _chat(stack: Stack, key: str, revision: str) -> httpx.Response:
    return httpx.post(
        stack.config.base_url + "/chat/completions",
        headers={"authorization": f"Bearer {key}", REVISION: revision},
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
        verify=str(stack.config.ca_path) if stack.config.ca_path else True,
        timeout=60,
    )


def test_guidellm_pinned_to_the_serving_revision_through_the_edge(
    stack: Stack, api_key: str, tmp_path: Path
) -> None:
    (serving,) = {e.revision for e in stack.serving_endpoints()}
    operator = benchmark_key_file(stack.config.data_dir).read_text("utf-8").strip()
    workload = _tiny()
    report = run_workload(
        stack.config.base_url,
        operator,
        MODEL_NAME,
        workload,
        serving,
        180,
        ca_path=stack.config.ca_path,
    )
    assert report.requests_errored == 0, report.errors
    assert report.requests_successful >= 1, report.figures()
    assert report.ttft_p99_seconds > 0 and report.output_tokens_per_second > 0
    assert report.revision == serving and report.environment["guidellm_version"]

    answer = _chat(stack, operator, serving)
    assert answer.status_code == 200, answer.text
    assert answer.headers.get(SERVED_REVISION) == serving

    refused = _chat(stack, api_key, serving)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "insufficient_scope"

    missing = _chat(stack, operator, "no-such-revision")
    assert missing.status_code == 503, missing.text
    assert missing.json()["error"]["code"] == "revision_unavailable"
