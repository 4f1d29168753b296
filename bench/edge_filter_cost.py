"""What each response-path piece of the edge's filter chain costs Envoy per streamed chunk.

    .venv/bin/python bench/edge_filter_cost.py [--requests 15] [--rounds 9]

Runs the edge exactly as `inferplane.edge` builds it (`build_bootstrap`), one Envoy per
variant, each with `--concurrency 1`, side by side in front of the same in-process fakes: an
`InferenceService` whose `StreamChatCompletionEvents` streams a fixed number of SSE chunks (one
gRPC message each, ~160 bytes, as the replica writes a token), an ext_authz that allows, and an
endpoint picker (ext_proc) that picks the fake and marks the request authenticated and routed.
Variants:

    edge                  the chain as built
    no_lua_response       the Lua filters without their response hooks (`envoy_on_response`)
    lua_response_x8       the chain plus 8 Lua filters whose response hook reads one header
                          (the cost of one such hook, magnified 8 times)
    no_ext_proc_response  ext_proc without the response headers and trailers messages
    no_access_logs        without the stdout and gRPC access logs

For each variant, Envoy's CPU (all its threads, /proc schedstat, ns resolution) over sequential
streamed requests of 64 and of 1,024 chunks, in `--rounds` interleaved rounds (the variants'
order rotating) so machine noise hits every variant alike, less Envoy's idle rate over the same
wall time; figures are the medians over rounds. The per-chunk cost
is (CPU at 1,024 − CPU at 64) / 960; a hook's cost is its variant's difference from `edge`.
Last lines, per variant V:

    V_envoy_cpu_us_per_request_64: A
    V_envoy_cpu_us_per_request_1024: B
    V_envoy_cpu_us_per_chunk: (B - A) / 960
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.api import httpbody_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.edge import EdgeConfig, Endpoint, EnvoyProcess, build_bootstrap
from inferplane.edge._base import render_bootstrap
from inferplane.runtime.processes.ports import free_port
from inferplane.wire import sse_event
from inferplane.wire.headers import (
    DESTINATION_ENDPOINT,
    PICK_NAMESPACE,
    PICKER_AUTHENTICATED,
    PICKER_MODEL,
    PICKER_NAMESPACE,
)

MODEL = "bench"
LENGTHS = (64, 1024)
VARIANTS = ("edge", "no_lua_response", "lua_response_x8", "no_ext_proc_response", "no_access_logs")
#: A Lua filter that only reads a response header, as the edge's response hooks do on success.
HEADER_HOOK = """
function envoy_on_response(handle)
  if handle:headers():get(":status") == "599" then
    handle:headers():add("x-bench", "1")
  end
end
"""


def _chunk(i: int) -> bytes:
    payload = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1_767_225_600,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
    }
    return sse_event(json.dumps(payload, separators=(",", ":")).encode())


class Replica(pb_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Streams `max_tokens` SSE chunks, one gRPC message each, then `[DONE]`."""

    def StreamChatCompletionEvents(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[httpbody_pb2.HttpBody]:
        count = request.request.max_tokens or 64
        yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=_chunk(0))
        for i in range(1, count):
            yield httpbody_pb2.HttpBody(data=_chunk(i))
        yield httpbody_pb2.HttpBody(data=b"data: [DONE]\n\n")


class Authz(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        return external_auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK))


class Picker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Picks `target`; marks the request authenticated and routed as MODEL (dynamic
    metadata), answering whatever phase Envoy sends."""

    def __init__(self) -> None:
        self.target = ""

    def _metadata(self) -> struct_pb2.Struct:
        metadata = struct_pb2.Struct()
        metadata.update(
            {
                PICK_NAMESPACE: {DESTINATION_ENDPOINT: self.target},
                PICKER_NAMESPACE: {PICKER_AUTHENTICATED: True, PICKER_MODEL: MODEL},
            }
        )
        return metadata

    def Process(self, requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                yield ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(), dynamic_metadata=self._metadata()
                )
            elif kind == "request_body":
                yield ep.ProcessingResponse(
                    request_body=ep.BodyResponse(), dynamic_metadata=self._metadata()
                )
            elif kind == "response_headers":
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
            elif kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def _server(*register: Any) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    for add, servicer in register:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _without_response_hook(source: str) -> str:
    """A Lua source whose `envoy_on_response` is gone: Envoy then runs no response coroutine."""
    return source + "\nenvoy_on_response = nil\n"


def _variant(bootstrap: dict[str, Any], variant: str) -> dict[str, Any]:
    """`bootstrap` (changed in place) with `variant`'s piece removed."""
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    config = hcm["typed_config"]
    if variant == "no_lua_response":
        for f in config["http_filters"]:
            code = f["typed_config"].get("default_source_code")
            if code and re.search(r"^function envoy_on_response", code["inline_string"], re.M):
                code["inline_string"] = _without_response_hook(code["inline_string"])
    elif variant == "lua_response_x8":
        hooks = [
            {
                "name": f"bench.header_hook_{i}",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                    "default_source_code": {"inline_string": HEADER_HOOK},
                },
            }
            for i in range(8)
        ]
        config["http_filters"][-1:-1] = hooks  # before the router
    elif variant == "no_ext_proc_response":
        for f in config["http_filters"]:
            mode = f["typed_config"].get("processing_mode")
            if mode is not None:
                mode["response_header_mode"] = "SKIP"
                mode["response_trailer_mode"] = "SKIP"
    elif variant == "no_access_logs":
        config.pop("access_log", None)
    return bootstrap


def envoy_cpu_seconds(pid: int) -> float:
    """CPU time (s) of every thread of `pid` (schedstat: nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def _stream(client: httpx.Client, url: str, tokens: int) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"authorization": "Bearer bench", "x-api-key": "bench"}
    with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()[:300]
        events = sum(1 for line in response.iter_lines() if line.startswith("data: "))
    assert events == tokens + 1, (events, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15, help="per variant, length, round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = parser.parse_args()
    replica, replica_port = _server(
        (pb_grpc.add_InferenceServiceServicer_to_server, Replica())  # type: ignore[abstract]
    )
    picker = Picker()
    picker.target = f"127.0.0.1:{replica_port}"
    side, side_port = _server(
        (external_auth_pb2_grpc.add_AuthorizationServicer_to_server, Authz()),
        (ep_grpc.add_ExternalProcessorServicer_to_server, picker),
    )
    envoys: dict[str, tuple[EnvoyProcess, str]] = {}
    variants = args.variants.split(",")
    rounds: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in LENGTHS}
    with tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=60) as client:
        try:
            for variant in variants:
                config = EdgeConfig(
                    router_endpoints=(Endpoint("127.0.0.1", side_port),),
                    auth_endpoint=Endpoint("127.0.0.1", side_port),
                    telemetry_endpoint=Endpoint("127.0.0.1", side_port),
                    replica_endpoints=(Endpoint("127.0.0.1", replica_port),),
                    listen_port=free_port(),
                    admin_port=free_port(),
                )
                text = render_bootstrap(
                    _variant(build_bootstrap(config), variant), "json", generated_by=__file__
                )
                envoy = EnvoyProcess(
                    text,
                    data_dir=Path(tmp) / variant,
                    admin_url=f"http://127.0.0.1:{config.admin_port}",
                    concurrency=1,
                    log_level="warning",
                )
                envoy.start()
                url = f"http://127.0.0.1:{config.listen_port}/v1/chat/completions"
                envoys[variant] = (envoy, url)
                for tokens in LENGTHS:  # warm-up, and a check that the variant still serves
                    for _ in range(3):
                        _stream(client, url, tokens)
            idle = {}
            start = {v: envoy_cpu_seconds(e.pid or 0) for v, (e, _) in envoys.items()}
            time.sleep(3.0)
            for variant, (envoy, _) in envoys.items():
                idle[variant] = (envoy_cpu_seconds(envoy.pid or 0) - start[variant]) / 3.0
            order = list(variants)
            for _ in range(args.rounds):
                order = order[1:] + order[:1]  # each variant takes each place in turn
                for tokens in LENGTHS:
                    for variant in order:
                        envoy, url = envoys[variant]
                        pid = envoy.pid or 0
                        before, started = envoy_cpu_seconds(pid), time.perf_counter()
                        for _ in range(args.requests):
                            _stream(client, url, tokens)
                        wall = time.perf_counter() - started
                        used = envoy_cpu_seconds(pid) - before - idle[variant] * wall
                        rounds[variant, tokens].append(used * 1e6 / args.requests)
        finally:
            for envoy, _ in envoys.values():
                envoy.stop()
            replica.stop(grace=None)
            side.stop(grace=None)
    per_request = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"{'variant':<22} {'us/req 64':>10} {'us/req 1024':>12} {'us/chunk':>9}")
    rows = {}
    for variant in variants:
        a, b = per_request[variant, 64], per_request[variant, 1024]
        rows[variant] = (a, b, (b - a) / (1024 - 64))
        print(f"{variant:<22} {a:>10.1f} {b:>12.1f} {rows[variant][2]:>9.3f}")
    print(f"# idle Envoy CPU: {statistics.mean(idle.values()) * 1e3:.3f} ms/s")
    for variant, (a, b, chunk) in rows.items():
        print(f"{variant}_envoy_cpu_us_per_request_64: {a:.1f}")
        print(f"{variant}_envoy_cpu_us_per_request_1024: {b:.1f}")
        print(f"{variant}_envoy_cpu_us_per_chunk: {chunk:.3f}")


if __name__ == "__main__":
    main()
