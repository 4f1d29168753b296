"""Traces across every hop (docs/tracing.md): a stack whose services, replica process, vLLM
engine and Envoy edge export to the suite's OTLP receiver (`inferplane.testing.otlp`) at 100 %
sampling. Each request yields exactly one trace, in which:

- the edge's ingress span is the root (or the client's `traceparent` is its parent);
- the picker's `authn`, `pick` (and `queue` under it) hang under the edge's ext_proc span,
  a child of the ingress span;
- the replica's `replica` span hangs under the edge's upstream span (another child of the
  ingress span), with `render`, `prefill`, `decode` and `parse` under it, one each;
- vLLM's own `llm_request` span hangs under the `replica` span;
- the request id (the response's `x-request-id`) is on the ingress, picker and replica spans.

Its own stack (module scope, one kimi-tiny replica): tracing stays off in the session's.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from inferplane.localstack import MODEL_NAME, Stack, running_stack
from inferplane.runtime.tracing import REQUEST_ID_ATTRIBUTE
from inferplane.testing.otlp import OtlpReceiver, ReceivedSpan

from .conftest import local_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
EDGE, ROUTER, REPLICA = "inferplane-edge", "inferplane-router", "inferplane-replica"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_stack(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[Stack]:
    config = local_config(
        tmp_path_factory.mktemp("traced"),
        otlp_traces_endpoint=receiver.endpoint,
        trace_sampling_ratio=1.0,
    )
    with running_stack(config, print) as started:
        yield started


@pytest.fixture(scope="module")
def http(traced_stack: Stack) -> Iterator[httpx.Client]:
    key = traced_stack.create_api_key("tracing")
    with httpx.Client(
        base_url=traced_stack.config.base_url,
        headers={"authorization": f"Bearer {key}"},
        verify=False,
        timeout=120,
    ) as client:
        yield client


def _chat(http: httpx.Client, *, stream: bool, headers: dict[str, str] | None = None) -> str:
    """One chat through the edge; returns its request id."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "stream": stream,
    }
    response = http.post("/chat/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert request_id
    return request_id


def _trace_of(receiver: OtlpReceiver, request_id: str) -> list[ReceivedSpan]:
    """Every span of the one trace `request_id` is in, once each hop has exported its part
    (Envoy flushes every 5 s)."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        tagged = [s for s in spans if s.attributes.get(REQUEST_ID_ATTRIBUTE) == request_id]
        services = {s.service for s in tagged}
        names = {s.name for s in spans if s.trace_id in {t.trace_id for t in tagged}}
        return {EDGE, ROUTER, REPLICA} <= services and "llm_request" in names

    spans = receiver.wait_for(complete, timeout_s=30)
    tagged = [s for s in spans if s.attributes.get(REQUEST_ID_ATTRIBUTE) == request_id]
    traces = {s.trace_id for s in tagged}
    assert len(traces) == 1, f"request {request_id} is in {len(traces)} traces"
    (trace_id,) = traces
    return [s for s in spans if s.trace_id == trace_id]


def _check_parenting(spans: list[ReceivedSpan], request_id: str, root_parent: str) -> None:
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    (ingress,) = [s for s in spans if s.service == EDGE and s.parent_id == root_parent]
    assert ingress.attributes[REQUEST_ID_ATTRIBUTE] == request_id
    edge_children = {
        s.span_id for s in spans if s.service == EDGE and s.parent_id == ingress.span_id
    }

    picker = {s.name: s for s in spans if s.service == ROUTER}
    assert sorted(picker) == ["authn", "pick", "queue"]
    assert picker["authn"].parent_id in edge_children  # Envoy's ext_proc span
    assert picker["pick"].parent_id == picker["authn"].parent_id
    assert picker["queue"].parent_id == picker["pick"].span_id
    for span in picker.values():
        assert span.attributes[REQUEST_ID_ATTRIBUTE] == request_id

    replica = [s for s in spans if s.service == REPLICA]
    (top,) = [s for s in replica if s.name == "replica"]
    assert top.parent_id in edge_children  # Envoy's upstream span
    assert top.parent_id != picker["pick"].parent_id
    stages = sorted(s.name for s in replica if s.parent_id == top.span_id)
    assert stages == ["decode", "parse", "prefill", "render"]
    for span in replica:
        assert span.attributes[REQUEST_ID_ATTRIBUTE] == request_id
    (engine,) = [s for s in spans if s.name == "llm_request"]
    assert engine.parent_id == top.span_id
    # Nothing else, and nothing dangling: every parent is in the trace (or the client's).
    assert len(spans) == len(replica) + len(picker) + 1 + len(edge_children) + 1
    for span in spans:
        assert span.parent_id in by_id or span.parent_id == root_parent


def test_each_request_is_one_trace_across_edge_picker_replica_and_engine(
    http: httpx.Client, receiver: OtlpReceiver
) -> None:
    for stream in (True, False):
        request_id = _chat(http, stream=stream)
        _check_parenting(_trace_of(receiver, request_id), request_id, root_parent="")


def test_a_client_traceparent_is_continued(http: httpx.Client, receiver: OtlpReceiver) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    request_id = _chat(http, stream=True, headers={"traceparent": traceparent})
    spans = _trace_of(receiver, request_id)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    _check_parenting(spans, request_id, root_parent=CLIENT_SPAN)
