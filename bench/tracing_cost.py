"""The CPU cost of tracing per request (docs/tracing.md): Envoy, the endpoint picker and the
replica process, with tracing off, at 1 % and at 100 % sampling, side by side.

    .venv/bin/python bench/tracing_cost.py [--requests 200] [--rounds 5] [--hook-requests 2000]

Every span goes over OTLP/gRPC to the suite's receiver (`inferplane.testing.otlp`), run in a
process of its own so that its CPU is nobody's here. Three parts, each in interleaved rounds
(off, 1 %, 100 %, then again), reporting the median over rounds:

- Envoy: three edges (`EdgeConfig` without a collector, with `trace_sampling_percent` 1 and
  100) in front of the same fakes (`inferplane.testing.picker.FakePicker` and the replica's
  own servicer over a scripted 64-token engine); each request a streamed chat through one
  edge, batches of `ENVOY_BATCH` alternating between the edges; CPU per request = the Envoy
  process's CPU (all threads, /proc schedstat) over its batches / their requests. 1 %: the
  edge samples new traces at 1 %.
- picker: the picker's span hooks (`inferplane.router.picker.tracing.PickerTracing`: the
  stream's parent, `authn`, `pick`, `queue`) around an empty request, as the picker runs them
  per request, with the SDK and its batching exporter (this process's CPU, all threads).
- replica: the replica's (`inferplane.replica.tracing.ReplicaTracing`: the `replica` span,
  the engine's trace headers, `render` / `prefill` / `decode` / `parse` written at the end)
  plus the per-step parse timing of a 64-token generation.

For the picker and the replica the cost is the tracing code's own (the "off" figure is the
rig's: building the request's stand-ins, the same in every mode): the rest of their work
per request is the same in every mode (the picker's decision: bench/router_decision.py; the
replica's: bench/edge_overhead.py). At 1 %, 1 request in 100 carries a sampled
`traceparent` (the edge's decision), the others an unsampled one, as behind a 1 % edge.
Last lines:

    envoy_cpu_us_per_request_{off,1pct,100pct}: E
    picker_tracing_cpu_us_per_request_{off,1pct,100pct}: P
    replica_tracing_cpu_us_per_request_{off,1pct,100pct}: R
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.edge import EdgeConfig, Endpoint, EnvoyProcess
from inferplane.replica.server.outcome import End, Ending
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    script,
)
from inferplane.replica.tracing import CURRENT, ReplicaTracing
from inferplane.router.picker.tracing import PickerTracing
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.tracing import DISABLED, Tracing, TracingSettings
from inferplane.testing.picker import GOOD_KEY, FakePicker
from inferplane.wire import ResponseSummary

MODES = ("off", "1pct", "100pct")
RATIO = {"off": 0.0, "1pct": 0.01, "100pct": 1.0}
TOKENS = 64
ENVOY_BATCH = 10  # Envoy: requests per mode before the next mode's turn
FLUSH_EVERY = 100  # requests between forced exports in the hook loops (none is dropped)
TEXT = "Here is a short note about Paris. I hope it helps. " * 8
RECEIVER = (
    "import sys, time\n"
    "from inferplane.testing.otlp import OtlpReceiver\n"
    "OtlpReceiver(int(sys.argv[1])).start()\n"
    "time.sleep(1e9)\n"
)


def cpu_seconds(pid: int) -> float:
    """CPU time (s) of every thread of `pid` (schedstat: nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


@contextlib.contextmanager
def receiver_process() -> Iterator[str]:
    """An OTLP receiver in a child process; yields its `host:port`."""
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(1)
                break
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline or child.poll() is not None:
                    raise RuntimeError("the OTLP receiver did not start") from None
        yield f"127.0.0.1:{port}"
    finally:
        child.terminate()
        child.wait(10)


def _traceparent(sampled: bool) -> str:
    trace_id = f"{random.getrandbits(128):032x}"
    span_id = f"{random.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def _sampled(mode: str) -> bool:
    return random.random() < RATIO[mode]


# -- Envoy ------------------------------------------------------------------------------------


class _ReplicaThread:
    """The replica's servicer over a scripted 64-token engine, on an event loop of its own."""

    def __init__(self) -> None:
        from inferplane.replica.pipeline import ModelAssetsCache
        from inferplane.replica.server import InferenceServicer

        ids = kimi_tiny_ids(TEXT)[: TOKENS - 1] + kimi_tiny_ids("<|im_end|>")
        engine = ScriptedEngine(script(ids, prompt_tokens=12))
        assets = ModelAssetsCache()
        assets.put(kimi_tiny_assets(), "kimi_k2")
        self.servicer = InferenceServicer(FakeReplica("r1", kimi_tiny_spec(), engine), assets)
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        self._loop.run_until_complete(server.start())
        self._ready.set()
        self._loop.run_forever()


def _envoy_rounds(collector: str, requests: int, rounds: int) -> dict[str, float]:
    """Median Envoy CPU µs per streamed chat, per mode."""
    replica = _ReplicaThread()
    picker = FakePicker()
    picker.targets = [f"127.0.0.1:{replica.port}"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    picker_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    edges: dict[str, EnvoyProcess] = {}
    urls: dict[str, str] = {}
    body = {
        "model": "kimi-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    per_round: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in MODES:
                config = EdgeConfig(
                    router_endpoints=(Endpoint("127.0.0.1", picker_port),),
                    auth_endpoint=Endpoint("127.0.0.1", free_port()),
                    replica_endpoints=(Endpoint("127.0.0.1", replica.port),),
                    listen_port=free_port(),
                    admin_port=free_port(),
                    access_log=False,
                    otlp_traces_endpoint=None if mode == "off" else collector,
                    trace_sampling_percent=RATIO[mode] * 100,
                )
                edge = EnvoyProcess.from_config(config, Path(tmp) / mode, concurrency=1)
                edge.start()
                edges[mode] = edge
                urls[mode] = f"http://127.0.0.1:{config.listen_port}/v1/chat/completions"
            headers = {"authorization": f"Bearer {GOOD_KEY}"}
            with httpx.Client(timeout=60) as client:

                def one(mode: str) -> None:
                    with client.stream("POST", urls[mode], json=body, headers=headers) as r:
                        assert r.status_code == 200, r.read()
                        for _ in r.iter_bytes():
                            pass

                for mode in MODES:  # warm-up
                    for _ in range(10):
                        one(mode)
                for _ in range(rounds):
                    spent = dict.fromkeys(MODES, 0.0)
                    for _ in range(max(1, requests // ENVOY_BATCH)):
                        for mode in MODES:  # batches alternate: noise hits every mode alike
                            pid = edges[mode].pid
                            assert pid is not None
                            before = cpu_seconds(pid)
                            for _ in range(ENVOY_BATCH):
                                one(mode)
                            spent[mode] += cpu_seconds(pid) - before
                    count = max(1, requests // ENVOY_BATCH) * ENVOY_BATCH
                    for mode in MODES:
                        per_round[mode].append(spent[mode] * 1e6 / count)
        finally:
            for edge in edges.values():
                edge.stop()
            server.stop(grace=None)
    return {m: statistics.median(v) for m, v in per_round.items()}


# -- picker and replica hooks -----------------------------------------------------------------


def _tracing(mode: str, collector: str, service: str) -> Tracing:
    if mode == "off":
        return DISABLED
    # The parent's flag decides (the edge's 1 % or 100 %); the ratio is for root traces only.
    return Tracing(TracingSettings(endpoint=collector, sampling_ratio=0.0, service_name=service))


def _context(traceparent: str | None) -> Any:
    pairs = [("x-request-id", "r-1")] + ([("traceparent", traceparent)] if traceparent else [])
    return SimpleNamespace(invocation_metadata=lambda: pairs)


def _exchange(traceparent: str | None) -> Any:
    metadata = {"x-request-id": "r-1"} | ({"traceparent": traceparent} if traceparent else {})
    trace = SimpleNamespace(
        request_id="r-1", model="kimi-tiny", deployment="kimi-tiny", replica="r1",
        tenant="t1", error_code="",
    )  # fmt: skip
    pick = SimpleNamespace(endpoints=(SimpleNamespace(address="10.0.0.1:50054"),))
    return SimpleNamespace(request=SimpleNamespace(metadata=metadata), trace=trace, pick=pick)


def _picker_request(hooks: PickerTracing, mode: str) -> None:
    made = _traceparent(_sampled(mode))  # made in every mode: the rig costs each mode alike
    traceparent = None if mode == "off" else made
    exchange = _exchange(traceparent)
    hooks.stream_opened(_context(traceparent))
    with hooks.authn(exchange):
        pass
    with hooks.pick(exchange), hooks.queue(exchange):
        pass


def _replica_request(hooks: ReplicaTracing, mode: str) -> None:
    made = _traceparent(_sampled(mode))
    traceparent = None if mode == "off" else made
    now = time.monotonic()
    summary = ResponseSummary(
        replica_id="r1", prompt_tokens=12, completion_tokens=TOKENS, finish_reason="stop"
    )
    gen = SimpleNamespace(
        submitted=now, ttft_seconds=0.001, last_output=now + 0.002, parse_seconds=0.0
    )
    facts = SimpleNamespace(
        api="chat", stream=True, started=now, gen=gen, model="kimi-tiny", replica="r1",
        summary=lambda ending: summary,
    )  # fmt: skip
    traced = hooks.begin(_context(traceparent), facts)  # type: ignore[arg-type]
    trace = CURRENT.get()
    if trace is not None and trace.recording:  # what `Generation` adds per engine step
        for _ in range(TOKENS):
            parsing = time.perf_counter()
            gen.parse_seconds += time.perf_counter() - parsing
    hooks.end(traced, facts, Ending(End.COMPLETED, "stop"))  # type: ignore[arg-type]


def _hook_rounds(
    collector: str, requests: int, rounds: int, service: str, make: Callable[[Tracing], Any],
    run: Callable[[Any, str], None],
) -> dict[str, float]:  # fmt: skip
    """Median CPU µs per request of `run` (this process, all threads), per mode."""
    tracings = {mode: _tracing(mode, collector, service) for mode in MODES}
    hooks = {mode: make(t) for mode, t in tracings.items()}
    per_round: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm-up
        for _ in range(requests // 10):
            run(hooks[mode], mode)
    for _ in range(rounds):
        for mode in MODES:
            before = time.process_time()
            for done in range(1, requests + 1):
                run(hooks[mode], mode)
                if done % FLUSH_EVERY == 0:  # a loop outruns the exporter's queue (2,048 spans)
                    tracings[mode].flush()
            tracings[mode].flush()  # the export of this round's spans counts in it
            per_round[mode].append((time.process_time() - before) * 1e6 / requests)
    for tracing in tracings.values():
        tracing.shutdown()
    return {m: statistics.median(v) for m, v in per_round.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="Envoy: requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hook-requests", type=int, default=2000, help="per round")
    args = parser.parse_args()
    random.seed(7)
    with receiver_process() as collector:
        picker = _hook_rounds(
            collector, args.hook_requests, args.rounds, "inferplane-router",
            PickerTracing, _picker_request,
        )  # fmt: skip
        replica = _hook_rounds(
            collector, args.hook_requests, args.rounds, "inferplane-replica",
            ReplicaTracing, _replica_request,
        )  # fmt: skip
        envoy = _envoy_rounds(collector, args.requests, args.rounds)
    print(f"# medians of {args.rounds} interleaved rounds; {TOKENS}-token streamed chats")
    print(f"{'':34}{'off':>10}{'1 %':>10}{'100 %':>10}")
    rows = (
        ("envoy_cpu_us_per_request", envoy),
        ("picker_tracing_cpu_us_per_request", picker),
        ("replica_tracing_cpu_us_per_request", replica),
    )
    for name, figures in rows:
        print(f"{name:34}" + "".join(f"{figures[m]:10.1f}" for m in MODES))
    for name, figures in rows:
        for mode in MODES:
            print(f"{name}_{mode}: {figures[mode]:.1f}")


if __name__ == "__main__":
    main()
