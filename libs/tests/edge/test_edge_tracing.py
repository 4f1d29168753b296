"""The edge's OpenTelemetry tracer against a real Envoy: it continues a client's
`traceparent` or starts a trace, hands the picker its ext_proc span in the side stream's gRPC
metadata and the replica its upstream span in the request's, and exports its spans over
OTLP/gRPC (the suite's receiver)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferplane.edge import EdgeConfig, build_http_connection_manager
from inferplane.runtime.tracing import REQUEST_ID_ATTRIBUTE
from inferplane.testing.otlp import OtlpReceiver, ReceivedSpan

from .conftest import Edge, running_edge

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_edge(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Edge]:
    data = Path(tmp_path_factory.mktemp("traced-edge"))
    with running_edge(
        data, otlp_traces_endpoint=receiver.endpoint, trace_sampling_percent=100.0
    ) as edge:
        yield edge


def _parent_of(metadata: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent span id) of a `traceparent`."""
    _version, trace_id, span_id, _flags = metadata["traceparent"].split("-")
    return trace_id, span_id


def _edge_spans(receiver: OtlpReceiver, trace_id: str, count: int) -> list[ReceivedSpan]:
    spans = receiver.wait_for(
        lambda spans: sum(s.trace_id == trace_id for s in spans) >= count, timeout_s=15
    )
    return [s for s in spans if s.trace_id == trace_id]


def test_tracing_is_off_without_a_collector() -> None:
    config = EdgeConfig(router_endpoints=("127.0.0.1:1",), auth_endpoint="127.0.0.1:2")
    assert "tracing" not in build_http_connection_manager(config)


def test_a_client_trace_is_continued_to_the_picker_and_the_replica(
    traced_edge: Edge, receiver: OtlpReceiver
) -> None:
    picks, calls = len(traced_edge.picker.picks), len(traced_edge.inference.calls)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    response = httpx.post(
        f"{traced_edge.url}/v1/chat/completions",
        json=BODY,
        headers={"authorization": "Bearer good", "traceparent": traceparent},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    pick = traced_edge.picker.picks[picks]
    call = traced_edge.inference.calls[calls]
    request_id = call.metadata["x-request-id"]
    # The picker's side stream carries its own span (a child of the edge's ingress span).
    picker_trace, picker_parent = _parent_of(pick.stream_metadata)
    replica_trace, replica_parent = _parent_of(call.metadata)
    assert picker_trace == replica_trace == CLIENT_TRACE

    spans = _edge_spans(receiver, CLIENT_TRACE, 3)
    by_id = {s.span_id: s for s in spans}
    ingress = next(s for s in spans if s.parent_id == CLIENT_PARENT)
    assert ingress.service == "inferplane-edge"
    assert ingress.attributes[REQUEST_ID_ATTRIBUTE] == request_id
    # The ext_proc stream's span and the upstream span are the ingress span's children.
    assert by_id[picker_parent].parent_id == ingress.span_id
    assert by_id[replica_parent].parent_id == ingress.span_id
    assert picker_parent != replica_parent


def test_a_request_without_traceparent_starts_a_trace(
    traced_edge: Edge, receiver: OtlpReceiver
) -> None:
    calls = len(traced_edge.inference.calls)
    response = httpx.post(
        f"{traced_edge.url}/v1/chat/completions",
        json=BODY,
        headers={"authorization": "Bearer good"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    trace_id, parent = _parent_of(traced_edge.inference.calls[calls].metadata)
    assert trace_id != CLIENT_TRACE
    spans = _edge_spans(receiver, trace_id, 2)
    roots = [s for s in spans if not s.parent_id]
    assert len(roots) == 1
    assert {s.span_id for s in spans if s.parent_id == roots[0].span_id} >= {parent}


def test_the_edge_s_sampling_decides_even_for_a_client_s_sampled_trace(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> None:
    """At 0 % the edge records nothing: a client's `traceparent` gives the trace id and the
    parent (continued), not the sampling decision (Envoy's random sampling decides for every
    request; the hops behind it follow the flag it sends)."""
    data = Path(tmp_path_factory.mktemp("unsampled-edge"))
    client_trace = "1" * 32
    with running_edge(
        data, otlp_traces_endpoint=receiver.endpoint, trace_sampling_percent=0.0
    ) as edge:
        for traceparent in (f"00-{client_trace}-{CLIENT_PARENT}-01", None):
            headers = {"authorization": "Bearer good"}
            if traceparent:
                headers["traceparent"] = traceparent
            calls = len(edge.inference.calls)
            response = httpx.post(
                f"{edge.url}/v1/chat/completions", json=BODY, headers=headers, timeout=10
            )
            assert response.status_code == 200, response.text
            sent = edge.inference.calls[calls].metadata["traceparent"]
            assert sent.endswith("-00")
            if traceparent:
                assert _parent_of({"traceparent": sent})[0] == client_trace
        time.sleep(6)  # past Envoy's 5 s flush interval
    assert not [s for s in receiver.spans if s.trace_id == client_trace]
