"""Hostile requests through the real data path (a real Envoy edge, the real router as its
endpoint picker, real auth and telemetry, a fake replica; `fabric.Fabric`), for a
model with a 2,048-token context, as the issue's probe sent them: prompts too large to fit are
refused by the picker in milliseconds, sent chunked (no Content-Length), and never reach the
replica; a body over the edge's limit is its 413; CONNECT is an immediate 405."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from inferplane.fixtures import kimi_tiny

from .fabric import MODEL, Fabric, _body, _run

pytestmark = pytest.mark.timeout(120)
CONTEXT = 2048


def _chunked(size: int) -> AsyncIterator[bytes]:
    data = b'{"model":"%s","messages":[{"role":"user","content":"%s"}]}' % (
        MODEL.encode(),
        b"x" * size,
    )

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    return pieces()


def test_oversized_prompts_are_refused_before_the_replica(tmp_path: Path) -> None:
    async def body(fabric: Fabric) -> None:
        _, secret = await fabric.key()
        headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
        url = f"{fabric.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            ok = await client.post(url, json=_body(), headers=headers)
            assert ok.status_code == 200, ok.text  # starts the bound's one-time read
            for _ in range(100):  # until the router has read the tokenizer's bound
                first = await client.post(url, content=_chunked(1 << 20), headers=headers)
                if first.status_code == 400:
                    break
                await asyncio.sleep(0.05)
            calls = fabric.replicas[0].calls
            for size in (1 << 20, 6 << 20):
                started = time.monotonic()
                answer = await client.post(url, content=_chunked(size), headers=headers)
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["code"] == "context_length_exceeded"
                assert str(CONTEXT) in error["message"]
                assert time.monotonic() - started < 5
            over = await client.post(url, content=_chunked(10 << 20), headers=headers)
            assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
            assert fabric.replicas[0].calls == calls
        port = int(fabric.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 405 ")

    asyncio.run(
        _run(
            tmp_path,
            body,
            route={"max_model_len": CONTEXT, "tokenizer": str(kimi_tiny.model_path())},
        )
    )
