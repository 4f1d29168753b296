"""A fake vLLM HTTP server for tests without vLLM: `GET /health`, `GET /metrics`
(`vllm:num_requests_running`; with a KV cache model also `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:num_preemptions_total` and `vllm:cache_config_info` with
`block_size` and `num_gpu_blocks`, as vLLM names them), streaming `POST /v1/completions` with
token-id prompts and `POST /v1/embeddings` with token-id inputs (base64 float32 vectors:
`fake_embedding`, which the replica's `ScriptedEngine` returns too; a `dimensions` outside
`matryoshka_dimensions` is a 400, as vLLM answers), in the shape vLLM 0.32 answers them (see
`inferplane.replica.engines.http_client`), on a hand-written asyncio HTTP/1.1 server
(keep-alive, chunked SSE) on loopback.

In-process: `server = FakeHttpEngine(...); port = await server.start("127.0.0.1", 0)`.
As a process it takes the launcher's command line (`[OPTIONS] -- serve MODEL --host H
--port P ...`, no `--grpc`), so the supervisor runs it in place of `LAUNCHER_COMMAND`.

Generation is deterministic: token k of a request is (last prompt id + k + 1) mod 1000, its
text `" t{id}"`. Stop strings match on that text (the token ids still include the match, the
text does not), stop_token_ids end with `stop_reason` = the id, max_tokens with "length".
With `logprobs` k each token carries `fake_logprobs` (tokens written "token_id:{id}", as vLLM
writes them with `return_tokens_as_token_ids`).
KV cache (issue 29): given `kv` (`inferplane.testing.fake_kv.FakeKvCache`; as a process, vLLM's
own `--num-gpu-blocks-override N` and `--block-size B` (16 by default) among the engine's
arguments), each generation holds its blocks, waits when they are short and may be preempted,
and a context that can never fit is a 400, as vLLM answers it.
Misbehaviours (attributes, or flags as a process): `die_after_tokens` (drop the connection
without a word after N tokens), `error_after_tokens` (an error event after N tokens),
`status` (answer every generation with that HTTP status), `unhealthy` (/health 503).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from inferplane.runtime.processes import procguard
from inferplane.testing.fake_kv import FakeKvCache


def fake_logprobs(token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The fake engines' log probabilities of generated `token` with `k` alternatives:
    `(its logprob, [(id, logprob)] most likely first)`: the token itself at -0.25, then
    token + j (mod 1000) at -0.25 - j."""
    top = [((token + j) % 1000, -0.25 - j) for j in range(k)]
    return -0.25, top


def fake_embedding(
    token_ids: Sequence[int], size: int = 64, dimensions: int | None = None
) -> array[float]:
    """A deterministic float32 unit vector for one input (different ids, different vectors):
    component k is `sin((k + 1) * (1 + Σ (i + 1) · id_i))`, cut to the first `dimensions`
    values when given, then L2-normalised (the order of vLLM's embedding pooler)."""
    seed = 1 + sum((i + 1) * t for i, t in enumerate(token_ids))
    values = [math.sin((k + 1) * seed * 0.001) for k in range(size)][: dimensions or size]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return array("f", (v / norm for v in values))


class FakeHttpEngine:
    """The server; `requests` keeps every completion body received, `aborted` the request ids
    whose client went away before the end, `running` those streaming now,
    `connections_opened` the TCP connections accepted so far."""

    def __init__(
        self,
        *,
        token_delay: float = 0.01,
        cached_tokens: int = 0,
        die_after_tokens: int = -1,
        error_after_tokens: int = -1,
        status: int = 200,
        unhealthy: bool = False,
        matryoshka_dimensions: tuple[int, ...] = (16, 32, 64),
        kv: FakeKvCache | None = None,
    ) -> None:
        self.kv = kv
        self.token_delay = token_delay
        self.cached_tokens = cached_tokens
        self.die_after_tokens = die_after_tokens
        self.error_after_tokens = error_after_tokens
        self.status = status
        self.unhealthy = unhealthy
        self.matryoshka_dimensions = matryoshka_dimensions
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.connections_opened = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on `host:port` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    # -- HTTP --------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        self.connections_opened += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/health":
                    await self._reply(writer, 503 if self.unhealthy else 200, b"")
                elif method == "GET" and path == "/metrics":
                    await self._reply(writer, 200, self._metrics().encode(), "text/plain")
                elif method == "POST" and path == "/v1/completions":
                    if not await self._complete(reader, writer, json.loads(body)):
                        return
                elif method == "POST" and path == "/v1/embeddings":
                    await self._embed(writer, json.loads(body))
                else:
                    await self._reply(writer, 404, b'{"error": {"message": "not found"}}')
        except ConnectionError:
            return
        finally:
            self._connections.discard(writer)
            writer.close()

    def _metrics(self) -> str:
        """vLLM's series this fake knows, in the text exposition format."""
        kv = self.kv
        running = len(self.running) if kv is None else kv.running_requests
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {running}\n'
        )
        if kv is not None:
            usage = 1.0 - kv.free_kv_blocks / kv.total_kv_blocks
            text += (
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0"}} {kv.waiting_requests}\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
                "# TYPE vllm:num_preemptions counter\n"
                f'vllm:num_preemptions_total{{engine="0"}} {kv.preemptions_total}.0\n'
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{kv.block_size}",engine="0",'
                f'num_gpu_blocks="{kv.total_kv_blocks + 1}"}} 1.0\n'  # + vLLM's null block
            )
        return text

    @staticmethod
    async def _reply(
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = "application/json",
    ) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _embed(self, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
        """vLLM's `/v1/embeddings` answer to token-id inputs (`encoding_format` base64,
        float32, little-endian: what `HttpEngineClient` asks for)."""
        self.requests.append(request)
        dimensions = request.get("dimensions")
        if self.status != 200:
            error = {"error": {"message": "the engine is broken", "code": self.status}}
            await self._reply(writer, self.status, json.dumps(error).encode())
            return
        if dimensions is not None and dimensions not in self.matryoshka_dimensions:
            message = f"Model only supports Matryoshka dimensions {self.matryoshka_dimensions}"
            error = {"error": {"message": message, "code": 400}}
            await self._reply(writer, 400, json.dumps(error).encode())
            return
        inputs = request["input"]
        data = [
            {
                "index": i,
                "object": "embedding",
                "embedding": base64.b64encode(
                    fake_embedding(ids, 64, dimensions).tobytes()
                ).decode(),
            }
            for i, ids in enumerate(inputs)
        ]
        tokens = sum(len(ids) for ids in inputs)
        answer = {
            "object": "list",
            "data": data[::-1],  # `index`, not the order, says which input a vector is
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await self._reply(writer, 200, json.dumps(answer).encode())

    @staticmethod
    def _event(writer: asyncio.StreamWriter, payload: str) -> None:
        data = f"data: {payload}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def _complete(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: dict[str, Any]
    ) -> bool:
        """Streams one completion; returns False when the connection is gone."""
        self.requests.append(req)
        rid = str(req.get("request_id", ""))
        if self.status != 200:
            message = json.dumps({"error": {"message": f"fake status {self.status}"}})
            await self._reply(writer, self.status, message.encode())
            return True
        prompt = list(req["prompt"])
        kv = self.kv
        if kv is not None:
            try:
                await kv.start(rid, len(prompt), int(req.get("max_tokens", 16)))
            except ValueError as exc:
                message = json.dumps({"error": {"message": str(exc), "code": 400}})
                await self._reply(writer, 400, message.encode())
                return True
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        stops = list(req.get("stop") or [])
        stop_ids = set(req.get("stop_token_ids") or [])
        ignore_eos = bool(req.get("ignore_eos"))
        base = prompt[-1] if prompt else 0
        text = ""
        # The client closing its side is how vLLM learns of an abort.
        gone = asyncio.ensure_future(reader.read(1))
        gone.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reset is expected
        self.running.add(rid)
        finished = False
        try:
            reason, stop_reason = "length", None
            n = 0
            for k in range(int(req.get("max_tokens", 16))):
                await asyncio.sleep(self.token_delay)
                if kv is not None:
                    await kv.step(rid)
                if gone.done():
                    return False
                if k == self.die_after_tokens:
                    writer.transport.abort()
                    return False
                if k == self.error_after_tokens:
                    await self._stop_watching(gone)
                    self._event(writer, json.dumps({"error": {"message": "engine core died"}}))
                    self._event(writer, "[DONE]")
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                    finished = True
                    return True
                token = (base + k + 1) % 1000
                n += 1
                piece = f" t{token}"
                text += piece
                hit = next((s for s in stops if s in text), None)
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": "" if hit else piece,
                    "token_ids": [token],
                    "finish_reason": None,
                }
                if req.get("logprobs") is not None:
                    value, top = fake_logprobs(token, int(req["logprobs"]))
                    choice["logprobs"] = {
                        "tokens": [f"token_id:{token}"],
                        "token_logprobs": [value],
                        "top_logprobs": [{f"token_id:{t}": lp for t, lp in top}],
                        "text_offset": [len(text) - len(piece)],
                    }
                if hit is not None:
                    reason, stop_reason = "stop", hit
                elif token in stop_ids and not ignore_eos:
                    reason, stop_reason = "stop", token
                last = hit is not None or reason == "stop" or k + 1 == req.get("max_tokens", 16)
                if last:
                    choice["finish_reason"] = reason
                    choice["stop_reason"] = stop_reason
                self._event(writer, json.dumps({"id": rid, "choices": [choice]}))
                await writer.drain()
                if last:
                    break
            # Stop watching for a disconnect before the last bytes: once the client has read
            # them it may send its next request on this connection.
            await self._stop_watching(gone)
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "total_tokens": len(prompt) + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            self._event(writer, json.dumps({"id": rid, "choices": [], "usage": usage}))
            self._event(writer, "[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            finished = True
            return True
        except ConnectionError:
            return False
        finally:
            if kv is not None:
                kv.finish(rid)
            self.running.discard(rid)
            if not finished:
                self.aborted.append(rid)
            if not gone.done():
                gone.cancel()

    @staticmethod
    async def _stop_watching(gone: asyncio.Future[bytes]) -> None:
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await gone


def parse(argv: list[str]) -> argparse.Namespace:
    """The launcher-style command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="fake-http-engine")
    parser.add_argument("--token-delay", type=float, default=0.01)
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc", action="store_true")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=0)  # vLLM's: the KV model
    parser.add_argument("--block-size", type=int, default=16)  # vLLM's
    argv = [a for a in argv if a != "--"]
    if "serve" in argv:
        at = argv.index("serve")
        argv = [*argv[:at], *argv[at + 2 :]]
    opts, _unknown = parser.parse_known_args(argv)
    return opts


async def _main(opts: argparse.Namespace) -> int:
    blocks = opts.num_gpu_blocks_override
    kv = FakeKvCache(blocks, opts.block_size) if blocks > 0 else None
    engine = FakeHttpEngine(token_delay=opts.token_delay, kv=kv)
    await engine.start(opts.host, opts.port)
    child = None
    if opts.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"fake http engine serving on {opts.host}:{opts.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await engine.stop()
    if child is not None:
        child.kill()
    return 0


def main() -> int:
    opts = parse(sys.argv[1:])
    if opts.grpc:
        print("fake http engine: --grpc given, this fake serves HTTP only", flush=True)
        return 2
    if os.getpgrp() == os.getpid():
        procguard.guard_parent(poll_seconds=0.1, grace_seconds=1.0)
    return asyncio.run(_main(opts))


if __name__ == "__main__":
    raise SystemExit(main())
