"""A fake engine for tests and local runs without vLLM: serves `vllm.grpc.engine.VllmEngine`
(HealthCheck, Generate, Abort, GetLoads, GetModelInfo) over grpc.aio on loopback, plus a
`/metrics` endpoint with `vllm:num_requests_running`.

It takes the launcher's command line (`[OPTIONS] -- serve MODEL --grpc --host H --port P ...`),
so the supervisor runs it in place of `LAUNCHER_COMMAND`, and these options to misbehave:

    --start-delay S      seconds before the gRPC port opens (a slow start)
    --unhealthy-for S    HealthCheck says unhealthy for S seconds after start
    --fail-starts N      exit 3 at start the first N times (counted in --state-file)
    --state-file PATH    where start attempts are counted
    --die-after S        exit 1 after S seconds of serving (an engine crash)
    --spawn-child        fork a sleeping child (an "EngineCore") into the process group
    --ignore-sigterm     ignore SIGTERM (only SIGKILL stops it)
    --token-delay S      seconds between streamed tokens (default 0.01)
    --pid-file PATH      write "pid child_pid" once serving

Generation is deterministic: token k of a request is (last prompt id + k + 1) mod 1000, with
`fake_logprobs` when the request asks for logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from inferplane.runtime.processes import procguard
from inferplane.testing.fake_http_engine import fake_logprobs

Context = grpc.aio.ServicerContext[Any, Any]


class FakeEngine(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """The servicer: tokens on a timer, aborts honoured, loads reported."""

    def __init__(self, opts: argparse.Namespace, running: Gauge) -> None:
        self.opts = opts
        self.started = time.monotonic()
        self.aborted: set[str] = set()
        self.active: set[str] = set()
        self.running = running

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        healthy = time.monotonic() - self.started >= self.opts.unhealthy_for
        return pb.HealthCheckResponse(healthy=healthy, message="fake")

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        params = request.sampling_params
        ids = list(request.tokenized.input_ids)
        max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
        stop_ids = set(params.stop_token_ids)
        self.active.add(request.request_id)
        self.running.set(len(self.active))
        try:
            base = ids[-1] if ids else 0
            reason = "length"
            last: list[int] = []
            for k in range(max_tokens):
                await asyncio.sleep(self.opts.token_delay)
                if request.request_id in self.aborted:
                    reason = "abort"
                    last = []
                    break
                token = (base + k + 1) % 1000
                last = [token]
                chunk = pb.GenerateStreamChunk(
                    token_ids=last, prompt_tokens=len(ids), completion_tokens=1
                )
                if params.HasField("logprobs"):
                    value, top = fake_logprobs(token, params.logprobs)
                    chunk.output_logprobs.token_ids.append(token)
                    chunk.output_logprobs.token_logprobs.append(value)
                    chunk.output_logprobs.top_logprobs.add(
                        token_ids=[t for t, _ in top], values=[lp for _, lp in top]
                    )
                yield pb.GenerateResponse(chunk=chunk)
                if token in stop_ids and not params.ignore_eos:
                    reason = "stop"
                    break
            # Like smg-grpc-servicer 0.14: the final message repeats the last delta's ids.
            complete = pb.GenerateComplete(
                output_ids=last,
                finish_reason=reason,
                prompt_tokens=len(ids),
                completion_tokens=len(last),
            )
            if reason == "stop":
                complete.matched_token_id = last[-1]
            yield pb.GenerateResponse(complete=complete)
        finally:
            self.active.discard(request.request_id)
            self.running.set(len(self.active))

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        self.aborted.update(request.request_ids)
        return pb.AbortResponse()

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        return pb.GetLoadsResponse(
            loads=[pb.SchedulerLoad(num_running_reqs=len(self.active), max_running_requests=8)]
        )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model_path=self.opts.model,
            max_context_length=2048,
            vocab_size=1000,
            eos_token_ids=[5],
            served_model_name=self.opts.served_model_name,
        )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake-engine")
    for name in ("--start-delay", "--unhealthy-for", "--die-after", "--token-delay"):
        parser.add_argument(name, type=float, default=0.01 if name == "--token-delay" else 0.0)
    parser.add_argument("--fail-starts", type=int, default=0)
    parser.add_argument("--state-file", type=Path)
    parser.add_argument("--pid-file", type=Path)
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    # SIGTERM ends the process at once, no atexit hook or thread running (as vLLM's HTTP server
    # does: uvicorn re-raises the signal after its graceful shutdown).
    parser.add_argument("--sigterm-kills", action="store_true")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="fake")
    # The launcher's and vLLM's options it accepts and ignores (so no value is misread).
    for name in ("--cache-root", "--device", "--kv-cache-bytes", "--max-model-len", "--dtype"):
        parser.add_argument(name)
    parser.add_argument("--enforce-eager", action="store_true")
    argv = [a for a in argv if a not in ("--", "--grpc")]
    if "serve" in argv:
        at = argv.index("serve")
        argv = [*argv[:at], "--model", argv[at + 1], *argv[at + 2 :]]
    parser.add_argument("--model", default="fake")
    opts, _unknown = parser.parse_known_args(argv)
    return opts


async def serve(opts: argparse.Namespace) -> int:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", registry=registry)
    if opts.metrics_port:
        start_http_server(opts.metrics_port, addr=opts.metrics_host, registry=registry)
    await asyncio.sleep(opts.start_delay)
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(FakeEngine(opts, running), server)
    server.add_insecure_port(f"{opts.host}:{opts.port}")
    await server.start()
    child = None
    if opts.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if opts.pid_file:
        opts.pid_file.write_text(f"{os.getpid()} {child.pid if child else 0}\n")
    print(f"fake engine serving on {opts.host}:{opts.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if opts.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif opts.sigterm_kills:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        if opts.die_after:
            await asyncio.wait_for(stop.wait(), opts.die_after)
        else:
            await stop.wait()
    except TimeoutError:
        print("fake engine dying as told", flush=True)
        os._exit(1)
    await server.stop(1)
    return 0


def main() -> int:
    opts = parse(sys.argv[1:])
    if os.getpgrp() == os.getpid():
        procguard.guard_parent(poll_seconds=0.1, grace_seconds=1.0)
    if opts.state_file is not None:
        count = int(opts.state_file.read_text()) if opts.state_file.exists() else 0
        opts.state_file.write_text(str(count + 1))
        if count < opts.fail_starts:
            print(f"fake engine failing start {count + 1}", flush=True)
            return 3
    return asyncio.run(serve(opts))


if __name__ == "__main__":
    raise SystemExit(main())
